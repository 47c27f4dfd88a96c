"""Text-to-image diffusion (FLUX.1, SDXL): tide's stage engine over diffusers/transformers components.

Importing this package does not import diffusers; `DiffusionEngine` and the pipeline modules do (the
`diffusion` extra: `pip install 'tide[diffusion]'`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tide.diffusion.config import (
    DEMO_DIFFUSION_NAME,
    DEMO_DIFFUSION_PATH,
    DiffusionConfig,
    is_diffusion_model,
)

if TYPE_CHECKING:
    from tide.diffusion.engine import DiffusionEngine

__all__ = ["DEMO_DIFFUSION_NAME", "DEMO_DIFFUSION_PATH", "DiffusionConfig", "DiffusionEngine",
           "is_diffusion_model"]


def __getattr__(name: str) -> Any:
    if name == "DiffusionEngine":
        require_diffusers()
        from tide.diffusion.engine import DiffusionEngine

        return DiffusionEngine
    raise AttributeError(f"module 'tide.diffusion' has no attribute {name!r}")


def require_diffusers() -> None:
    """ImportError with the install hint when diffusers is missing."""
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        raise ImportError("tide's diffusion pipelines need diffusers: pip install 'tide[diffusion]'") from e
