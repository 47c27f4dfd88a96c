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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tide.diffusion.config import DiffusionConfig
from tide.diffusion.io_struct import (
    DiffusionOutOfMemoryError,
    ImageRequest,
    ImageResult,
    MemoryReleasedError,
)
from tide.diffusion.pipeline import ImagePipeline
from tide.diffusion.residency import ComponentManager
from tide.diffusion.stages import MAX_SEED
from tide.diffusion.weights import DenoiserWeights
from tide.io_struct import WeightUpdateOptions, check_weight_version
from tide.memory.ledger import MemoryLedger
from tide.memory.occupation import parse_tags

logger = logging.getLogger(__name__)

DEFAULT_NUM_INFERENCE_STEPS = 28
MEMORY_TAGS = ("weights", "activations")


class DiffusionEngine:
    """Load a diffusers-format text-to-image model and generate images.

    `DiffusionEngine(model_path=None, **options)`: options are `DiffusionConfig` fields (`device`,
    `dtype`, `load_format`, `component_residency`, ...); unknown ones raise `ValueError`. With no
    `model_path`, or `"demo-diffusion"`, the built-in tiny model is used. Thread-safe: batches, weight
    updates and memory release/resume run one at a time (a lock), so an update lands between batches.

    RL handover (the LLM `Engine`'s names and replies): `update_weights_from_tensor` /
    `update_weights_from_disk` write the denoiser (validated first; a refused update changes nothing),
    `weight_version` is on every result's `meta_info`; `release_memory_occupation` /
    `resume_memory_occupation` by tag (`weights`, `activations`). Each returns `{"success",
    "message", ...}` rather than raising.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = DiffusionConfig.from_kwargs(model_path=model_path, **kwargs)
        logging.getLogger("tide").setLevel(self.config.log_level.upper())
        self.memory_ledger = MemoryLedger()  # this engine's release points and lifecycle marks
        self.pipeline = ImagePipeline(self.config, self.memory_ledger)
        self.weights = DenoiserWeights(self.pipeline.residency, self.pipeline.kind.denoiser)
        self.weight_version = self.config.weight_version
        self._released: set[str] = set()  # memory tags released by release_memory_occupation
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

    @property
    def residency(self) -> ComponentManager:
        """The component manager: placement, host copies, release points."""
        return self.pipeline.residency

    @property
    def released_tags(self) -> list[str]:
        """Memory tags released and not yet resumed (generation waits for none of them)."""
        return [t for t in MEMORY_TAGS if t in self._released]

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
        self._check_open()
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
        """Run requests that share a `batch_key` as one batch; one result per request, in order.

        Out of device memory: the batch fails with `DiffusionOutOfMemoryError` (naming the stage)
        after its components left the device and the allocator cache was emptied (release point
        `oom`); the engine goes on serving. While memory is released: `MemoryReleasedError`."""
        with self._lock:
            self._check_open()
            if self._released:
                raise MemoryReleasedError(f"memory is released ({self.released_tags}); call "
                                          "resume_memory_occupation before generating")
            version = self.weight_version
            start = time.perf_counter()
            oom: str | None = None
            try:
                batch = self.pipeline.run(requests)
            except torch.OutOfMemoryError as e:
                oom = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
            # Out of the except block: the traceback and the failed batch's tensors are gone.
            if oom is not None:
                stage = self.pipeline.executor.current_stage
                self.residency.release_point("oom")
                self.memory_ledger.mark("oom", f"stage {stage}: {oom}")
                raise DiffusionOutOfMemoryError(
                    f"out of device memory in stage {stage!r} for a batch of "
                    f"{sum(r.num_images for r in requests)} image(s) at "
                    f"{requests[0].width}x{requests[0].height}: {oom}. The request failed; the "
                    "engine freed its cache and goes on serving (fewer images, a smaller size, or "
                    "component_residency offload/layerwise use less memory)")
            run_s = time.perf_counter() - start
        assert batch.images is not None and batch.profile is not None  # filled by the stages
        results, offset = [], 0
        for req in requests:
            arrays = batch.images[offset:offset + req.num_images]
            offset += req.num_images
            images: list[Any] = list(arrays) if req.output_type == "np" else to_pil(arrays)
            meta = {
                "rid": req.rid,
                "seed": req.seed,
                "stage_timings_ms": dict(batch.stage_timings_ms),
                "stage_memory": batch.profile.memory(),
                "peak_memory_bytes": batch.profile.peak_bytes,
                "memory_source": batch.profile.memory_source,
                "weight_version": version,
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

    # ---- RL handover
    def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        serialized_named_tensors: str | bytes | list[str] | None = None,
        load_format: str | None = None,
        **options: bool | str | None,
    ) -> dict[str, Any]:
        """Write denoiser parameters: `named_tensors` as [(name, tensor), ...] (or with
        `load_format="flattened_bucket"` `FlattenedBucket`s), or `serialized_named_tensors` made by
        `tide.weights.serialize_named_tensors`. Any subset of the parameters, in their exact dtype.
        `options`: `weight_version` (set on success), `torch_empty_cache` (empty the allocator cache
        afterwards, release point `weight_update`); `flush_cache` and `abort_all_requests` are
        accepted for sglang compatibility (a diffusion engine holds no cache, and runs no request
        while updating)."""
        return self._update(lambda: self.weights.prepare_tensors(
            named_tensors, serialized_named_tensors, load_format), options)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 **options: bool | str | None) -> dict[str, Any]:
        """Load the denoiser from a diffusers component directory of safetensors (or a pipeline
        directory holding one under the denoiser's name): every parameter, cast to its dtype."""
        return self._update(lambda: self.weights.prepare_disk(model_path, load_format), options)

    def _update(self, prepare: Callable[[], Callable[[], int]],
                options: dict[str, bool | str | None]) -> dict[str, Any]:
        try:
            opts = WeightUpdateOptions.from_kwargs(options)
        except ValueError as e:
            return {"success": False, "message": str(e)}
        with self._lock:
            self._check_open()
            try:
                apply = prepare()
            except ValueError as e:  # validated before any write: nothing changed
                return {"success": False, "message": str(e)}
            try:
                count = apply()
            except Exception as e:  # reported to the caller; serving goes on
                logger.exception("weight update failed while writing")
                return {"success": False, "message": f"weight update failed while writing "
                                                     f"({type(e).__name__}: {e}); the {self.weights.name} "
                                                     "may be partly updated"}
            if opts.weight_version is not None:
                self.weight_version = opts.weight_version
            if opts.torch_empty_cache:
                self.residency.release_point("weight_update")
            self.memory_ledger.mark("weight_update", f"{count} tensors, version {self.weight_version}")
        return {"success": True, "weight_version": self.weight_version,
                "message": f"updated {count} tensor(s) of the {self.weights.name}; weight_version "
                           f"{self.weight_version}"}

    def update_weight_version(self, new_version: str) -> dict[str, Any]:
        """Set the version reported on outputs without touching the weights."""
        try:
            check_weight_version(new_version, "new_version")
        except ValueError as e:
            return {"success": False, "message": str(e)}
        with self._lock:
            self._check_open()
            self.weight_version = new_version
        return {"success": True, "message": f"weight_version {new_version}",
                "new_version": new_version}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of denoiser parameter `name`, flattened."""
        with self._lock:
            self._check_open()
            return self.weights.get(name, truncate_size)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Give the device's memory back (None: every tag). `weights`: every component's device
        copy (resident ones go to a pinned host copy, kept for the next release); `activations`: the
        allocator's cached blocks. One release point (`release_memory`); generation waits until
        `resume_memory_occupation`. Releasing a released tag again is a no-op."""
        try:
            wanted = parse_tags(tags, MEMORY_TAGS)
        except ValueError as e:
            return {"success": False, "message": str(e)}
        with self._lock:
            self._check_open()
            new = [t for t in wanted if t not in self._released]
            weights = self.residency.release_weights() if "weights" in new else 0
            self._released.update(new)
            if new:
                self.residency.release_point("release_memory")
                self.memory_ledger.mark("release", ",".join(new))
        return {"success": True, "message": f"released {new or 'nothing new'}; released now: "
                                            f"{self.released_tags}",
                "released_bytes": {"weights": weights}, "released_tags": self.released_tags}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take the memory of `tags` again (`weights`: resident components back on the device from
        their host copies; offloaded ones come back at their stages)."""
        try:
            wanted = parse_tags(tags, MEMORY_TAGS)
        except ValueError as e:
            return {"success": False, "message": str(e)}
        with self._lock:
            self._check_open()
            back = [t for t in wanted if t in self._released]
            restored = self.residency.resume_weights() if "weights" in back else 0
            self._released.difference_update(back)
            if back:
                self.memory_ledger.mark("resume", ",".join(back))
        return {"success": True, "message": f"resumed {back or 'nothing'}; released now: "
                                            f"{self.released_tags}",
                "resumed_bytes": {"weights": restored}, "released_tags": self.released_tags}

    def dump_memory_timeline(self, path: str) -> None:
        """Write this engine's memory ledger as JSON for `tide memory-plot`."""
        self.memory_ledger.dump_json(path)

    def _check_open(self) -> None:
        if self.pipeline is None:
            raise RuntimeError("the diffusion engine is shut down")

    def shutdown(self) -> None:
        """Drop the components (their memory returns to the allocator's cache) and unpin the host
        copies."""
        if self.pipeline is not None:
            with self._lock:
                self.pipeline.residency.close()
                self.pipeline = None  # type: ignore[assignment]
                self.weights = None  # type: ignore[assignment]

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
