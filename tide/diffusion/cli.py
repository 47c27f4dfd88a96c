"""`tide generate` and `tide serve` for diffusion models.

`tide.cli` hands a command here when `--model` is `demo-diffusion` or a directory with a
`model_index.json`. This module imports no diffusers or torch at import time (the parser uses it).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# `tide serve/generate` options that only mean something for LLMs; given with a diffusion model they
# are an error rather than silently ignored.
_LLM_ONLY = ("max_total_tokens", "context_length", "chunked_prefill_size", "disable_radix_cache",
             "attention_backend", "max_running_requests", "mem_fraction_static", "tokenizer_path",
             "enable_memory_saver", "enable_cpu_backup", "chat", "kv_cache_dtype", "quantization")


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("diffusion models (--model demo-diffusion or a diffusers directory)")
    g.add_argument("--out", default=None,
                   help="PNG to write (default: none, required for images; several: NAME-0.png, ...)")
    g.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's)")
    g.add_argument("--num-inference-steps", type=int, default=28, metavar="N",
                   help="denoising steps")
    g.add_argument("--guidance-scale", type=float, default=None,
                   help="classifier-free guidance scale (default: the model's)")
    g.add_argument("--true-cfg-scale", type=float, default=1.0,
                   help="FLUX with --negative-prompt: true CFG scale")
    g.add_argument("--negative-prompt", default=None, help="what not to draw (default: none)")
    g.add_argument("--num-images", type=int, default=1, metavar="N", help="images to generate")
    _add_engine_limits(g)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("diffusion models (--model demo-diffusion or a diffusers directory)")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="image requests that may wait for a batch (default 256); beyond, 503")
    _add_engine_limits(g)


def _add_engine_limits(g: Any) -> None:
    g.add_argument("--max-batch-images", type=int, default=None, metavar="N",
                   help="images per batch and per request (default 16)")
    g.add_argument("--max-sequence-length", type=int, default=None, metavar="N",
                   help="T5 tokens per prompt for FLUX (default 512)")
    g.add_argument("--component-residency", default=None, metavar="SPEC",
                   help="where each model component lives: COMPONENT=STRATEGY,... with strategy "
                        "resident, offload, layerwise or auto (e.g. text_encoder_2=offload,"
                        "transformer=layerwise), or 'auto' (default: every component resident)")
    g.add_argument("--residency-budget-gb", type=float, default=None,
                   help="most GB of component weights on the device at once (auto fits it; "
                        "prefetches wait for room under it; default: no limit)")
    g.add_argument("--layerwise-blocks", type=int, default=None,
                   help="blocks of a layerwise component on the device at once (default 2)")
    g.add_argument("--preferred-resident", default=None, metavar="COMPONENTS",
                   help="offloaded components that stay on the device after a request, "
                        "comma-separated (default: none)")
    g.add_argument("--memory-intensive", default=None, metavar="COMPONENTS",
                   help="components whose release empties the allocator cache, comma-separated "
                        "(default: the denoiser and text encoders of 1 GiB or more)")


def _check_llm_only(args: argparse.Namespace) -> None:
    given = [k for k in _LLM_ONLY if getattr(args, k, None) not in (None, False)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags}: not used by diffusion models")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    _check_llm_only(args)
    kwargs: dict[str, Any] = {"model_path": args.model_path}
    for key in ("device", "dtype", "load_format", "max_batch_images", "max_sequence_length",
                "component_residency", "residency_budget_gb", "layerwise_blocks",
                "preferred_resident", "memory_intensive"):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    if getattr(args, "weight_version", None) not in (None, "default"):
        kwargs["weight_version"] = args.weight_version
    return kwargs


def _require_diffusers() -> None:
    from tide.diffusion import require_diffusers

    try:
        require_diffusers()
    except ImportError as e:
        raise ValueError(str(e)) from None  # the CLI reports ValueErrors as one clean line


def _parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    w, sep, h = size.partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"--size must be WIDTHxHEIGHT, got {size!r}")
    return int(w), int(h)


def generate(args: argparse.Namespace) -> int:
    """`tide generate --model DIR --out img.png "prompt"`."""
    if not args.out:
        raise ValueError("--out is required for a diffusion model (the PNG to write)")
    _require_diffusers()
    from tide.diffusion.engine import DiffusionEngine

    width, height = _parse_size(args.size)
    kwargs = engine_kwargs(args)
    if args.log_level is not None:
        kwargs["log_level"] = args.log_level
    engine = DiffusionEngine(**kwargs)
    out = engine.generate(args.prompt, negative_prompt=args.negative_prompt, height=height,
                          width=width, num_inference_steps=args.num_inference_steps,
                          guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale,
                          seed=args.seed, num_images_per_prompt=args.num_images)
    images = out["images"]
    stem, ext = os.path.splitext(args.out)
    paths = [args.out] if len(images) == 1 else [f"{stem}-{i}{ext or '.png'}" for i in range(len(images))]
    for image, path in zip(images, paths):
        image.save(path, format="PNG")
    meta = out["meta_info"]
    stages = ", ".join(f"{k} {v:.0f} ms" for k, v in meta["stage_timings_ms"].items())
    sys.stderr.write(f"wrote {', '.join(paths)} ({meta['width']}x{meta['height']}, seed "
                     f"{meta['seed']}, {meta['e2e_latency']:.2f}s: {stages})\n")
    return 0


def serve(args: argparse.Namespace) -> int:
    """`tide serve --model DIR`: the OpenAI images API."""
    from tide.diffusion import DiffusionConfig

    _require_diffusers()
    from tide.diffusion.server import DiffusionServerArgs, launch_diffusion_server

    log_level = args.log_level or "info"
    extra: dict[str, Any] = {}
    if args.max_queued_requests is not None:
        extra["max_queued_requests"] = args.max_queued_requests
    if args.allowed_weight_roots:
        extra["allowed_weight_roots"] = tuple(args.allowed_weight_roots)
    for name in ("header_read_timeout", "body_read_timeout"):
        if getattr(args, name, None) is not None:
            extra[name] = getattr(args, name)
    server_args = DiffusionServerArgs(
        engine=DiffusionConfig.from_kwargs(**engine_kwargs(args), log_level=log_level),
        host=args.host, port=args.port, admin_api_key=args.admin_api_key,
        api_key=",".join(args.api_key) if args.api_key else None,
        served_model_name=args.served_model_name, log_level=log_level,
        allow_unauthenticated_admin=bool(getattr(args, "allow_unauthenticated_admin", False)),
        allowed_hosts=tuple(args.allowed_hosts or ()), **extra)
    return launch_diffusion_server(server_args)
