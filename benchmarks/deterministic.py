"""Deterministic inference cost on a GPU host, Llama-3.1-8B shape (dummy weights), in one run:

    python -m benchmarks.deterministic [--only gemm,throughput,bs1] [--out DIR]

- gemm: the batch-invariant GEMM (`batch_invariant_triton.linear`) against cuBLAS (`F.linear`) at every
  projection shape of the model and M in {1, 64, 256, 1024, 8192}, for each candidate tile
  configuration. A configuration must serve every M of its (N, K) (that is what keeps it
  batch-invariant), so the pick per (N, K) minimises the summed time over the M's, weighted as the
  standard workload spends it. Each pick is checked bit-invariant (rows of M = 1, 37 and 256 equal)
  and, unless --no-apply, installed in `GEMM_CONFIGS` for the engine runs that follow.
- throughput: the standard 256-request workload (prompt and output lengths uniform in [100, 1024],
  seed 0, ignore_eos; `benchmarks.run.workload`) on a default engine and on a deterministic one.
- bs1: bs1 decode tok/s at 128 and 1024 tokens of context, default vs deterministic.

The sweep and the engine runs fit separate invocations (`--only gemm`, then `--only throughput,bs1
--gemm-configs DIR/deterministic.json` to use the sweep's picks).

Writes deterministic.json into --out and prints every number as it is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch
from tide.layers import batch_invariant_triton as bt
from tide.memory import empty_device_cache
from triton.runtime.errors import OutOfResources

from benchmarks.run import bs1_decode, make_engine, tide_throughput, workload

SHAPE = "llama-3.1-8b"
# (N, K) of the model's projections: qkv, o, gate_up, down, lm_head.
PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
M_VALUES = [1, 64, 256, 1024, 8192]
# How much of the standard workload's GEMM time each M stands for (decode batches of tens to 256
# rows; prefill chunks of thousands): the weights of the per-(N, K) pick.
M_WEIGHTS = {1: 0.5, 64: 1.0, 256: 3.0, 1024: 1.0, 8192: 2.0}
CANDIDATES = [
    bt.GemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    bt.GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    bt.GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    bt.GemmConfig(128, 64, 64, num_warps=4, num_stages=4),
    bt.GemmConfig(128, 64, 64, num_warps=4, num_stages=4, programs_per_sm=2),
    bt.GemmConfig(64, 128, 64, num_warps=4, num_stages=4, programs_per_sm=2),
    bt.GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    bt.GemmConfig(64, 64, 64, num_warps=4, num_stages=4),
    bt.GemmConfig(64, 128, 128, num_warps=4, num_stages=3),
    bt.GemmConfig(128, 128, 128, num_warps=8, num_stages=2),
]


def _time(fn, reps: int = 30) -> float:
    """Median seconds of `fn` (a CUDA-graph replay, so launch overhead is not counted)."""
    from benchmarks.timing import capture

    graph = capture(fn)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _invariant(w: torch.Tensor, cfg: bt.GemmConfig) -> bool:
    x = torch.randn(256, w.shape[1], device="cuda", dtype=w.dtype)
    full = bt.linear(x, w, config=cfg)
    return all(torch.equal(bt.linear(x[s : s + m], w, config=cfg), full[s : s + m])
               for s, m in [(0, 1), (9, 1), (100, 37), (0, 256)])


def gemm_sweep(res: dict[str, Any]) -> dict[tuple[int, int], bt.GemmConfig]:
    picks: dict[tuple[int, int], bt.GemmConfig] = {}
    out: dict[str, Any] = {}
    for n, k in PROJECTIONS:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in M_VALUES}
        cublas = {m: _time(lambda x=xs[m], w=w: torch.nn.functional.linear(x, w)) for m in M_VALUES}
        rows = {"cublas_us": {m: t * 1e6 for m, t in cublas.items()}, "configs": []}
        best, best_cost = None, float("inf")
        for cfg in CANDIDATES + [bt.gemm_config(n, k)]:
            try:
                times = {m: _time(lambda x=xs[m], w=w, cfg=cfg: bt.linear(x, w, config=cfg))
                         for m in M_VALUES}
            except OutOfResources as e:  # more shared memory than the GPU has: skip it
                print(f"  {n}x{k} {cfg}: {type(e).__name__}", flush=True)
                continue
            cost = sum(M_WEIGHTS[m] * times[m] / cublas[m] for m in M_VALUES) / sum(M_WEIGHTS.values())
            rows["configs"].append({"config": asdict(cfg), "us": {m: t * 1e6 for m, t in times.items()},
                                    "weighted_ratio_to_cublas": cost})
            ratios = " ".join(f"M={m}:{times[m] / cublas[m]:.2f}" for m in M_VALUES)
            print(f"  N={n} K={k} {cfg}: x cuBLAS {ratios} (weighted {cost:.2f})", flush=True)
            if cost < best_cost:
                best, best_cost = cfg, cost
        assert best is not None
        invariant = _invariant(w, best)
        rows["pick"] = {"config": asdict(best), "weighted_ratio_to_cublas": best_cost,
                        "bit_invariant": invariant}
        print(f"pick N={n} K={k}: {best} (weighted x{best_cost:.2f} of cuBLAS, invariant {invariant})",
              flush=True)
        if invariant:
            picks[(n, k)] = best
        out[f"{n}x{k}"] = rows
    res["gemm"] = out
    return picks


def _engine_runs(res: dict[str, Any], parts: set[str], num_requests: int) -> None:
    reqs = workload(num_requests)
    for mode in ("default", "deterministic"):
        engine = make_engine(SHAPE, enable_deterministic_inference=mode == "deterministic")
        r: dict[str, Any] = {}
        if "bs1" in parts:
            for ctx in (128, 1024):
                r[f"bs1_decode_tok_s@{ctx}"] = bs1_decode(engine, ctx, 256)
                print(f"{mode}: bs1 decode @ {ctx}: {r[f'bs1_decode_tok_s@{ctx}']:.1f} tok/s", flush=True)
        if "throughput" in parts:
            r["throughput"] = tide_throughput(engine, reqs)
            t = r["throughput"]
            print(f"{mode}: {num_requests} requests {t['output_tok_s']:.0f} out tok/s, "
                  f"{t['total_tok_s']:.0f} total tok/s ({t['seconds']:.1f} s)", flush=True)
        res[mode] = r
        engine.shutdown()
        del engine
        gc.collect()
        empty_device_cache(reason="benchmark_teardown", ledger=None)
    d, b = res["deterministic"], res["default"]
    ratios = {}
    if "throughput" in parts:
        ratios["throughput"] = d["throughput"]["output_tok_s"] / b["throughput"]["output_tok_s"]
    for key in b:
        if key.startswith("bs1"):
            ratios[key] = d[key] / b[key]
    res["deterministic_over_default"] = ratios
    print(f"deterministic / default: {ratios}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gemm,throughput,bs1")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--no-apply", action="store_true",
                    help="keep the built-in GEMM configs for the engine runs (sweep only reports)")
    ap.add_argument("--gemm-configs", default=None,
                    help="a deterministic.json from an earlier --only gemm run: use its picks")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "torch": torch.__version__, "shape": SHAPE}

    def save() -> None:
        with open(os.path.join(args.out, "deterministic.json"), "w") as f:
            json.dump(res, f, indent=2, default=str)

    if args.gemm_configs:
        with open(args.gemm_configs) as f:
            earlier = json.load(f)["gemm"]
        for key, rows in earlier.items():
            if rows["pick"]["bit_invariant"]:
                n, k = (int(v) for v in key.split("x"))
                bt.GEMM_CONFIGS[(n, k)] = bt.GemmConfig(**rows["pick"]["config"])
    if "gemm" in parts:
        picks = gemm_sweep(res)
        if not args.no_apply:
            bt.GEMM_CONFIGS.update(picks)
        save()
    res["gemm_configs_used"] = {f"{n}x{k}": asdict(bt.gemm_config(n, k)) for n, k in PROJECTIONS}
    if parts & {"throughput", "bs1"}:
        _engine_runs(res, parts, args.num_requests)
    save()
    print(json.dumps(res.get("deterministic_over_default", {}), indent=2))


if __name__ == "__main__":
    main()
