"""Diffusion engine configuration and model-directory detection (no diffusers import here).

`DiffusionConfig.from_kwargs` rejects unknown keys with a `ValueError` naming them, like `EngineConfig`.
The pipeline kind of a model directory comes from `model_index.json`'s `_class_name`, never from the
directory name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEMO_DIFFUSION_NAME = "demo-diffusion"
DEMO_DIFFUSION_PATH = str(Path(__file__).parent / "demo_model")
DEMO_DEFAULT_SIZE = 64  # the demo's default image side (its model default, 256, is slow on a CPU)

# model_index.json `_class_name` -> pipeline kind.
PIPELINE_KINDS = {"FluxPipeline": "flux", "StableDiffusionXLPipeline": "sdxl"}

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
