"""Deterministic inference cost on a GPU host, Llama-3.1-8B shape (dummy weights), in one run:

    python -m benchmarks.deterministic [--only gemm,throughput,bs1] [--out DIR]

- gemm: the batch-invariant GEMM (`batch_invariant_triton.linear`) against cuBLAS (`F.linear`) at every
  projection shape of the model and M from 1 to 8192: the tile shape tide picks for that M
  (`gemm_config`, used where `tile_shapes_agree`), and the one shape per (N, K) it falls back to
  (`fixed_config`). The picked shape's rows are checked bit-equal to the M = 8192 product's.
- throughput: the standard 256-request workload (prompt and output lengths uniform in [100, 1024],
  seed 0, ignore_eos; `benchmarks.run.workload`) on a default engine and on a deterministic one.
- bs1: bs1 decode tok/s at 128 and 1024 tokens of context, default vs deterministic.

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

from benchmarks.run import bs1_decode, make_engine, tide_throughput, workload

SHAPE = "llama-3.1-8b"
# (N, K) of the model's projections: qkv, o, gate_up, down, lm_head.
PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
M_VALUES = [1, 8, 32, 64, 128, 256, 512, 2048, 8192]


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


def gemm_table(res: dict[str, Any]) -> None:
    out: dict[str, Any] = {}
    for n, k in PROJECTIONS:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(max(M_VALUES), k, device="cuda", dtype=torch.bfloat16)
        agree = bt.tile_shapes_agree(k, w.dtype, w.device)
        full = bt.linear(x, w, config=bt.gemm_config(x.shape[0], n, k))
        rows: dict[str, Any] = {"tile_shapes_agree": agree}
        for m in M_VALUES:
            xm = x[:m]
            picked, fixed = bt.gemm_config(m, n, k), bt.fixed_config(n, k)
            cublas = _time(lambda xm=xm, w=w: torch.nn.functional.linear(xm, w))
            t_pick = _time(lambda xm=xm, w=w, c=picked: bt.linear(xm, w, config=c))
            t_fixed = _time(lambda xm=xm, w=w, c=fixed: bt.linear(xm, w, config=c))
            equal = torch.equal(bt.linear(xm, w, config=picked), full[:m])
            rows[str(m)] = {"picked": asdict(picked), "cublas_us": cublas * 1e6,
                            "picked_us": t_pick * 1e6, "fixed_us": t_fixed * 1e6,
                            "rows_equal_m8192": equal}
            print(f"N={n} K={k} M={m}: cuBLAS {cublas * 1e6:.1f} us, picked "
                  f"{picked.block_m}x{picked.block_n} {t_pick / cublas:.2f}x, fixed "
                  f"{t_fixed / cublas:.2f}x, rows equal {equal}", flush=True)
        out[f"{n}x{k}"] = rows
        del w, x
        empty_device_cache(reason="benchmark_teardown", ledger=None)
    res["gemm"] = out


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
    args = ap.parse_args()
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "torch": torch.__version__, "shape": SHAPE}

    def save() -> None:
        with open(os.path.join(args.out, "deterministic.json"), "w") as f:
            json.dump(res, f, indent=2, default=str)

    if "gemm" in parts:
        gemm_table(res)
        save()
    if parts & {"throughput", "bs1"}:
        _engine_runs(res, parts, args.num_requests)
    save()
    print(json.dumps(res.get("deterministic_over_default", {}), indent=2))


if __name__ == "__main__":
    main()
