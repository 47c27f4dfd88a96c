"""Tile the fp8 (W8A8) product at decode sizes on a GPU host:
`python -m benchmarks.fp8_gemm_sweep [--shapes llama-3.1-8b,qwen3-0.6b] [--rows 2,4,...] [--out DIR]`.

For each projection of each shape (qkv, o, gate_up, down) and each row count (default: the CUDA
graph batch sizes up to `fp8_triton.MAX_ROWS`), times `torch._scaled_mm` and every candidate tile
of `tide.layers.fp8_triton._w8a8_kernel`, each as a CUDA graph of products over distinct weights
(at least 400 MB of them, so nothing is served from L2). A tile counts only if its largest error
against the exact formula is within twice `_scaled_mm`'s. Writes fp8_gemm_sweep.json: per case the
`_scaled_mm` time, the picked config (`gemm_config`), and every tile's time, from which
`fp8_triton._TUNED` was read (fastest tile per row count, kept over a range while within 3%).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from tide.layers import fp8, fp8_triton

from benchmarks.shapes import SHAPES
from benchmarks.timing import capture, replay_seconds

DEFAULT_ROWS = [2, 4, 8, 12, 16, 24] + list(range(32, fp8_triton.MAX_ROWS + 1, 16))


def candidates(m: int, n: int, k: int) -> list[fp8_triton.GemmConfig]:
    """Tiles worth timing at m rows: swapped (weight rows on the 64- or 128-row side, a token tile
    no larger than m needs) or not (token rows there, 32+ output columns), BLOCK_K 128 or 256, as
    many stages as fit 200 KB of shared memory (4, else 3; tiles that fit neither are left out)."""
    rows_p2 = max(16, triton.next_power_of_2(m))
    out = []
    for swap in (1, 0):
        for block_r in (64, 128):
            for block_q in (16, 32, 64, 128, 256):
                if swap and block_q > rows_p2:
                    continue
                if not swap and (block_q < 32 or block_r > max(64, rows_p2)):
                    continue
                tiles = (triton.cdiv(n, block_r) * triton.cdiv(m, block_q) if swap
                         else triton.cdiv(m, block_r) * triton.cdiv(n, block_q))
                if tiles > 1200:
                    continue
                for block_k in (128, 256):
                    stage_bytes = (block_r + block_q) * block_k
                    if stage_bytes * 3 > 200_000:
                        continue
                    stages = 4 if stage_bytes * 4 <= 200_000 else 3
                    out.append((swap, block_r, block_q, block_k, 4 if block_r == 64 else 8, stages))
    return out


def run_tile(xq, xs, wq, ws, out, config: fp8_triton.GemmConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = wq.shape[0]
    swap, block_r, block_q, block_k, warps, stages = config
    x_rows, w_rows = (block_q, block_r) if swap else (block_r, block_q)
    tiles = (triton.cdiv(n, block_r) * triton.cdiv(m, block_q) if swap
             else triton.cdiv(m, block_r) * triton.cdiv(n, block_q))
    fp8_triton._w8a8_kernel[(tiles,)](
        TensorDescriptor(xq, [m, k], [k, 1], [x_rows, block_k]),
        TensorDescriptor(wq, [n, k], [k, 1], [w_rows, block_k]),
        xs, ws, out, out, m, n, k, out.stride(0), BLOCK_R=block_r, BLOCK_Q=block_q,
        BLOCK_K=block_k, SWAP=bool(swap), HAS_BIAS=False, num_warps=warps, num_stages=stages)


def per_product_us(fns: list) -> float:
    return replay_seconds(capture(lambda: [f() for f in fns]), reps=5) * 1e6 / len(fns)


def sweep_projection(n: int, k: int, rows: list[int]) -> list[dict]:
    copies = max(2, min(16, int(400e6 // (n * k))))
    torch.manual_seed(0)
    weights = []
    for _ in range(copies):
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        weights.append((wq, ws.t().contiguous()))
    results = []
    for m in rows:
        xq, xs = fp8.quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        exact = (xq.double() @ weights[0][0].double().t()) * xs.double() * weights[0][1].double()
        scale = exact.abs().max().item()

        def error(y: torch.Tensor) -> float:
            return (y.double() - exact).abs().max().item() / scale

        cublas_err = error(torch._scaled_mm(xq, weights[0][0].t(), scale_a=xs,
                                            scale_b=weights[0][1], out_dtype=torch.bfloat16))
        cublas_us = per_product_us([
            lambda i=i: torch._scaled_mm(xq, weights[i][0].t(), scale_a=xs, scale_b=weights[i][1],
                                         out_dtype=torch.bfloat16, out=outs[i])
            for i in range(copies)])
        tiles = []
        for config in candidates(m, n, k):
            run_tile(xq, xs, weights[0][0], weights[0][1], outs[0], config)
            err = error(outs[0])
            if err > max(2 * cublas_err, 2e-3):
                continue
            us = per_product_us([lambda i=i: run_tile(xq, xs, weights[i][0], weights[i][1],
                                                      outs[i], config) for i in range(copies)])
            tiles.append({"config": list(config), "us": round(us, 2), "err": err})
        tiles.sort(key=lambda t: t["us"])
        picked = fp8_triton.gemm_config(m, n, k)
        picked_us = next((t["us"] for t in tiles if tuple(t["config"]) == picked), None)
        results.append({"N": n, "K": k, "M": m, "scaled_mm_us": round(cublas_us, 2),
                        "scaled_mm_err": cublas_err, "picked": picked, "picked_us": picked_us,
                        "weight_bytes_us_at_3TBps": round(n * k / 3e6, 2), "tiles": tiles})
        best = tiles[0] if tiles else None
        print(f"N={n:6d} K={k:6d} M={m:4d}  _scaled_mm {cublas_us:7.2f} us  picked "
              f"{picked} {picked_us}  best {best and best['config']} {best and best['us']}",
              flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.1-8b,qwen3-0.6b")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)))
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        for name, (n, k) in {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h),
                             "down": (h, inter)}.items():
            for r in sweep_projection(n, k, rows):
                results.append({"shape": shape, "projection": name, **r})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
