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
from collections.abc import Callable, Iterator
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
    if device.type != "meta":
        torch.manual_seed(seed)  # seeds every device's generator the modules' initialisers draw from
    with _default_dtype(dtype), device:
        if library == "diffusers":
            module = cls.from_config(cls.load_config(path))
        else:
            module = cls._from_config(cls.config_class.from_pretrained(path), dtype=dtype)
    # Float buffers made in float32 follow, as when loading weights (nn.Module.to: diffusers' own
    # override only adds a warning about modules to keep in float32, which tide does not do).
    return torch.nn.Module.to(module, dtype)


def model_component_names(allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """The names in `allowed` whose classes are models (not tokenizers or schedulers)."""
    return [name for name, classes in allowed.items() if _role(classes[0]) == MODEL]


def _checked_entry(model_path: str, index: dict[str, Any], name: str,
                   classes: tuple[str, ...]) -> tuple[str, str, str]:
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
    return library, class_name, path


def load_components(model_path: str, index: dict[str, Any], allowed: dict[str, tuple[str, ...]],
                    device: torch.device, dtype: torch.dtype, load_format: str, seed: int,
                    host_components: frozenset[str] = frozenset(),
                    on_loaded: Callable[[str, Any], None] | None = None,
                    ) -> tuple[dict[str, Any], list[ComponentInfo]]:
    """Load every component in `allowed` (name -> accepted class names) as `model_index.json`
    declares it. ValueError naming the component when one is missing or of a class not allowed.

    Models named in `host_components` stay in host memory when read from safetensors (dummy weights
    are still drawn on `device`, so they are the same whatever the placement); `on_loaded(name,
    module)` is called right after each model is loaded, before the next one (the residency manager
    takes it there, so the device never holds more than the resident models and the current one)."""
    modules: dict[str, Any] = {}
    infos: list[ComponentInfo] = []
    for i, (name, classes) in enumerate(allowed.items()):
        library, class_name, path = _checked_entry(model_path, index, name, classes)
        cls = _resolve_class(library, class_name)
        role = _role(class_name)
        if role == TOKENIZER:
            module = cls.from_pretrained(path, local_files_only=True)
        elif role == SCHEDULER:
            module = cls.from_config(cls.load_config(path))
        else:
            target = torch.device("cpu") if name in host_components else device
            module = _load_model(cls, library, path, name, device, target, dtype, load_format, seed + i)
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters()) if role == MODEL else 0
        if role == MODEL and on_loaded is not None:
            on_loaded(name, module)
        modules[name] = module
        infos.append(ComponentInfo(name, class_name, role, nbytes))
    return modules, infos


def meta_models(model_path: str, index: dict[str, Any], allowed: dict[str, tuple[str, ...]],
                dtype: torch.dtype) -> dict[str, Any]:
    """Every model component built on the meta device from its config (shapes and dtypes, no
    memory, nothing read but the configs): what residency planning measures."""
    out: dict[str, Any] = {}
    for name in model_component_names(allowed):
        library, class_name, path = _checked_entry(model_path, index, name, allowed[name])
        cls = _resolve_class(library, class_name)
        out[name] = _build_dummy(cls, library, path, torch.device("meta"),
                                 _model_dtype(cls, path, name, dtype), seed=0)
    return out


def _model_dtype(cls: Any, path: str, name: str, dtype: torch.dtype) -> torch.dtype:
    # A float16 VAE that asks for it decodes in float32 (float16 overflows in its upsampling blocks).
    if name == "vae" and dtype == torch.float16 and cls.load_config(path).get("force_upcast", False):
        return torch.float32
    return dtype


def _load_model(cls: Any, library: str, path: str, name: str, device: torch.device,
                target: torch.device, dtype: torch.dtype, load_format: str, seed: int) -> Any:
    dtype = _model_dtype(cls, path, name, dtype)
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
        module = module.to(target)
        if target.type == "cpu":
            _align_host_tensors(module)
    module.eval().requires_grad_(False)
    return module


def _align_host_tensors(module: Any) -> None:
    """Copy host tensors that safetensors left at an address not 64-byte aligned (views into the
    file) into fresh memory: CPU matmul kernels pick their path by alignment, so otherwise a
    component's results would change when residency moves its weights into aligned buffers."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "cpu" and t.data_ptr() % 64:
                t.data = t.data.clone()
