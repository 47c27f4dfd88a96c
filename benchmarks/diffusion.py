"""Text-to-image latency: tide's stage pipeline vs diffusers' own pipeline, same weights, same run.

    python -m benchmarks.diffusion --out diffusion.json             # FLUX.1-dev + SDXL shapes, GPU
    python -m benchmarks.diffusion --quick --out quick.json         # tiny shapes, CPU, < 1 minute

Full mode: FLUX.1-dev and SDXL-base-1.0 shapes with `load_format="dummy"` (random weights at the real
shapes, configs written here, nothing downloaded), bfloat16, 1024x1024, 28 steps, batch 1 and 4.
diffusers' `FluxPipeline` / `StableDiffusionXLPipeline` is built over the very modules tide loaded,
so both run identical weights. Per batch size: end-to-end latency (median of `--repeats` after one
warm-up, runs of the two interleaved), latency per image, images/s, per-stage milliseconds (tide: its
stage timings; diffusers: CUDA events around its text encoders, the span from the first to the last
denoiser call, and `vae.decode`; what is left is `other`), the peak allocated device memory of the
timed runs, and the max abs difference between the two pipelines' images (a sanity check: bf16, and
tide batches FLUX's true-CFG rows into one forward).

The prompts are tokenized by tiny tokenizers (the real vocabularies are not downloaded): token ids
differ from the real ones, shapes and cost do not (CLIP 77 tokens, T5 512).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

PROMPTS = ["a red fox in the snow, golden hour", "a lighthouse on a cliff at night",
           "a bowl of ramen, studio photo", "an astronaut riding a horse on the moon"]

CLIP_L = {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "vocab_size": 49408,
          "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
          "num_hidden_layers": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
          "layer_norm_eps": 1e-5, "projection_dim": 768, "bos_token_id": 0, "eos_token_id": 2,
          "pad_token_id": 1}
CLIP_BIGG = {**CLIP_L, "architectures": ["CLIPTextModelWithProjection"], "hidden_size": 1280,
             "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32,
             "hidden_act": "gelu", "projection_dim": 1280}
T5_XXL = {"architectures": ["T5EncoderModel"], "model_type": "t5", "vocab_size": 32128,
          "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_decoder_layers": 24,
          "num_heads": 64, "relative_attention_num_buckets": 32,
          "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
          "dense_act_fn": "gelu_new", "is_gated_act": True, "layer_norm_epsilon": 1e-6,
          "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
          "decoder_start_token_id": 0, "is_encoder_decoder": True, "use_cache": False}
_VAE = {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "layers_per_block": 2, "norm_num_groups": 32,
        "sample_size": 1024, "force_upcast": True}
FLUX_DEV = {
    "model_index": {"_class_name": "FluxPipeline"},
    "transformer": {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64,
                    "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                    "num_attention_heads": 24, "joint_attention_dim": 4096,
                    "pooled_projection_dim": 768, "guidance_embeds": True,
                    "axes_dims_rope": [16, 56, 56]},
    "vae": {**_VAE, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False},
    "text_encoder": CLIP_L,
    "text_encoder_2": T5_XXL,
    "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                  "shift": 3.0, "use_dynamic_shifting": True, "base_image_seq_len": 256,
                  "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15},
}
SDXL_BASE = {
    "model_index": {"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True},
    "unet": {"_class_name": "UNet2DConditionModel", "sample_size": 128, "in_channels": 4,
             "out_channels": 4, "block_out_channels": [320, 640, 1280], "layers_per_block": 2,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
             "attention_head_dim": [5, 10, 20], "transformer_layers_per_block": [1, 2, 10],
             "cross_attention_dim": 2048, "use_linear_projection": True,
             "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
             "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32},
    "vae": {**_VAE, "latent_channels": 4, "scaling_factor": 0.13025},
    "text_encoder": CLIP_L,
    "text_encoder_2": CLIP_BIGG,
    "scheduler": {"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000,
                  "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                  "prediction_type": "epsilon", "interpolation_type": "linear",
                  "timestep_spacing": "leading", "steps_offset": 1, "use_karras_sigmas": False},
}
SHAPES = {"flux": ("FLUX.1-dev", FLUX_DEV), "sdxl": ("SDXL-base-1.0", SDXL_BASE)}
_LIBRARY = {"FluxTransformer2DModel": "diffusers", "UNet2DConditionModel": "diffusers",
            "AutoencoderKL": "diffusers", "FlowMatchEulerDiscreteScheduler": "diffusers",
            "EulerDiscreteScheduler": "diffusers"}


def write_shape_dir(name: str, root: str) -> str:
    """A diffusers-format directory with the configs of shape `name` and tiny tokenizers (no weights)."""
    from tide.diffusion.tiny import clip_tokenizer, t5_tokenizer

    spec = SHAPES[name][1]
    path = os.path.join(root, f"tide-diffusion-shape-{name}")
    index = dict(spec["model_index"])
    for comp, cfg in spec.items():
        if comp == "model_index":
            continue
        os.makedirs(os.path.join(path, comp), exist_ok=True)
        cls = cfg.get("_class_name") or cfg["architectures"][0]
        index[comp] = [_LIBRARY.get(cls, "transformers"), cls]
        fname = "scheduler_config.json" if comp == "scheduler" else "config.json"
        with open(os.path.join(path, comp, fname), "w") as f:
            json.dump(cfg, f, indent=2)
    toks = {"tokenizer": clip_tokenizer()}
    toks["tokenizer_2"] = t5_tokenizer() if name == "flux" else clip_tokenizer()
    for comp, tok in toks.items():
        tok.save_pretrained(os.path.join(path, comp))
        index[comp] = ["transformers", type(tok).__name__]
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return path


def write_quick_dir(name: str, root: str) -> str:
    """Tiny random pipelines (tide.diffusion.tiny) for `--quick`."""
    from tide.diffusion.tiny import build_tiny_flux, build_tiny_sdxl

    path = os.path.join(root, f"tide-diffusion-quick-{name}")
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        (build_tiny_flux if name == "flux" else build_tiny_sdxl)(path)
    return path


def diffusers_pipeline(engine: Any) -> Any:
    """diffusers' pipeline over the modules tide loaded (same weights, same devices)."""
    from diffusers import FluxPipeline, StableDiffusionXLPipeline

    c = dict(engine.pipeline.components)
    c["scheduler"] = copy.deepcopy(c["scheduler"])
    if engine.kind == "flux":
        pipe = FluxPipeline(**c)
    else:
        pipe = StableDiffusionXLPipeline(**c, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class _Clock:
    """CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class StageSpans:
    """Times diffusers' pipeline by stage: hooks on its text encoders and denoiser, a wrapper
    around `vae.decode` (installed for one call, then removed: the modules are tide's too)."""

    def __init__(self, pipe: Any, denoiser: str, clock: _Clock) -> None:
        self.pipe, self.denoiser, self.clock = pipe, denoiser, clock
        self.spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self._open: dict[str, Any] = {}

    def _hooks(self, module: Any, stage: str) -> list[Any]:
        def pre(*_: Any) -> None:
            self._open[stage] = self.clock.mark()

        def post(*_: Any) -> None:
            self.spans[stage].append((self._open.pop(stage), self.clock.mark()))

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def run(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, float], float]:
        self.spans.clear()
        handles = (self._hooks(self.pipe.text_encoder, "text_encoding")
                   + self._hooks(self.pipe.text_encoder_2, "text_encoding")
                   + self._hooks(getattr(self.pipe, self.denoiser), "denoising"))
        vae = self.pipe.vae
        decode = vae.decode

        def timed_decode(*a: Any, **k: Any) -> Any:
            start = self.clock.mark()
            out = decode(*a, **k)
            self.spans["decoding"].append((start, self.clock.mark()))
            return out

        vae.decode = timed_decode
        try:
            start = self.clock.mark()
            out = fn()
            end = self.clock.mark()
            self.clock.sync()
        finally:
            del vae.decode
            for h in handles:
                h.remove()
        total = self.clock.ms(start, end)
        stages = {"text_encoding": sum(self.clock.ms(a, b) for a, b in self.spans["text_encoding"])}
        den = self.spans["denoising"]
        stages["denoising"] = self.clock.ms(den[0][0], den[-1][1]) if den else 0.0
        stages["decoding"] = sum(self.clock.ms(a, b) for a, b in self.spans["decoding"])
        stages["other"] = total - sum(stages.values())
        return out, stages, total


def _median_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(d[k] for d in ds) for k in ds[0]}


def bench_model(name: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import tide

    engine = tide.DiffusionEngine(model_dir, load_format="dummy", dtype=args.dtype,
                                  device=args.device, max_batch_images=max(args.batch_sizes),
                                  seed=0)
    device = engine.device
    clock = _Clock(device)
    pipe = diffusers_pipeline(engine)
    spans = StageSpans(pipe, engine.pipeline.kind.denoiser, clock)
    weights = sum(i.num_bytes for i in engine.pipeline.component_infos)
    guidance = engine.default_guidance_scale
    out: dict[str, Any] = {"shape": SHAPES[name][0] if not args.quick else f"tiny-{name}",
                           "height": args.size, "width": args.size, "steps": args.steps,
                           "guidance_scale": guidance, "dtype": str(engine.dtype).split(".")[-1],
                           "weights_bytes": weights, "batch": {}}
    print(f"{name}: {out['shape']} {args.size}x{args.size}, {args.steps} steps, "
          f"{weights / 1e9:.2f} GB weights on {device}", flush=True)
    tide_peak: list[int] = []
    for bs in args.batch_sizes:
        prompts = (PROMPTS * bs)[:bs]

        def run_tide(prompts: list[str] = prompts) -> tuple[np.ndarray, dict[str, float], float]:
            start = clock.mark()
            res = engine.generate(prompts, height=args.size, width=args.size,
                                  num_inference_steps=args.steps, guidance_scale=guidance, seed=0,
                                  output_type="np")
            end = clock.mark()
            clock.sync()
            tide_peak.append(res["meta_info"]["peak_memory_bytes"])
            return np.stack(res["images"]), res["meta_info"]["stage_timings_ms"], clock.ms(start, end)

        def run_diffusers(prompts: list[str] = prompts) -> tuple[np.ndarray, dict[str, float], float]:
            gen = torch.Generator(device=device).manual_seed(0)
            images, stages, total = spans.run(lambda: pipe(
                prompt=prompts, height=args.size, width=args.size, num_inference_steps=args.steps,
                guidance_scale=guidance, generator=gen, output_type="np").images)
            return images, stages, total

        run_tide()  # warm-up (kernel selection, allocator growth)
        run_diffusers()
        runs: dict[str, list[Any]] = {"tide": [], "diffusers": []}
        peaks: dict[str, int | None] = {}
        for _ in range(args.repeats):
            for system, fn in (("tide", run_tide), ("diffusers", run_diffusers)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                runs[system].append(fn())
                # tide: its profiler's peak (it resets the allocator's peak at every stage).
                peak = (tide_peak[-1] if system == "tide" else torch.cuda.max_memory_allocated(device)) \
                    if device.type == "cuda" else None
                peaks[system] = max(peaks.get(system) or 0, peak) if peak is not None else None
        row: dict[str, Any] = {}
        for system, rs in runs.items():
            latency_ms = statistics.median(r[2] for r in rs)
            row[system] = {"latency_ms": latency_ms, "latency_per_image_ms": latency_ms / bs,
                           "images_per_s": bs / (latency_ms / 1e3),
                           "stage_ms": _median_dict([r[1] for r in rs]),
                           "runs_ms": [r[2] for r in rs], "peak_memory_bytes": peaks[system]}
        row["tide_over_diffusers_latency"] = row["tide"]["latency_ms"] / row["diffusers"]["latency_ms"]
        row["max_abs_diff"] = float(np.abs(runs["tide"][0][0] - runs["diffusers"][0][0]).max())
        out["batch"][str(bs)] = row
        t, d = row["tide"], row["diffusers"]
        print(f"  batch {bs}: tide {t['latency_ms']:.0f} ms ({t['images_per_s']:.3f} img/s), "
              f"diffusers {d['latency_ms']:.0f} ms ({d['images_per_s']:.3f} img/s), ratio "
              f"{row['tide_over_diffusers_latency']:.3f}, max|diff| {row['max_abs_diff']:.2e}",
              flush=True)
        print("    tide stages:      " + _fmt(t["stage_ms"]), flush=True)
        print("    diffusers stages: " + _fmt(d["stage_ms"]), flush=True)
    return out


def _fmt(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in stages.items())


# ---------------------------------------------------------------------------------------------------
# Component residency: tide's strategies and diffusers' own offloading, same run


def residency_spec(strategy: str, kind: str) -> str:
    """The `component_residency` of a benchmark strategy: `resident` (everything on the GPU),
    `offload` (every model component offloaded), `layerwise` (the denoiser and the large text encoder
    streamed block by block, the small components offloaded)."""
    denoiser = "transformer" if kind == "flux" else "unet"
    comps = ("text_encoder", "text_encoder_2", denoiser, "vae")
    if strategy == "resident":
        return ""
    if strategy == "offload":
        return ",".join(f"{c}=offload" for c in comps)
    if strategy == "layerwise":
        return (f"text_encoder=offload,text_encoder_2=layerwise,{denoiser}=layerwise,vae=offload")
    raise SystemExit(f"--residency: unknown strategy {strategy!r}; choose from {RESIDENCY_CHOICES}")


RESIDENCY_CHOICES = ("resident", "offload", "layerwise")
PEER_CHOICES = ("model_cpu_offload", "group_offload")


def _host_rss() -> int:
    from tide.memory.observe import process_rss

    return process_rss()


def _teardown(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        from tide.memory import empty_device_cache

        empty_device_cache(reason="benchmark_teardown", ledger=None)


class _DelayedStage:
    """A stage that sleeps `ms` before running (the `--inject-stage-delay` test hook of --check)."""

    def __init__(self, stage: Any, ms: float) -> None:
        self.stage, self.ms = stage, ms
        self.name, self.components = stage.name, stage.components

    def __call__(self, batch: Any) -> None:
        time.sleep(self.ms / 1e3)
        self.stage(batch)


def _inject_delays(engine: Any, delays: dict[str, float]) -> None:
    executor = engine.pipeline.executor
    executor.stages = tuple(_DelayedStage(s, delays[s.name]) if s.name in delays else s
                            for s in executor.stages)


def _timed(fn: Callable[[], Any], clock: _Clock) -> tuple[Any, float]:
    start = clock.mark()
    out = fn()
    end = clock.mark()
    clock.sync()
    return out, clock.ms(start, end)


def bench_residency(name: str, model_dir: str, args: argparse.Namespace,
                    save: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """tide under each `--residency` strategy, then diffusers' `--peers`, one after the other in
    this process (each with fresh modules and the same dummy weights): latency, per-stage ms, peak
    allocated device memory, host RSS, release points, and the max abs difference of the images
    from tide's first strategy's. `save(partial)` is called after each system."""
    import tide

    out: dict[str, Any] = {"shape": SHAPES[name][0] if not args.quick else f"tiny-{name}",
                           "height": args.size, "width": args.size, "steps": args.steps,
                           "batch_sizes": args.batch_sizes, "strategies": {}, "peers": {}}
    ref: dict[int, np.ndarray] = {}

    def engine_for(strategy: str) -> Any:
        kind = "flux" if name == "flux" else "sdxl"
        kwargs: dict[str, Any] = {}
        if args.residency_budget_gb is not None:
            kwargs["residency_budget_gb"] = args.residency_budget_gb
        if args.layerwise_blocks is not None:
            kwargs["layerwise_blocks"] = args.layerwise_blocks
        return tide.DiffusionEngine(model_dir, load_format="dummy", dtype=args.dtype,
                                    device=args.device, max_batch_images=max(args.batch_sizes),
                                    seed=0, component_residency=residency_spec(strategy, kind),
                                    **kwargs)

    for strategy in args.residency:
        engine = engine_for(strategy)
        device = engine.device
        clock = _Clock(device)
        if args.inject_stage_delay:
            _inject_delays(engine, args.inject_stage_delay)
        guidance = engine.default_guidance_scale
        row: dict[str, Any] = {"component_residency": dict(engine.pipeline.strategies),
                               "weights_bytes": sum(i.num_bytes for i in engine.pipeline.component_infos),
                               "host_copy_bytes": engine.residency.host_bytes(), "batch": {}}
        for bs in args.batch_sizes:
            prompts = (PROMPTS * bs)[:bs]

            def run(prompts: list[str] = prompts, engine: Any = engine, guidance: float = guidance
                    ) -> dict[str, Any]:
                return engine.generate(prompts, height=args.size, width=args.size,
                                       num_inference_steps=args.steps, guidance_scale=guidance,
                                       seed=0, output_type="np")

            _timed(run, clock)  # warm-up
            runs = [_timed(run, clock) for _ in range(args.repeats)]
            images = np.stack(runs[0][0]["images"])
            ref.setdefault(bs, images)
            metas = [r[0]["meta_info"] for r in runs]
            latency = statistics.median(r[1] for r in runs)
            row["batch"][str(bs)] = {
                "latency_ms": latency, "runs_ms": [r[1] for r in runs],
                "stage_ms": _median_dict([m["stage_timings_ms"] for m in metas]),
                "peak_memory_bytes": max(m["peak_memory_bytes"] for m in metas),
                "memory_source": metas[0]["memory_source"],
                "max_abs_diff": float(np.abs(images - ref[bs]).max()),
            }
            b = row["batch"][str(bs)]
            print(f"  {strategy:<10} bs{bs}: {latency:.0f} ms, peak {b['peak_memory_bytes'] / 1e9:.2f} GB "
                  f"({b['memory_source']}), max|diff| {b['max_abs_diff']:.1e}; {_fmt(b['stage_ms'])}",
                  flush=True)
        row["host_rss_bytes"] = _host_rss()
        row["releases"] = engine.memory_ledger.totals()
        if args.flat_requests:
            row["flat"] = _flatness(engine, args)
        out["strategies"][strategy] = row
        save(out)
        engine.shutdown()
        del engine
        _teardown(device)

    for peer in args.peers:
        out["peers"][peer] = _bench_peer(peer, model_dir, args, ref)
        save(out)
        if torch.cuda.is_available():
            _teardown(torch.device("cuda"))
    return out


def _flatness(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`--flat-requests` requests back to back: reserved device memory and host RSS after the 2nd and
    the last, and the release points taken (none at stage boundaries)."""
    device = engine.device
    readings = []
    before = {r: t["count"] for r, t in engine.memory_ledger.totals().items()}
    for i in range(args.flat_requests):
        engine.generate(PROMPTS[0], height=args.size, width=args.size,
                        num_inference_steps=args.steps, seed=i, output_type="np")
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        readings.append({"reserved": reserved, "rss": _host_rss(),
                         "host_copies": engine.residency.host_bytes()})
    after = {r: t["count"] for r, t in engine.memory_ledger.totals().items()}
    second, last = readings[1], readings[-1]
    res = {"requests": args.flat_requests, "after_2": second, "after_last": last,
           "reserved_growth": (last["reserved"] - second["reserved"]) / max(second["reserved"], 1),
           "rss_growth": (last["rss"] - second["rss"]) / max(second["rss"], 1),
           "releases": {r: after[r] - before.get(r, 0) for r in after}}
    print(f"    {args.flat_requests} requests: reserved {second['reserved'] / 1e9:.2f} -> "
          f"{last['reserved'] / 1e9:.2f} GB, RSS {second['rss'] / 1e9:.2f} -> {last['rss'] / 1e9:.2f} GB, "
          f"releases {res['releases']}", flush=True)
    return res


def _bench_peer(peer: str, model_dir: str, args: argparse.Namespace,
                ref: dict[int, np.ndarray]) -> dict[str, Any]:
    """diffusers' pipeline over fresh modules (same dummy weights) with its own offloading."""
    import tide

    if not (torch.cuda.is_available() and args.device != "cpu"):
        print(f"  {peer}: skipped (diffusers' offloading needs a CUDA device)", flush=True)
        return {"skipped": "needs a CUDA device"}
    engine = tide.DiffusionEngine(model_dir, load_format="dummy", dtype=args.dtype, device=args.device,
                                  max_batch_images=max(args.batch_sizes), seed=0)
    device = engine.device
    pipe = diffusers_pipeline(engine)
    guidance = engine.default_guidance_scale
    denoiser = engine.pipeline.kind.denoiser
    del engine
    if peer == "model_cpu_offload":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    _teardown(device)
    clock = _Clock(device)
    spans = StageSpans(pipe, denoiser, clock)
    row: dict[str, Any] = {"batch": {}}
    for bs in args.batch_sizes:
        prompts = (PROMPTS * bs)[:bs]

        def run(prompts: list[str] = prompts) -> tuple[np.ndarray, dict[str, float], float, int]:
            torch.cuda.reset_peak_memory_stats(device)
            gen = torch.Generator(device=device).manual_seed(0)
            images, stages, total = spans.run(lambda: pipe(
                prompt=prompts, height=args.size, width=args.size, num_inference_steps=args.steps,
                guidance_scale=guidance, generator=gen, output_type="np").images)
            return images, stages, total, torch.cuda.max_memory_allocated(device)

        run()
        runs = [run() for _ in range(args.repeats)]
        latency = statistics.median(r[2] for r in runs)
        images = runs[0][0]
        row["batch"][str(bs)] = {
            "latency_ms": latency, "runs_ms": [r[2] for r in runs],
            "stage_ms": _median_dict([r[1] for r in runs]),
            "peak_memory_bytes": max(r[3] for r in runs),
            "max_abs_diff": float(np.abs(images - ref[bs]).max()) if bs in ref else None,
        }
        b = row["batch"][str(bs)]
        print(f"  {peer:<17} bs{bs}: {latency:.0f} ms, peak {b['peak_memory_bytes'] / 1e9:.2f} GB, "
              f"max|diff| {b['max_abs_diff']}; {_fmt(b['stage_ms'])}", flush=True)
    row["host_rss_bytes"] = _host_rss()
    pipe.remove_all_hooks()
    return row


# ---------------------------------------------------------------------------------------------------
# Per-stage baselines: --update writes them, --check compares a run with them

BASELINES_FORMAT = "tide.diffusion_baselines/1"
DEFAULT_BASELINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "diffusion_baselines.json")
# Tolerance rules by stage. Absolute by default (`abs_ms`, at least `abs_frac` of the baseline);
# relative with an absolute floor (`rel`, `floor_ms`) for the decode, whose time also holds device
# work its neighbours queued (the events see it when the decode's host copy waits for it).
# The 25 ms floor covers what short stages varied by across three H200 runs: host-launch jitter
# (resident text encoding 29-40 ms) and the 9.5 GB text-encoder copy of `offload` (211-229 ms);
# long stages varied by < 1%.
GPU_RULES: dict[str, dict[str, float]] = {
    "default": {"abs_ms": 25.0, "abs_frac": 0.03},
    "decoding": {"rel": 0.10, "floor_ms": 10.0},
}
# A shared 2-core CPU runner is noisy: wide enough never to flake, narrow enough to see 0.3 s.
CPU_RULES: dict[str, dict[str, float]] = {
    "default": {"abs_ms": 150.0, "abs_frac": 0.5},
    "decoding": {"rel": 1.0, "floor_ms": 150.0},
}
# The run settings a baseline file records and --check reuses unless given on the command line.
_RUN_ARGS = ("models", "batch_sizes", "size", "steps", "repeats", "dtype", "device", "quick",
             "residency", "layerwise_blocks", "residency_budget_gb")


def baseline_key(model: dict[str, Any], strategy: str, bs: str) -> str:
    return f"{model['shape']}/{model['width']}x{model['height']}/{model['steps']}steps/bs{bs}/{strategy}"


def tolerance(rule: dict[str, float], ms: float) -> float:
    """How far (ms) a measurement may be from baseline `ms` under `rule`."""
    if "rel" in rule:
        return max(rule["rel"] * ms, rule.get("floor_ms", 0.0))
    return max(rule["abs_ms"], rule.get("abs_frac", 0.0) * ms)


def check_results(res: dict[str, Any], baselines: dict[str, Any]) -> list[str]:
    """One line per stage outside its tolerance (and per run without a baseline)."""
    failures: list[str] = []
    entries = baselines.get("entries", {})
    for model in res["results"].values():
        for strategy, row in model["strategies"].items():
            for bs, b in row["batch"].items():
                key = baseline_key(model, strategy, bs)
                entry = entries.get(key)
                if entry is None:
                    failures.append(f"{key}: no baseline (run --update on the reference device)")
                    continue
                for stage, base in entry["stages"].items():
                    got = b["stage_ms"].get(stage)
                    if got is None:
                        failures.append(f"{key}: stage {stage} was not measured")
                        continue
                    allowed = tolerance(base["rule"], base["ms"])
                    if abs(got - base["ms"]) > allowed:
                        word = "slower" if got > base["ms"] else "faster"
                        failures.append(f"{key}: stage {stage} {got:.1f} ms is {word} than its "
                                        f"baseline {base['ms']:.1f} ms by {abs(got - base['ms']):.1f} ms "
                                        f"(tolerance {allowed:.1f} ms)")
    return failures


def update_baselines(res: dict[str, Any], baselines: dict[str, Any],
                     args: argparse.Namespace) -> dict[str, Any]:
    """`baselines` with the entries of this run replaced (rules kept where an entry had them)."""
    rules = CPU_RULES if res["device"] == "cpu" else GPU_RULES
    entries = dict(baselines.get("entries", {}))
    for model in res["results"].values():
        for strategy, row in model["strategies"].items():
            for bs, b in row["batch"].items():
                key = baseline_key(model, strategy, bs)
                old = entries.get(key, {}).get("stages", {})
                stages = {}
                for stage, ms in b["stage_ms"].items():
                    rule = old.get(stage, {}).get("rule") or dict(rules.get(stage, rules["default"]))
                    stages[stage] = {"ms": round(ms, 3), "rule": rule}
                entries[key] = {"device": res["device"], "date": res["date"], "stages": stages,
                                "latency_ms": round(b["latency_ms"], 3),
                                "peak_memory_bytes": b["peak_memory_bytes"]}
    return {"format": BASELINES_FORMAT, "reference_device": res["device"],
            "torch": res["torch"], "args": {k: getattr(args, k) for k in _RUN_ARGS},
            "rules": {"gpu": GPU_RULES, "cpu": CPU_RULES}, "entries": entries}


def load_baselines(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {"format": BASELINES_FORMAT, "entries": {}}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != BASELINES_FORMAT:
        raise SystemExit(f"{path}: not a tide diffusion baselines file ({BASELINES_FORMAT})")
    return data


# ---------------------------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Device: {res['device']}; torch {res['torch']}, diffusers {res['diffusers']}; "
             f"{res['date']}", ""]
    plain = {n: m for n, m in res["results"].items() if "batch" in m}
    if plain:
        lines += ["| model | batch | system | latency ms | ms/image | images/s | text enc | denoise | "
                  "decode | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in plain.values():
        for bs, row in m["batch"].items():
            for system in ("tide", "diffusers"):
                r = row[system]
                s = r["stage_ms"]
                peak = f"{r['peak_memory_bytes'] / 1e9:.1f}" if r["peak_memory_bytes"] else "-"
                lines.append(f"| {m['shape']} {m['height']}x{m['width']} {m['steps']} steps | {bs} | "
                             f"{system} | {r['latency_ms']:.0f} | {r['latency_per_image_ms']:.0f} | "
                             f"{r['images_per_s']:.3f} | {s['text_encoding']:.0f} | "
                             f"{s['denoising']:.0f} | {s['decoding']:.0f} | {peak} |")
    residency = {n: m for n, m in res["results"].items() if "strategies" in m}
    if residency:
        lines += ["", "| model | batch | system | latency ms | text enc | denoise | decode | peak GB | "
                      "max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    for m in residency.values():
        systems = [(f"tide {k}", v) for k, v in m["strategies"].items()]
        systems += [(f"diffusers {k}", v) for k, v in m["peers"].items() if "batch" in v]
        for bs in map(str, m["batch_sizes"]):
            for label, row in systems:
                b = row["batch"][bs]
                s = b["stage_ms"]
                diff = "-" if b["max_abs_diff"] is None else f"{b['max_abs_diff']:.1e}"
                lines.append(f"| {m['shape']} {m['height']}x{m['width']} {m['steps']} steps | {bs} | "
                             f"{label} | {b['latency_ms']:.0f} | {s.get('text_encoding', 0):.0f} | "
                             f"{s.get('denoising', 0):.0f} | {s.get('decoding', 0):.0f} | "
                             f"{b['peak_memory_bytes'] / 1e9:.3g} | {diff} |")
    return "\n".join(lines)


def _csv(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


def _delays(value: str) -> dict[str, float]:
    out = {}
    for item in _csv(value):
        stage, sep, ms = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--inject-stage-delay: {item!r} is not STAGE=MS")
        out[stage] = float(ms)
    return out


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", default=None,
                    help="tiny random models, small images, few steps (runs on a CPU)")
    ap.add_argument("--models", default=None, help="comma-separated: flux,sdxl (default both)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4; quick 1,2)")
    ap.add_argument("--size", type=int, default=None, help="image side (default 1024; quick 32)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default 3; quick 1)")
    ap.add_argument("--dtype", default=None, help="default bfloat16; quick: auto")
    ap.add_argument("--device", default=None, help="default auto")
    ap.add_argument("--residency", default=None,
                    help=f"tide strategies to compare ({','.join(RESIDENCY_CHOICES)}); with it the "
                         "run measures residency (and --peers) instead of tide vs diffusers")
    ap.add_argument("--peers", default=None,
                    help=f"diffusers' offloading to measure with --residency ({','.join(PEER_CHOICES)}; "
                         "default both on CUDA)")
    ap.add_argument("--layerwise-blocks", type=int, default=None)
    ap.add_argument("--residency-budget-gb", type=float, default=None)
    ap.add_argument("--flat-requests", type=int, default=0,
                    help="also run this many requests back to back per strategy (memory flatness)")
    ap.add_argument("--baselines", default=DEFAULT_BASELINES, help="per-stage baselines JSON")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="run and fail naming every stage outside its baseline's tolerance")
    mode.add_argument("--update", action="store_true", help="run and rewrite the baselines")
    ap.add_argument("--inject-stage-delay", type=_delays, default=None, metavar="STAGE=MS,...",
                    help="sleep this long inside these stages (to see --check fail)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    baselines = load_baselines(args.baselines) if (args.check or args.update) else {}
    if args.check:  # settings not given take the ones the baselines were written with
        for key, value in baselines.get("args", {}).items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    q = bool(args.quick)
    args.quick = q
    args.models = args.models if isinstance(args.models, list) else _csv(args.models or "flux,sdxl")
    if not isinstance(args.batch_sizes, list):
        args.batch_sizes = [int(b) for b in _csv(args.batch_sizes or ("1,2" if q else "1,4"))]
    args.size = args.size or (32 if q else 1024)
    args.steps = args.steps or (2 if q else 28)
    args.repeats = args.repeats or (1 if q else 3)
    args.dtype = args.dtype or ("auto" if q else "bfloat16")
    args.device = args.device or "auto"
    if args.residency is None and (args.check or args.update):
        args.residency = ["resident"]
    if args.residency is not None and not isinstance(args.residency, list):
        args.residency = _csv(args.residency)
    for strategy in args.residency or ():
        if strategy not in RESIDENCY_CHOICES:
            raise SystemExit(f"--residency: unknown strategy {strategy!r}; choose from "
                             f"{list(RESIDENCY_CHOICES)}")
    args.peers = _csv(args.peers) if args.peers is not None else (
        list(PEER_CHOICES) if args.residency and not (args.check or args.update) else [])
    for peer in args.peers:
        if peer not in PEER_CHOICES:
            raise SystemExit(f"--peers: unknown peer {peer!r}; choose from {list(PEER_CHOICES)}")
    with torch.no_grad():  # not set_grad_enabled(False): main() also runs inside test processes
        return _run(args, baselines)


def _run(args: argparse.Namespace, baselines: dict[str, Any]) -> int:
    import diffusers

    q = args.quick
    root = tempfile.gettempdir()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu"
        else "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__, "quick": q,
        "command": "python -m benchmarks.diffusion " + " ".join(args.argv),
        "results": {},
    }
    for name in args.models:
        if name not in SHAPES:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {sorted(SHAPES)}")
        model_dir = write_quick_dir(name, root) if q else write_shape_dir(name, root)
        if args.residency:
            print(f"{name}: {'tiny-' + name if q else SHAPES[name][0]} {args.size}x{args.size}, "
                  f"{args.steps} steps", flush=True)
            def save(partial: dict[str, Any], name: str = name) -> None:
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({**res, "results": {**res["results"], name: partial}}, f, indent=2)

            res["results"][name] = bench_residency(name, model_dir, args, save)
        else:
            res["results"][name] = bench_model(name, model_dir, args)
        gc.collect()  # the model's engine and pipeline are gone with the bench function's frame
        if torch.cuda.is_available():
            from tide.memory import empty_device_cache

            empty_device_cache(reason="benchmark_teardown", ledger=None)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
    print(markdown(res))
    if args.update:
        updated = update_baselines(res, baselines, args)
        with open(args.baselines, "w") as f:
            json.dump(updated, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(updated['entries'])} baseline entries to {args.baselines}")
    if args.check:
        failures = check_results(res, baselines)
        for line in failures:
            print("FAIL " + line)
        if failures:
            print(f"--check: {len(failures)} stage(s) outside tolerance")
            return 1
        print("--check: every stage within tolerance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
