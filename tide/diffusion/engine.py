"""`tide.DiffusionEngine`: text-to-image generation in-process.

    engine = tide.DiffusionEngine("path/to/FLUX.1-dev")          # or "demo-diffusion"
    out = engine.generate("a red fox in snow", seed=0, output_type="np")
    out["images"][0]                                             # (1024, 1024, 3) float32 in [0, 1]
    out["meta_info"]                                             # seed, stage_timings_ms, ...

Seeds follow diffusers: the initial latents are drawn by a `torch.Generator` on the engine's device
seeded with `seed`, so an image equals diffusers' output for `generator=torch.Generator(device)
.manual_seed(seed)`. One seed draws all of a request's images in one call (diffusers with one
generator); a list of seeds, one per image, draws each image with its own generator (diffusers with a
list of generators). `seed=None` picks a random seed and reports it in `meta_info`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from typing import Any

import numpy as np

from tide.diffusion.config import DiffusionConfig
from tide.diffusion.io_struct import ImageRequest, ImageResult
from tide.diffusion.pipeline import ImagePipeline
from tide.diffusion.stages import MAX_SEED
from tide.memory.ledger import MemoryLedger

logger = logging.getLogger(__name__)

DEFAULT_NUM_INFERENCE_STEPS = 28


class DiffusionEngine:
    """Load a diffusers-format text-to-image model and generate images.

    `DiffusionEngine(model_path=None, **options)`: options are `DiffusionConfig` fields (`device`,
    `dtype`, `load_format`, ...); unknown ones raise `ValueError`. With no `model_path`, or
    `"demo-diffusion"`, the built-in tiny model is used. Thread-safe: batches run one at a time.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = DiffusionConfig.from_kwargs(model_path=model_path, **kwargs)
        logging.getLogger("tide").setLevel(self.config.log_level.upper())
        self.memory_ledger = MemoryLedger()  # this engine's release points and lifecycle marks
        self.pipeline = ImagePipeline(self.config)
        self._lock = threading.Lock()
        self.memory_ledger.mark("engine_ready", f"{self.kind} diffusion pipeline on {self.device}")

    # ---- facts about the loaded model
    @property
    def kind(self) -> str:
        """"flux" or "sdxl"."""
        return self.pipeline.kind.name

    @property
    def device(self) -> Any:
        return self.pipeline.device

    @property
    def dtype(self) -> Any:
        return self.pipeline.dtype

    @property
    def default_size(self) -> int:
        """Image side used when height/width are not given (1024 for FLUX.1 and SDXL)."""
        return self.pipeline.default_size

    @property
    def default_guidance_scale(self) -> float:
        return self.pipeline.kind.default_guidance_scale

    # ---- requests
    def make_request(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
        guidance_scale: float | None = None,
        true_cfg_scale: float = 1.0,
        seed: int | list[int] | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
        rid: str | None = None,
    ) -> ImageRequest:
        """A validated request (ValueError naming the field otherwise); see `generate`."""
        prompts = _strings("prompt", prompt)
        negatives = None
        if negative_prompt is not None:
            negatives = _strings("negative_prompt", negative_prompt)
            if isinstance(negative_prompt, str):
                negatives = negatives * len(prompts)
        if seed is None:
            seeds: tuple[int, ...] = (secrets.randbelow(MAX_SEED + 1),)
        elif isinstance(seed, (list, tuple)):
            seeds = tuple(seed)
            if not seeds:
                raise ValueError("seed must be an integer or a non-empty list of integers")
        else:
            seeds = (seed,)
        for name, value in (("height", height), ("width", width)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        req = ImageRequest(
            rid=rid or uuid.uuid4().hex,
            prompts=prompts,
            negative_prompts=negatives,
            num_images_per_prompt=num_images_per_prompt,
            height=self.default_size if height is None else height,
            width=self.default_size if width is None else width,
            num_inference_steps=num_inference_steps,
            guidance_scale=self.default_guidance_scale if guidance_scale is None else guidance_scale,
            true_cfg_scale=true_cfg_scale,
            seeds=seeds,
            output_type=output_type,
        )
        self.pipeline.check(req)
        return req

    def generate(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
        guidance_scale: float | None = None,
        true_cfg_scale: float = 1.0,
        seed: int | list[int] | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
    ) -> dict[str, Any]:
        """Generate `num_images_per_prompt` images per prompt.

        Returns `{"images": [...], "meta_info": {...}}`: PIL images, or float32 (H, W, 3) arrays in
        [0, 1] for `output_type="np"`, prompt-major. `meta_info` holds `seed` (as drawn, so a `None`
        seed can be replayed), `stage_timings_ms`, `e2e_latency` (s) and the resolved parameters.
        `guidance_scale=None` takes the model's default (FLUX 3.5, SDXL 5.0); `negative_prompt` is one
        string for all prompts or one per prompt (FLUX: needs `true_cfg_scale > 1`; SDXL: needs
        `guidance_scale > 1`). height/width default to `default_size`.
        """
        req = self.make_request(prompt, negative_prompt, height, width, num_inference_steps,
                                guidance_scale, true_cfg_scale, seed, num_images_per_prompt,
                                output_type)
        return self.run_batch([req])[0].to_dict()

    def run_batch(self, requests: list[ImageRequest]) -> list[ImageResult]:
        """Run requests that share a `batch_key` as one batch; one result per request, in order."""
        with self._lock:
            start = time.perf_counter()
            batch = self.pipeline.run(requests)
            run_s = time.perf_counter() - start
        assert batch.images is not None  # the decoding stage fills them
        results, offset = [], 0
        for req in requests:
            arrays = batch.images[offset:offset + req.num_images]
            offset += req.num_images
            images: list[Any] = list(arrays) if req.output_type == "np" else to_pil(arrays)
            meta = {
                "rid": req.rid,
                "seed": req.seed,
                "stage_timings_ms": dict(batch.stage_timings_ms),
                "e2e_latency": time.perf_counter() - req.created,
                "run_latency": run_s,
                "batch_num_images": batch.num_images,
                "num_images": req.num_images,
                "height": req.height,
                "width": req.width,
                "num_inference_steps": req.num_inference_steps,
                "guidance_scale": req.guidance_scale,
                "true_cfg_scale": req.true_cfg_scale,
            }
            results.append(ImageResult(req.rid, images, meta))
        return results

    def shutdown(self) -> None:
        """Drop the components (their memory returns to the allocator's cache)."""
        self.pipeline = None  # type: ignore[assignment]

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] -> uint8, rounding to nearest (as diffusers' PIL output does)."""
    return (images * 255).round().astype(np.uint8)


def to_pil(images: np.ndarray) -> list[Any]:
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images)]


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError(f"{name} must not be an empty list")
    raise ValueError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
