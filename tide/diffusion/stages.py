"""Stages, the executor that runs them, and the stages shared by every pipeline kind.

A stage is a small object with a `name`, the `components` it runs (names from `model_index.json`), and
one `__call__(batch)` that reads the fields earlier stages wrote into the `DiffusionBatch` and writes
its own. The `StageExecutor` runs the stages in order for one batch and profiles each one (time and
memory, `tide.diffusion.profiler`); `StageHook`s see every stage boundary (the residency manager,
`tide.diffusion.residency`, places components there). Stages never empty the allocator cache.

Order: input validation -> text encoding -> timestep preparation -> latent preparation -> denoising
-> decoding. Timesteps come before latents because SDXL scales the initial noise by the schedule's
`init_noise_sigma`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from tide.diffusion.config import DiffusionConfig
from tide.diffusion.io_struct import OUTPUT_TYPES, DiffusionBatch, ImageRequest
from tide.diffusion.profiler import MemoryObserver, StageProfiler

MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0


class Stage:
    """One step of a pipeline over a batch. Subclasses set `name` and `components`."""

    name: ClassVar[str] = "stage"
    components: ClassVar[tuple[str, ...]] = ()

    def __call__(self, batch: DiffusionBatch) -> None:
        raise NotImplementedError


class StageHook:
    """Called around every stage of a batch: `before_stage` in registration order, `after_stage` in
    reverse order, then `after_batch` once the batch is done or has failed (`failed`). A hook's
    work counts in the stage's time (the profiler's span encloses the hooks)."""

    def before_stage(self, stage: Stage, batch: DiffusionBatch) -> None:
        """Before `stage` runs (e.g. put its components on the device)."""

    def after_stage(self, stage: Stage, batch: DiffusionBatch) -> None:
        """After `stage` returned."""

    def after_batch(self, batch: DiffusionBatch, failed: bool) -> None:
        """After the last stage, or after any stage or hook raised (`failed`)."""


class StageExecutor:
    """Runs a pipeline's stages, in order, over one batch at a time, profiling each stage
    (`tide.diffusion.profiler`: time and memory into `batch.profile` and `batch.stage_timings_ms`).
    `current_stage` names the stage running now; after a failure, the one that raised."""

    def __init__(self, stages: Sequence[Stage], device: torch.device,
                 hooks: Sequence[StageHook] = (), observer: MemoryObserver | None = None) -> None:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        self.stages = tuple(stages)
        self.device = device
        self.hooks: list[StageHook] = list(hooks)
        self.observer = observer
        self.current_stage: str | None = None

    def add_hook(self, hook: StageHook) -> None:
        self.hooks.append(hook)

    def run(self, batch: DiffusionBatch) -> DiffusionBatch:
        profiler = StageProfiler(self.device, self.observer)
        self.current_stage = None
        failed = True
        try:
            with torch.inference_mode():
                for stage in self.stages:
                    self.current_stage = stage.name
                    profiler.begin(stage.name)
                    for hook in self.hooks:
                        hook.before_stage(stage, batch)
                    stage(batch)
                    for hook in reversed(self.hooks):
                        hook.after_stage(stage, batch)
                    profiler.end(stage.name)
            failed = False
            self.current_stage = None
        finally:
            for hook in self.hooks:
                hook.after_batch(batch, failed)
        batch.profile = profiler.finish()
        batch.stage_timings_ms = batch.profile.timings_ms
        return batch


def _check_text(text: str, field: str) -> None:
    """ValueError naming `field` for text the tokenizers cannot take (a lone surrogate, which JSON
    can carry): caught here, it fails its own request, not the batch it would have joined."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid Unicode text (it holds a lone surrogate)") from None


class InputValidationStage(Stage):
    """Checks each request against the pipeline's limits (`check`, also called before a request is
    queued) and that the batch's requests can share one run, then lays out the batch's prompts."""

    name = "input_validation"

    def __init__(self, config: DiffusionConfig, size_multiple: int) -> None:
        self.config = config
        # Every side a multiple of 16 and of what the VAE (and FLUX's 2x2 packing) needs.
        self.size_multiple = math.lcm(16, size_multiple)

    def check(self, req: ImageRequest) -> None:
        """ValueError naming the field if `req` is out of this pipeline's bounds."""
        cfg = self.config
        if not req.prompts:
            raise ValueError("prompt must not be empty")
        for i, p in enumerate(req.prompts):
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"prompt{_index(req.prompts, i)} must be a non-empty string")
            if len(p) > cfg.max_prompt_chars:
                raise ValueError(f"prompt{_index(req.prompts, i)} is longer than {cfg.max_prompt_chars} "
                                 "characters")
            _check_text(p, f"prompt{_index(req.prompts, i)}")
        if req.negative_prompts is not None:
            if len(req.negative_prompts) != len(req.prompts):
                raise ValueError(f"negative_prompt must be one string or one per prompt "
                                 f"({len(req.prompts)}), got {len(req.negative_prompts)}")
            for i, p in enumerate(req.negative_prompts):
                if not isinstance(p, str):
                    raise ValueError(f"negative_prompt{_index(req.negative_prompts, i)} must be a string")
                if len(p) > cfg.max_prompt_chars:
                    raise ValueError(f"negative_prompt is longer than {cfg.max_prompt_chars} characters")
                _check_text(p, f"negative_prompt{_index(req.negative_prompts, i)}")
        m = self.size_multiple
        for name, value in (("height", req.height), ("width", req.width)):
            if not _is_int(value) or not m <= value <= cfg.max_image_side or value % m:
                raise ValueError(f"{name} must be a multiple of {m} in [{m}, {cfg.max_image_side}], "
                                 f"got {value!r}")
        steps = req.num_inference_steps
        if not _is_int(steps) or not 1 <= steps <= cfg.max_inference_steps:
            raise ValueError(f"num_inference_steps must be an integer in [1, {cfg.max_inference_steps}], "
                             f"got {req.num_inference_steps!r}")
        if not _is_int(req.num_images_per_prompt) or req.num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be a positive integer, got "
                             f"{req.num_images_per_prompt!r}")
        if req.num_images > cfg.max_batch_images:
            raise ValueError(f"num_images_per_prompt: {req.num_images} images asked for "
                             f"({len(req.prompts)} prompts x {req.num_images_per_prompt}); at most "
                             f"{cfg.max_batch_images} per request (max_batch_images)")
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(req, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                    math.isfinite(value) and 0.0 <= value <= MAX_GUIDANCE):
                raise ValueError(f"{name} must be a number in [0, {MAX_GUIDANCE:g}], got {value!r}")
        if len(req.seeds) not in (1, req.num_images):
            raise ValueError(f"seed must be one integer or one per image ({req.num_images}), got "
                             f"{len(req.seeds)}")
        for s in req.seeds:
            if not _is_int(s) or not 0 <= s <= MAX_SEED:
                raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {s!r}")
        if req.output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {req.output_type!r}")
        self.check_guidance(req)

    def check_guidance(self, req: ImageRequest) -> None:
        """Pipeline-specific rules on guidance and negative prompts."""

    def uses_cfg(self, req: ImageRequest) -> bool:
        """Whether `req` needs a second (unconditional or negative) prediction per step."""
        raise NotImplementedError

    def __call__(self, batch: DiffusionBatch) -> None:
        if not batch.requests:
            raise ValueError("a batch needs at least one request")
        first = batch.requests[0]
        for req in batch.requests:
            self.check(req)
            if req.batch_key != first.batch_key:
                raise ValueError("requests of one batch must share size, step count and guidance")
        batch.height, batch.width = first.height, first.width
        batch.num_inference_steps = first.num_inference_steps
        batch.guidance_scale = float(first.guidance_scale)
        batch.true_cfg_scale = float(first.true_cfg_scale)
        cfg_flags = {self.uses_cfg(r) for r in batch.requests}
        if len(cfg_flags) != 1:
            raise ValueError("requests of one batch must agree on classifier-free guidance")
        batch.do_cfg = cfg_flags.pop()
        batch.prompts, batch.negative_prompts, batch.repeats = [], [], []
        for req in batch.requests:
            batch.prompts.extend(req.prompts)
            negs = req.negative_prompts or (None,) * len(req.prompts)
            batch.negative_prompts.extend(negs)
            batch.repeats.extend([req.num_images_per_prompt] * len(req.prompts))


def repeat_per_image(x: torch.Tensor, repeats: list[int]) -> torch.Tensor:
    """Row i of `x` (one per prompt) repeated `repeats[i]` times, consecutively."""
    if all(r == 1 for r in repeats):
        return x
    counts = torch.tensor(repeats, device=x.device)
    return torch.repeat_interleave(x, counts, dim=0, output_size=sum(repeats))  # no device sync


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> torch.Tensor:
    """Token ids padded to and truncated at `max_length` (what the text encoders were trained on)."""
    return tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                     return_tensors="pt").input_ids


def initial_noise(batch: DiffusionBatch, shape: tuple[int, ...], device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """Gaussian noise of `(batch.num_images, *shape)` drawn with diffusers' seeding convention.

    Each request draws its own rows with generators on `device`: one seed -> one generator seeded
    with it draws all the request's images in one call; one seed per image -> each image's row is
    drawn by its own generator. So an image depends only on its request, never on the batch it ran in.
    """
    parts = []
    for req in batch.requests:
        if len(req.seeds) == 1:
            gen = torch.Generator(device=device).manual_seed(req.seeds[0])
            parts.append(torch.randn((req.num_images, *shape), generator=gen, device=device,
                                     dtype=dtype))
        else:
            for s in req.seeds:
                gen = torch.Generator(device=device).manual_seed(s)
                parts.append(torch.randn((1, *shape), generator=gen, device=device, dtype=dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class DecodingStage(Stage):
    """VAE decode of the final latents into float32 images in [0, 1] on the host."""

    name = "decoding"
    components = ("vae",)

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.dtype = next(vae.parameters()).dtype

    def vae_input(self, batch: DiffusionBatch) -> torch.Tensor:
        """The latents in the VAE's latent space (undo the scaling applied at encode time)."""
        raise NotImplementedError

    def __call__(self, batch: DiffusionBatch) -> None:
        latents = self.vae_input(batch).to(self.dtype)
        image = self.vae.decode(latents, return_dict=False)[0]
        image = (image * 0.5 + 0.5).clamp(0, 1)
        # fp32 on the device, then one copy: a bf16 -> fp32 conversion on the host is far slower.
        batch.images = image.permute(0, 2, 3, 1).float().contiguous().cpu().numpy()
        batch.latents = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _index(items: tuple[Any, ...], i: int) -> str:
    return f".{i}" if len(items) > 1 else ""
