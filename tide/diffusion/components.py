"""Loading a pipeline's components from a diffusers-format directory.

`model_index.json` names each component and its class; only the classes a pipeline kind allows are
ever resolved (never an arbitrary name from the file). Models load from safetensors only
(`from_pretrained(..., use_safetensors=True)`, local files only), in the engine's dtype, then move to the
engine's device in eval mode with gradients off. `load_format="dummy"` reads only the component
configs and builds each model directly on the device in the dtype, with random weights drawn from a
generator seeded by the config's `seed` (no weight file is read; the tokenizers and scheduler still
load from the directory).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

TOKENIZER = "tokenizer"
SCHEDULER = "scheduler"
MODEL = "model"


@dataclass(frozen=True)
class ComponentInfo:
    """One loaded component: its `model_index.json` name, class, role (model, tokenizer or
    scheduler) and, for models, parameter bytes."""

    name: str
    class_name: str
    role: str
    num_bytes: int = 0


def _role(class_name: str) -> str:
    if "Tokenizer" in class_name:
        return TOKENIZER
    if "Scheduler" in class_name:
        return SCHEDULER
    return MODEL


def _resolve_class(library: str, class_name: str) -> Any:
    if library == "diffusers":
        import diffusers

        return getattr(diffusers, class_name)
    if library == "transformers":
        import transformers

        return getattr(transformers, class_name)
    raise ValueError(f"model_index.json: unknown library {library!r} for {class_name}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build_dummy(cls: Any, library: str, path: str, device: torch.device, dtype: torch.dtype,
                 seed: int) -> Any:
    """A model of `cls` built from the config at `path`, on `device` in `dtype`, random weights."""
    torch.manual_seed(seed)  # seeds every device's generator the modules' initialisers draw from
    with _default_dtype(dtype), device:
        if library == "diffusers":
            module = cls.from_config(cls.load_config(path))
        else:
            module = cls._from_config(cls.config_class.from_pretrained(path), dtype=dtype)
    # Float buffers made in float32 follow, as when loading weights (nn.Module.to: diffusers' own
    # override only adds a warning about modules to keep in float32, which tide does not do).
    return torch.nn.Module.to(module, dtype)


def load_components(model_path: str, index: dict[str, Any], allowed: dict[str, tuple[str, ...]],
                    device: torch.device, dtype: torch.dtype, load_format: str,
                    seed: int) -> tuple[dict[str, Any], list[ComponentInfo]]:
    """Load every component in `allowed` (name -> accepted class names) as `model_index.json`
    declares it. ValueError naming the component when one is missing or of a class not allowed."""
    modules: dict[str, Any] = {}
    infos: list[ComponentInfo] = []
    for i, (name, classes) in enumerate(allowed.items()):
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            raise ValueError(f"model_index.json: component {name!r} is missing (expected one of "
                             f"{list(classes)})")
        library, class_name = entry
        if class_name not in classes:
            raise ValueError(f"model_index.json: component {name!r} has class {class_name!r}; "
                             f"supported: {list(classes)}")
        path = os.path.join(model_path, name)
        if not os.path.isdir(path):
            raise ValueError(f"component {name!r}: {path} is not a directory")
        cls = _resolve_class(library, class_name)
        role = _role(class_name)
        if role == TOKENIZER:
            module = cls.from_pretrained(path, local_files_only=True)
        elif role == SCHEDULER:
            module = cls.from_config(cls.load_config(path))
        else:
            module = _load_model(cls, library, path, name, device, dtype, load_format, seed + i)
        modules[name] = module
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters()) if role == MODEL else 0
        infos.append(ComponentInfo(name, class_name, role, nbytes))
    return modules, infos


def _load_model(cls: Any, library: str, path: str, name: str, device: torch.device,
                dtype: torch.dtype, load_format: str, seed: int) -> Any:
    # A float16 VAE that asks for it decodes in float32 (float16 overflows in its upsampling blocks).
    if name == "vae" and dtype == torch.float16 and cls.load_config(path).get("force_upcast", False):
        dtype = torch.float32
    if load_format == "dummy":
        module = _build_dummy(cls, library, path, device, dtype, seed)
    else:
        kwargs: dict[str, Any] = {"local_files_only": True, "use_safetensors": True}
        if library == "diffusers":
            kwargs["torch_dtype"] = dtype
            # Meta-device construction needs accelerate; without it load the plain way, quietly.
            kwargs["low_cpu_mem_usage"] = importlib.util.find_spec("accelerate") is not None
        else:
            kwargs["dtype"] = dtype
        try:
            module = cls.from_pretrained(path, **kwargs)
        except OSError as e:
            raise ValueError(
                f"component {name!r}: cannot load safetensors weights from {path}: {e}") from None
        module = module.to(device)
    module.eval().requires_grad_(False)
    return module
