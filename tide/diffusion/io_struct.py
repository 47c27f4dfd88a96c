"""The request, the batch the stages work on, and the per-request result.

Image order inside a batch is request-major, then prompt-major, then the `num_images_per_prompt`
copies of each prompt (the order diffusers uses for one call), so a request's images are one
contiguous slice of every per-image tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tide.diffusion.profiler import BatchProfile

OUTPUT_TYPES = ("pil", "np")


class DiffusionOutOfMemoryError(RuntimeError):
    """A batch ran out of device memory; the engine released its cache and keeps serving."""


class MemoryReleasedError(RuntimeError):
    """Generation was asked for while memory is released (`release_memory_occupation`)."""


@dataclass(frozen=True)
class ImageRequest:
    """One validated generation request (built by `DiffusionEngine.make_request`).

    `seeds` has one entry (one generator draws the initial latents of all the request's images in one
    call, as diffusers does with one `torch.Generator`) or one per image (each image's latents drawn by
    its own generator, as diffusers does with a list of generators).
    """

    rid: str
    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...] | None
    num_images_per_prompt: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float
    seeds: tuple[int, ...]
    output_type: str = "pil"
    created: float = field(default_factory=time.perf_counter)

    @property
    def num_images(self) -> int:
        return len(self.prompts) * self.num_images_per_prompt

    @property
    def batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one batch: same latent shape, timestep schedule and
        guidance (whether a negative prompt is given may differ)."""
        return (self.height, self.width, self.num_inference_steps, self.guidance_scale,
                self.true_cfg_scale)

    @property
    def seed(self) -> int | list[int]:
        """The seed as the caller gave it: one int, or one per image."""
        return self.seeds[0] if len(self.seeds) == 1 else list(self.seeds)


@dataclass
class DiffusionBatch:
    """What the stages of one run read and write. Stages fill the fields in stage order; a field is
    None until its stage has run. Tensors hold every image of every request (see module doc)."""

    requests: list[ImageRequest]
    # Filled by input validation.
    height: int = 0
    width: int = 0
    num_inference_steps: int = 0
    guidance_scale: float = 0.0
    true_cfg_scale: float = 1.0
    do_cfg: bool = False  # classifier-free guidance: a second, unconditional/negative prediction
    prompts: list[str] = field(default_factory=list)  # one per prompt, all requests
    negative_prompts: list[str | None] = field(default_factory=list)  # one per prompt
    repeats: list[int] = field(default_factory=list)  # images per prompt
    # Text encoding (per image; negative_* only with do_cfg).
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None  # FLUX
    add_time_ids: torch.Tensor | None = None  # SDXL
    # Timestep preparation.
    scheduler: Any = None  # a fresh copy of the pipeline's scheduler, owned by this batch
    timesteps: torch.Tensor | None = None
    # Latent preparation and denoising.
    latents: torch.Tensor | None = None
    latent_image_ids: torch.Tensor | None = None  # FLUX
    # Decoding: float32 images in [0, 1], (num_images, height, width, 3), on the host.
    images: np.ndarray | None = None
    stage_timings_ms: dict[str, float] = field(default_factory=dict)
    profile: BatchProfile | None = None  # per-stage time and memory (the executor's profiler)

    @property
    def num_images(self) -> int:
        return sum(r.num_images for r in self.requests)


@dataclass
class ImageResult:
    """The images of one request and what produced them."""

    rid: str
    images: list[Any]  # PIL images, or float32 (H, W, 3) arrays in [0, 1] for output_type "np"
    meta_info: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"images": self.images, "meta_info": self.meta_info}
