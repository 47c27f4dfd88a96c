"""Diffusion engine configuration and model-directory detection (no diffusers import here).

`DiffusionConfig.from_kwargs` rejects unknown keys with a `ValueError` naming them, like `EngineConfig`.
The pipeline kind of a model directory comes from `model_index.json`'s `_class_name`, never from the
directory name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tide.io_struct import check_weight_version

DEMO_DIFFUSION_NAME = "demo-diffusion"
DEMO_DIFFUSION_PATH = str(Path(__file__).parent / "demo_model")
DEMO_DEFAULT_SIZE = 64  # the demo's default image side (its model default, 256, is slow on a CPU)

# model_index.json `_class_name` -> pipeline kind.
PIPELINE_KINDS = {"FluxPipeline": "flux", "StableDiffusionXLPipeline": "sdxl"}

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Component residency strategies (`tide.diffusion.residency`); "auto" picks one per component.
RESIDENCY_STRATEGIES = ("resident", "offload", "layerwise")
AUTO_RESIDENCY = "auto"


def resolve_model_path(model_path: str | None) -> str:
    """`None` or `"demo-diffusion"` -> the built-in tiny model's directory; others unchanged."""
    if model_path is None or model_path == DEMO_DIFFUSION_NAME:
        return DEMO_DIFFUSION_PATH
    return model_path


def is_diffusion_model(model_path: str | None) -> bool:
    """True for `demo-diffusion` and for any directory holding a `model_index.json`."""
    if model_path == DEMO_DIFFUSION_NAME:
        return True
    return model_path is not None and os.path.isfile(os.path.join(model_path, "model_index.json"))


def read_model_index(model_path: str) -> dict[str, Any]:
    """`model_index.json` of a diffusers-format directory, or ValueError saying what is wrong."""
    path = os.path.join(model_path, "model_index.json")
    try:
        with open(path) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model_path {model_path!r} has no model_index.json: not a diffusers-format "
                         "pipeline directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(index, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return index


def pipeline_kind(index: dict[str, Any]) -> str:
    """"flux" or "sdxl" from `model_index.json`'s `_class_name`; ValueError for any other."""
    name = index.get("_class_name")
    if name not in PIPELINE_KINDS:
        raise ValueError(f"unsupported diffusion pipeline {name!r} in model_index.json (_class_name); "
                         f"supported: {sorted(PIPELINE_KINDS)}")
    return PIPELINE_KINDS[name]


@dataclass(frozen=True)
class DiffusionConfig:
    """Options of a `DiffusionEngine`.

    - `load_format`: "auto"/"safetensors" load the component weights; "dummy" builds every component
      from its config with random weights (seeded by `seed`) and reads no weight file.
    - `dtype`: "auto" is float32 on CPU and bfloat16 on CUDA. A float16 VAE whose config sets
      `force_upcast` is kept in float32.
    - `max_sequence_length`: T5 tokens per prompt (FLUX), at most 512.
    - `max_batch_images`: images one batch may hold (server batching and one request's n x prompts).
    - `max_image_side`, `max_inference_steps`, `max_prompt_chars`: bounds on one request's cost.
    - `default_size`: image side of a request that gives none; None takes the model's (FLUX: 128
      latent tokens a side, 1024 px for FLUX.1; SDXL: the UNet's sample size, 1024 px), and 64 for
      the demo model.
    - `component_residency`: where each model component lives (`tide.diffusion.residency`):
      `((name, strategy), ...)`, strategy one of resident / offload / layerwise / auto; components not
      named are resident. `from_kwargs` also takes "text_encoder_2=offload,transformer=layerwise",
      "auto" (every component auto) or a dict. Names are checked against the model's components
      when the pipeline loads.
    - `residency_budget_gb`: the most component weights (GB, 1e9 bytes) the device holds at once,
      prefetches included: `auto` picks strategies to fit it, prefetches wait for room under it,
      preferred components leave when a placement needs their room, and a layerwise component keeps
      as many of its first blocks as fit for the rest of its stage. None: no limit (auto on CUDA
      then takes 80% of the device's memory; on CPU everything stays resident).
    - `layerwise_blocks`: blocks of a layerwise component on the device at once (>= 1; 2 overlaps
      one block's copy with the previous block's compute).
    - `preferred_resident`: offloaded components that stay on the device after their stage and
      after a request, until the budget needs their room.
    - `memory_intensive`: components whose release empties the allocator cache; None: the denoiser
      and every text encoder of at least 1 GiB.
    - `weight_version`: the version outputs report until a weight update sets another.
    """

    model_path: str = DEMO_DIFFUSION_PATH
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_sequence_length: int = 512
    max_batch_images: int = 16
    max_image_side: int = 2048
    max_inference_steps: int = 200
    max_prompt_chars: int = 16384
    default_size: int | None = None
    log_level: str = "warning"
    component_residency: tuple[tuple[str, str], ...] = ()
    residency_budget_gb: float | None = None
    layerwise_blocks: int = 2
    preferred_resident: tuple[str, ...] = ()
    memory_intensive: tuple[str, ...] | None = None
    weight_version: str = "default"

    def __post_init__(self) -> None:
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.model_path, str) or not os.path.isdir(self.model_path):
            raise ValueError(f"model_path must be a diffusers-format directory, got {self.model_path!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a device name, got {self.device!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("max_batch_images", "max_image_side", "max_inference_steps", "max_prompt_chars"):
            _positive(name, getattr(self, name))
        if self.default_size is not None:
            _positive("default_size", self.default_size)
        _positive("max_sequence_length", self.max_sequence_length)
        if self.max_sequence_length > 512:
            raise ValueError(f"max_sequence_length must be at most 512, got {self.max_sequence_length}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "component_residency",
                           parse_component_residency(self.component_residency))
        budget = self.residency_budget_gb
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool)
                                   or not math.isfinite(budget) or budget <= 0):
            raise ValueError(f"residency_budget_gb must be a positive number of GB, got {budget!r}")
        _positive("layerwise_blocks", self.layerwise_blocks)
        object.__setattr__(self, "preferred_resident",
                           _names("preferred_resident", self.preferred_resident))
        if self.memory_intensive is not None:
            object.__setattr__(self, "memory_intensive",
                               _names("memory_intensive", self.memory_intensive))
        check_weight_version(self.weight_version)
        strategies = dict(self.component_residency)
        for name in self.preferred_resident:
            if strategies.get(name) == "layerwise":
                raise ValueError(f"preferred_resident: component {name!r} is layerwise; only offloaded "
                                 "(or auto) components can stay on the device after their stage")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> DiffusionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown diffusion engine option(s) {unknown}; allowed options are "
                             f"{sorted(known)}")
        kwargs["model_path"] = resolve_model_path(kwargs.get("model_path"))
        if kwargs["model_path"] == DEMO_DIFFUSION_PATH and kwargs.get("default_size") is None:
            kwargs["default_size"] = DEMO_DEFAULT_SIZE
        return cls(**kwargs)

    def replace(self, **changes: Any) -> DiffusionConfig:
        return dataclasses.replace(self, **changes)


def parse_component_residency(spec: Any) -> tuple[tuple[str, str], ...]:
    """Normalise a residency spec to sorted `(component, strategy)` pairs.

    Accepts "name=strategy,name=strategy", "auto" (every model component auto; may be combined with
    explicit entries, which win), a dict, or pairs. ValueError naming the entry, component or
    strategy that is wrong; components are checked against the model when the pipeline loads."""
    if spec is None or spec == "" or spec == ():
        return ()
    pairs: list[tuple[str, str]] = []
    if isinstance(spec, str):
        for raw in spec.split(","):
            entry = raw.strip()
            if not entry:
                raise ValueError(f"component_residency: empty entry in {spec!r}")
            if entry == AUTO_RESIDENCY:
                pairs.append(("*", AUTO_RESIDENCY))
                continue
            name, sep, strategy = entry.partition("=")
            if not sep:
                raise ValueError(f"component_residency: entry {entry!r} must be COMPONENT=STRATEGY "
                                 f"(strategies: {[*RESIDENCY_STRATEGIES, AUTO_RESIDENCY]}) or 'auto'")
            pairs.append((name.strip(), strategy.strip()))
    elif isinstance(spec, dict):
        pairs = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise ValueError(f"component_residency: {item!r} is not a (component, strategy) pair")
            pairs.append((item[0], item[1]))
    else:
        raise ValueError(f"component_residency must be a string, a dict or (component, strategy) "
                         f"pairs, got {type(spec).__name__}")
    out: dict[str, str] = {}
    for name, strategy in pairs:
        if not isinstance(name, str) or not re.fullmatch(r"\*|[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"component_residency: {name!r} is not a component name")
        if strategy not in (*RESIDENCY_STRATEGIES, AUTO_RESIDENCY):
            raise ValueError(f"component_residency: component {name!r} has unknown strategy "
                             f"{strategy!r}; choose from {[*RESIDENCY_STRATEGIES, AUTO_RESIDENCY]}")
        if name in out:
            raise ValueError(f"component_residency: component {name!r} is given twice")
        out[name] = strategy
    return tuple(sorted(out.items()))


def _names(field_name: str, value: Any) -> tuple[str, ...]:
    """A tuple of component names from a tuple/list or a comma-separated string."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) for v in value):
        raise ValueError(f"{field_name} must be a list of component names, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{field_name}: a component is named twice in {list(value)}")
    return tuple(value)


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
