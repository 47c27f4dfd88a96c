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
    for bs in args.batch_sizes:
        prompts = (PROMPTS * bs)[:bs]

        def run_tide(prompts: list[str] = prompts) -> tuple[np.ndarray, dict[str, float], float]:
            start = clock.mark()
            res = engine.generate(prompts, height=args.size, width=args.size,
                                  num_inference_steps=args.steps, guidance_scale=guidance, seed=0,
                                  output_type="np")
            end = clock.mark()
            clock.sync()
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
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
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


def markdown(res: dict[str, Any]) -> str:
    header = ("| model | batch | system | latency ms | ms/image | images/s | text enc | denoise | "
              "decode | peak GB |")
    lines = [f"Device: {res['device']}; torch {res['torch']}, diffusers {res['diffusers']}; "
             f"{res['date']}", "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for m in res["results"].values():
        for bs, row in m["batch"].items():
            for system in ("tide", "diffusers"):
                r = row[system]
                s = r["stage_ms"]
                peak = f"{r['peak_memory_bytes'] / 1e9:.1f}" if r["peak_memory_bytes"] else "-"
                lines.append(f"| {m['shape']} {m['height']}x{m['width']} {m['steps']} steps | {bs} | "
                             f"{system} | {r['latency_ms']:.0f} | {r['latency_per_image_ms']:.0f} | "
                             f"{r['images_per_s']:.3f} | {s['text_encoding']:.0f} | "
                             f"{s['denoising']:.0f} | {s['decoding']:.0f} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import diffusers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true",
                    help="tiny random models, small images, few steps (runs on a CPU)")
    ap.add_argument("--models", default="flux,sdxl")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4; quick 1,2)")
    ap.add_argument("--size", type=int, default=None, help="image side (default 1024; quick 32)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default 3; quick 1)")
    ap.add_argument("--dtype", default=None, help="default bfloat16; quick: auto")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    q = args.quick
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if q else "1,4")).split(",")]
    args.size = args.size or (32 if q else 1024)
    args.steps = args.steps or (2 if q else 28)
    args.repeats = args.repeats or (1 if q else 3)
    args.dtype = args.dtype or ("auto" if q else "bfloat16")
    torch.set_grad_enabled(False)
    root = tempfile.gettempdir()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu"
        else "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__, "quick": q,
        "command": "python -m benchmarks.diffusion " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": {},
    }
    for name in args.models.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {sorted(SHAPES)}")
        model_dir = write_quick_dir(name, root) if q else write_shape_dir(name, root)
        res["results"][name] = bench_model(name, model_dir, args)
        gc.collect()  # the model's engine and pipeline are gone with bench_model's frame
        if torch.cuda.is_available():
            from tide.memory import empty_device_cache

            empty_device_cache(reason="benchmark_teardown", ledger=None)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
