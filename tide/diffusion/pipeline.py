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
from tide.diffusion.components import load_components, meta_models, model_component_names
from tide.diffusion.config import DiffusionConfig, pipeline_kind, read_model_index
from tide.diffusion.io_struct import DiffusionBatch, ImageRequest
from tide.diffusion.profiler import CudaMemoryObserver, MemoryObserver, PlacedWeightsObserver
from tide.diffusion.residency import (
    AUTO,
    AUTO_BUDGET_FRACTION,
    MEMORY_INTENSIVE_MIN_BYTES,
    OFFLOAD,
    RESIDENT,
    ComponentManager,
    ComponentPolicy,
    module_size,
    plan_strategies,
)
from tide.diffusion.stages import InputValidationStage, Stage, StageExecutor
from tide.memory import MemoryLedger

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PipelineKind:
    """What differs between pipeline kinds: allowed component classes, stages, defaults."""

    name: str
    components: dict[str, tuple[str, ...]]
    denoiser: str
    default_guidance_scale: float
    stage_types: tuple[type[Stage], ...]

    @property
    def stage_components(self) -> list[tuple[str, ...]]:
        """The components each stage runs, in stage order."""
        return [cls.components for cls in self.stage_types]


KINDS = {
    "flux": PipelineKind("flux", flux.COMPONENTS, "transformer", flux.DEFAULT_GUIDANCE_SCALE,
                         flux.STAGE_TYPES),
    "sdxl": PipelineKind("sdxl", sdxl.COMPONENTS, "unet", sdxl.DEFAULT_GUIDANCE_SCALE,
                         sdxl.STAGE_TYPES),
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
    """Loaded components + stages of one diffusers-format model directory, and the residency
    manager that places its model components (`residency`). `ledger`: the engine's memory ledger,
    where the manager records its release points."""

    def __init__(self, config: DiffusionConfig, ledger: MemoryLedger | None = None) -> None:
        self.config = config
        index = read_model_index(config.model_path)
        self.kind = KINDS[pipeline_kind(index)]
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.strategies, budget = self._plan_residency(config, index)
        self.residency = ComponentManager(self.device, {}, config.layerwise_blocks, budget,
                                          self.ledger)
        non_resident = frozenset(n for n, s in self.strategies.items() if s != RESIDENT)
        self.components, self.component_infos = load_components(
            config.model_path, index, self.kind.components, self.device, self.dtype,
            config.load_format, config.seed, host_components=non_resident,
            on_loaded=self._adopt)
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
        if self.default_size > config.max_image_side:
            # every request that gives no size would fail, naming a size the caller never sent
            raise ValueError(f"default_size {self.default_size} is above max_image_side "
                             f"{config.max_image_side}; lower default_size or raise max_image_side")
        if [s.components for s in stages] != self.kind.stage_components:
            raise RuntimeError("the built stages do not match the pipeline kind's stage_types")
        self.residency.bind(stages)
        observer: MemoryObserver = (CudaMemoryObserver(self.device) if self.device.type == "cuda"
                                    else PlacedWeightsObserver(self.residency))
        self.executor = StageExecutor(stages, self.device, hooks=[self.residency], observer=observer)
        logger.info("loaded %s pipeline from %s on %s (%s): %s", self.kind.name, config.model_path,
                    self.device, self.dtype,
                    ", ".join(f"{c.name}={c.class_name}" for c in self.component_infos))
        logger.info("component residency: %s (budget %s)",
                    ", ".join(f"{n}={p.strategy}{'*' if p.memory_intensive else ''}"
                              f"{' preferred' if p.preferred else ''}"
                              for n, p in self.residency.policies.items()),
                    "none" if budget is None else f"{budget / 1e9:.2f} GB")

    # ---- residency
    def _plan_residency(self, config: DiffusionConfig, index: dict[str, Any]
                        ) -> tuple[dict[str, str], int | None]:
        """Each model component's strategy (auto resolved) and the weights budget in bytes.
        ValueError naming a component the model does not have."""
        models = model_component_names(self.kind.components)
        spec = dict(config.component_residency)
        for field_name, names in (("component_residency", [n for n in spec if n != "*"]),
                                  ("preferred_resident", config.preferred_resident),
                                  ("memory_intensive", config.memory_intensive or ())):
            for name in names:
                if name not in models:
                    raise ValueError(f"{field_name}: {self.kind.name} pipelines have no model "
                                     f"component {name!r}; model components: {models}")
        requested = {n: spec.get(n, spec.get("*", RESIDENT)) for n in models}
        budget = (None if config.residency_budget_gb is None
                  else int(config.residency_budget_gb * 1e9))
        if AUTO not in requested.values():
            return requested, budget
        if budget is None and self.device.type == "cuda":
            budget = int(torch.cuda.get_device_properties(self.device).total_memory
                         * AUTO_BUDGET_FRACTION)
        sizes = {n: module_size(m) for n, m in
                 meta_models(config.model_path, index, self.kind.components, self.dtype).items()}
        mi = {n for n in models if self._memory_intensive(n, sizes[n].total)}
        return plan_strategies(requested, sizes, self.kind.stage_components, self.kind.denoiser, mi,
                               budget, config.layerwise_blocks), budget

    def _memory_intensive(self, name: str, nbytes: int) -> bool:
        if self.config.memory_intensive is not None:
            return name in self.config.memory_intensive
        return name == self.kind.denoiser or (name.startswith("text_encoder")
                                              and nbytes >= MEMORY_INTENSIVE_MIN_BYTES)

    def _adopt(self, name: str, module: Any) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in module.parameters())
        strategy = self.strategies[name]
        preferred = name in self.config.preferred_resident and strategy == OFFLOAD
        self.residency.policies[name] = ComponentPolicy(
            name, strategy, self._memory_intensive(name, nbytes), preferred)
        self.residency.adopt(name, module)

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
