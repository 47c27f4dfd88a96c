"""Hybrid sliding-window models on a GPU host: `python -m benchmarks.swa [--quick] [--only a,b,c,d]`.

Gemma-3-12B and Gemma-2-9B shapes (`load_format="dummy"`, bf16), the same memory budget
(`--mem-fraction`) for every engine:

(a) capacity: how many concurrent requests of `--request-len` tokens (8k) fit, with the two-pool KV
    cache (SWA pool sized for the window: `--swa-ratio`, default (window + page) / request length
    with 15% slack) vs one full-size pool (`swa_full_tokens_ratio=1`: every token keeps K/V in every
    layer, byte for byte a single pool). Reported from the pool sizes (`analytic`) and measured: the
    peak number of requests holding KV while `--capacity-requests` such requests are served
    (each generates request_len / 16 tokens, at most 128, so later admissions meet earlier ones);
(b) bs1 decode tok/s at 1k/8k/32k context (Gemma-2: at most its 8k positions) vs the weight-read
    roofline (parameter bytes / measured copy bandwidth), and vs the roofline that also reads the KV
    each step reads (full layers: the context; sliding layers: the window);
(c) bs64 decode step time, CUDA graphs vs eager, and vs graphs captured from a build where every
    sliding layer translates full slots to SWA slots itself (one gather per layer per step);
(d) offline throughput on the standard workload (256 requests, prompt and output lengths uniform in
    [100, 1024], seed 0, ignore_eos), `benchmarks.run`'s code.

Writes swa.json into --out and prints it. `--quick`: shorter contexts and fewer requests (minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

SHAPES = ("gemma-3-12b", "gemma-2-9b")
PARTS = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Plan:
    """What one run measures (from the command line)."""

    shapes: tuple[str, ...]
    parts: tuple[str, ...]
    request_len: int
    capacity_requests: int
    contexts: tuple[int, ...]
    decode_bs: int
    num_requests: int
    mem_fraction: float
    swa_ratio: float | None
    out: str


def parse_args(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short contexts, few requests")
    ap.add_argument("--only", default=",".join(PARTS), help="parts to run, e.g. a,c")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--request-len", type=int, default=None,
                    help="tokens per request in (a) (default 8192; --quick 2048)")
    ap.add_argument("--capacity-requests", type=int, default=None,
                    help="requests served in (a) (default: 1.2 x the two-pool analytic capacity, "
                         "at most 1024; --quick at most 128)")
    ap.add_argument("--swa-ratio", type=float, default=None,
                    help="swa_full_tokens_ratio of the two-pool engines (default: from the window)")
    ap.add_argument("--contexts", default=None,
                    help="contexts of (b), e.g. 1024,32768 (default 1024,8192,32768; --quick 1024,4096)")
    ap.add_argument("--decode-bs", type=int, default=64, help="batch size of (c)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests of (d) (default 256; --quick 64)")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.only.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown parts {bad}; choose from {list(PARTS)}")
    shapes = tuple(s for s in args.shapes.split(",") if s)
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown shapes {bad}; choose from {list(SHAPES)}")
    if args.swa_ratio is not None and not 0 < args.swa_ratio <= 1:
        ap.error("--swa-ratio must be in (0, 1]")
    quick = args.quick
    return Plan(
        shapes=shapes, parts=parts,
        request_len=args.request_len or (2048 if quick else 8192),
        capacity_requests=args.capacity_requests or 0,
        contexts=tuple(int(c) for c in args.contexts.split(",")) if args.contexts
        else (1024, 4096) if quick else (1024, 8192, 32768),
        decode_bs=args.decode_bs,
        num_requests=args.num_requests or (64 if quick else 256),
        mem_fraction=args.mem_fraction, swa_ratio=args.swa_ratio, out=args.out,
    )


def swa_ratio_for(window: int, request_len: int) -> float:
    """An SWA pool just big enough for every full-length request's window (15% slack)."""
    from tide.memory.swa import swa_page

    return min(1.0, 1.15 * (min(window, request_len) + swa_page(window)) / request_len)


def analytic_capacity(full_tokens: int, swa_tokens: int | None, request_len: int,
                      window: int | None) -> int:
    """Concurrent decoding requests of `request_len` tokens that the pools hold: each needs
    `request_len` full slots and (two pools) window + page SWA slots."""
    from tide.memory.swa import swa_page

    n = full_tokens // request_len
    if swa_tokens is not None and window is not None:
        n = min(n, swa_tokens // (min(window, request_len) + swa_page(window)))
    return n


def kv_bytes_per_step(context: int, full_layers: int, swa_layers: int, window: int,
                      bytes_per_token_layer: int) -> int:
    """K/V bytes one decode step reads at `context`: full layers read all of it, sliding layers
    their window."""
    return bytes_per_token_layer * (full_layers * context + swa_layers * min(context, window))


# ---------------------------------------------------------------- GPU parts


def _engine(shape: str, plan: Plan, **kw: Any):
    from benchmarks.run import make_engine

    return make_engine(shape, mem_fraction_static=plan.mem_fraction, **kw)


def _close(engine) -> None:
    """Shut `engine` down before the next one is built. `shutdown()` frees the weights, pools and
    graphs in place, so the caller's own name for the engine (a loop variable) pins nothing; the
    collection and the cache empty return what is left (cycles, scratch) to the driver."""
    from tide.memory import empty_device_cache

    engine.shutdown()
    gc.collect()
    empty_device_cache(reason="benchmark_teardown", ledger=None)


def _layout(engine) -> dict[str, Any]:
    return engine.get_server_info()["kv_cache_layout"]


def part_a(shape: str, plan: Plan) -> dict[str, Any]:
    from tide.model_config import ModelConfig

    from benchmarks.shapes import config_dir

    mc = ModelConfig.from_dir(config_dir(shape))
    window = mc.sliding_window
    assert window is not None
    ratio = plan.swa_ratio or swa_ratio_for(window, plan.request_len)
    out: dict[str, Any] = {"request_len": plan.request_len, "window": window}
    for name, r in (("two_pool", ratio), ("one_pool", 1.0)):
        engine = _engine(shape, plan, swa_full_tokens_ratio=r, disable_cuda_graph=True,
                         max_running_requests=1024,
                         context_length=min(plan.request_len + 64, mc.max_position_embeddings))
        layout = _layout(engine)
        cap = analytic_capacity(layout["full_tokens"],
                                layout["swa_tokens"] if r < 1.0 else None, plan.request_len,
                                window)
        want = plan.capacity_requests or min(1024 if plan.request_len >= 8192 else 128,
                                             int(1.2 * cap) + 1)
        new_tokens = _capacity_new_tokens(plan.request_len)
        peak, retractions = _peak_running(engine, want, plan.request_len, new_tokens)
        out[name] = {"swa_full_tokens_ratio": r, "layout": layout, "analytic": cap,
                     "requests": want, "new_tokens": new_tokens, "measured_peak_running": peak,
                     "retractions": retractions}
        _close(engine)
        del engine
        print(f"(a) {shape} {name}: {layout['full_tokens']} full tokens, analytic {cap}, "
              f"measured peak {peak} ({retractions} retractions)", flush=True)
    out["ratio_analytic"] = out["two_pool"]["analytic"] / max(1, out["one_pool"]["analytic"])
    out["ratio_measured"] = (out["two_pool"]["measured_peak_running"]
                             / max(1, out["one_pool"]["measured_peak_running"]))
    return out


def _capacity_new_tokens(request_len: int) -> int:
    """New tokens per request in (a): enough decode steps that requests admitted later (one
    prompt per prefill step) join the earlier ones before those finish, few enough that the
    prompts (request_len - this) dominate the cost."""
    return max(1, min(128, request_len // 16))


def _peak_running(engine, n: int, request_len: int, new_tokens: int) -> tuple[int, int]:
    """Serve n requests of request_len tokens (request_len - new_tokens prompt, new_tokens new);
    returns the most that held KV at once after any step (running, plus a prompt mid-chunk), and
    the retractions."""
    sched = engine.scheduler
    peak = 0
    real = sched.step
    before = sched.stats.num_retractions

    def step():
        nonlocal peak
        done = real()
        peak = max(peak, len(sched.running) + (sched.chunked_req is not None))
        return done

    sched.step = step
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(min(1000, vocab // 2), vocab) for _ in range(request_len - new_tokens)]
               for _ in range(n)]
    try:
        engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
    finally:
        del sched.step
    return peak, sched.stats.num_retractions - before


def part_b(shape: str, plan: Plan, bandwidth: float) -> dict[str, Any]:
    from benchmarks.run import bs1_decode, param_bytes

    engine = _engine(shape, plan, cuda_graph_max_bs=1)  # bs1 replays only the bs1 graph
    mc = engine.model_runner.model_config
    nbytes = param_bytes(engine)
    per_layer = 2 * mc.num_key_value_heads * mc.head_dim * 2  # K+V, bf16
    n_swa = len(mc.sliding_layer_ids)
    out: dict[str, Any] = {"param_bytes": nbytes, "weight_roofline_tok_s": bandwidth / nbytes,
                           "backend": type(engine.model_runner.attn_backend).__name__,
                           "cuda_graphs": engine.model_runner.cuda_graph_runner is not None}
    limit = mc.max_position_embeddings
    for label in plan.contexts:
        ctx = label if label + 128 <= limit else limit - 128  # Gemma-2's "8k" is 8064 + 128
        if label > limit:
            out[str(label)] = {"skipped": f"max_position_embeddings {limit}"}
            continue
        tps = bs1_decode(engine, ctx, 128)
        kv = kv_bytes_per_step(ctx, mc.num_hidden_layers - n_swa, n_swa, mc.sliding_window or 0,
                               per_layer)
        out[str(label)] = {"context": ctx, "tok_s": tps,
                           "vs_weight_roofline": tps * nbytes / bandwidth,
                           "vs_weight_and_kv_roofline": tps * (nbytes + kv) / bandwidth,
                           "kv_bytes_per_step": kv}
        print(f"(b) {shape} bs1 @ {ctx}: {tps:.1f} tok/s "
              f"({out[str(label)]['vs_weight_roofline']:.1%} of weight roofline)", flush=True)
    first = [v["tok_s"] for v in out.values() if isinstance(v, dict) and "tok_s" in v]
    if len(first) > 1:
        out["longest_vs_1k"] = first[-1] / first[0]
    _close(engine)
    return out


def _decode_step_s(engine, bs: int, context: int, steps: int = 64) -> float:
    """Seconds per decode step of `bs` requests at `context`: (t(steps) - t(1)) / (steps - 1)."""
    import torch

    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 100000) for _ in range(context)] for _ in range(bs)]

    def timed(n: int) -> float:
        engine.flush_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(4)
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(steps) for _ in range(2))
    return (tn - t1) / (steps - 1)


class _PerLayerTranslation:
    """The slow build (c) compares against: every sliding layer translates the new tokens' full
    slots itself (one gather per layer, captured into the graph) instead of reading the
    once-per-step `out_cache_loc_swa`."""

    def __enter__(self) -> None:
        from tide.executor.forward_batch import ForwardBatch

        self._real = ForwardBatch.cache_loc

        def cache_loc(fb: ForwardBatch, layer_id: int):
            pool = fb.token_to_kv_pool
            if fb.out_cache_loc_swa is not None and pool.is_swa_layer(layer_id):
                return pool.translate(fb.out_cache_loc)
            return fb.out_cache_loc

        ForwardBatch.cache_loc = cache_loc  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        from tide.executor.forward_batch import ForwardBatch

        ForwardBatch.cache_loc = self._real  # type: ignore[method-assign]


def part_c(shape: str, plan: Plan) -> dict[str, Any]:
    import contextlib

    out: dict[str, Any] = {"batch_size": plan.decode_bs, "context": 1024}
    variants = (("graph", True, False), ("eager", False, False),
                ("graph_per_layer_translation", True, True))
    for key, graphs, per_layer in variants:
        with _PerLayerTranslation() if per_layer else contextlib.nullcontext():
            engine = _engine(shape, plan, disable_cuda_graph=not graphs,
                             cuda_graph_max_bs=max(plan.decode_bs, 1))
            runner = engine.model_runner
            if graphs and runner.cuda_graph_runner is None:
                out[key] = {"unavailable":
                            f"{type(runner.attn_backend).__name__} captures no graphs"}
            else:
                pool = runner.token_to_kv_pool
                before = getattr(pool, "num_translations", 0)
                step = _decode_step_s(engine, plan.decode_bs, 1024)
                out[key] = {"step_ms": step * 1e3,
                            "host_translations": getattr(pool, "num_translations", 0) - before}
                print(f"(c) {shape} bs{plan.decode_bs} {key}: {step * 1e3:.2f} ms/step", flush=True)
            _close(engine)
            del engine, runner
    graph = out.get("graph", {}).get("step_ms")
    if graph:
        out["eager_over_graph"] = out["eager"]["step_ms"] / graph
        slow = out.get("graph_per_layer_translation", {}).get("step_ms")
        if slow:
            out["per_layer_translation_over_graph"] = slow / graph
    return out


def part_d(shape: str, plan: Plan) -> dict[str, Any]:
    from benchmarks.run import tide_throughput, workload

    engine = _engine(shape, plan)
    r = tide_throughput(engine, workload(plan.num_requests))
    r["layout"] = _layout(engine)
    _close(engine)
    print(f"(d) {shape}: {r['output_tok_s']:.0f} out tok/s ({r['seconds']:.1f}s)", flush=True)
    return r


def main(argv: list[str] | None = None) -> None:
    import torch

    from benchmarks.run import measure_copy_bandwidth

    plan = parse_args(argv)
    os.makedirs(plan.out, exist_ok=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "torch": torch.__version__, "plan": plan.__dict__}
    bw = measure_copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    path = os.path.join(plan.out, "swa.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=2, default=str)

    for shape in plan.shapes:
        got = res.setdefault(shape, {})
        for part in plan.parts:
            if part == "a":
                got["a"] = part_a(shape, plan)
            elif part == "b":
                got["b"] = part_b(shape, plan, bw)
            elif part == "c":
                got["c"] = part_c(shape, plan)
            else:
                got["d"] = part_d(shape, plan)
            save()
    save()
    print(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
