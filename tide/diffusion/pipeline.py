"""`ImagePipeline`: one pipeline kind's components, its stages and the executor that runs them.

The kind comes from `model_index.json` (`FluxPipeline` -> flux, `StableDiffusionXLPipeline` -> sdxl).
A pipeline runs one batch at a time; callers serialise (the engine holds a lock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tide.diffusion import flux, sdxl
from tide.diffusion.components import load_components
from tide.diffusion.config import DiffusionConfig, pipeline_kind, read_model_index
from tide.diffusion.io_struct import DiffusionBatch, ImageRequest
from tide.diffusion.stages import InputValidationStage, Stage, StageExecutor

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PipelineKind:
    """What differs between pipeline kinds: allowed component classes, stages, defaults."""

    name: str
    components: dict[str, tuple[str, ...]]
    denoiser: str
    default_guidance_scale: float


KINDS = {
    "flux": PipelineKind("flux", flux.COMPONENTS, "transformer", flux.DEFAULT_GUIDANCE_SCALE),
    "sdxl": PipelineKind("sdxl", sdxl.COMPONENTS, "unet", sdxl.DEFAULT_GUIDANCE_SCALE),
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: unknown device {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


class ImagePipeline:
    """Loaded components + stages of one diffusers-format model directory."""

    def __init__(self, config: DiffusionConfig) -> None:
        self.config = config
        index = read_model_index(config.model_path)
        self.kind = KINDS[pipeline_kind(index)]
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.components, self.component_infos = load_components(
            config.model_path, index, self.kind.components, self.device, self.dtype,
            config.load_format, config.seed)
        if self.kind.name == "flux":
            stages = flux.build_stages(self.components, config, self.device)
            self.default_size = flux.default_size(self.components)
        else:
            stages = sdxl.build_stages(self.components, config, self.device,
                                       bool(index.get("force_zeros_for_empty_prompt", True)))
            self.default_size = sdxl.default_size(self.components)
        self.stages: list[Stage] = stages
        validation = stages[0]
        assert isinstance(validation, InputValidationStage)  # every pipeline validates first
        self.validation = validation
        if config.default_size is not None:
            if config.default_size % self.size_multiple:
                raise ValueError(f"default_size must be a multiple of {self.size_multiple}, got "
                                 f"{config.default_size}")
            self.default_size = config.default_size
        self.executor = StageExecutor(stages, self.device)
        logger.info("loaded %s pipeline from %s on %s (%s): %s", self.kind.name, config.model_path,
                    self.device, self.dtype,
                    ", ".join(f"{c.name}={c.class_name}" for c in self.component_infos))

    @property
    def denoiser(self) -> Any:
        return self.components[self.kind.denoiser]

    @property
    def size_multiple(self) -> int:
        return self.validation.size_multiple

    def check(self, req: ImageRequest) -> None:
        """ValueError naming the field if `req` cannot run on this pipeline."""
        self.validation.check(req)

    def run(self, requests: list[ImageRequest]) -> DiffusionBatch:
        """Run every stage over one batch of compatible requests; the batch holds the images."""
        return self.executor.run(DiffusionBatch(requests=list(requests)))
