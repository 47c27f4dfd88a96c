"""tide: a compact LLM inference engine for reinforcement-learning rollouts."""

from tide.engine import Engine
from tide.sampling_params import SamplingParams
from tide.version import __version__

__all__ = ["DiffusionEngine", "Engine", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # Lazy: tide imports without diffusers; `tide.DiffusionEngine` needs it.
    if name == "DiffusionEngine":
        from tide.diffusion import DiffusionEngine

        return DiffusionEngine
    raise AttributeError(f"module 'tide' has no attribute {name!r}")
