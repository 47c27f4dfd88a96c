"""Tune and check the bs1 GEMV kernel on a GPU host: `python -m benchmarks.gemv_sweep [--out DIR]`.

For each projection shape of `--shape` (default llama-3.1-8b), times a CUDA graph of back-to-back
one-row products over distinct weights (32 layers' worth, so nothing is served from L2) for cuBLAS (`F.linear`) and for each
Triton config, as bytes streamed per second against the copy bandwidth measured in the same run; then a
32-layer stack (norms and SiLU-mul between the products) with cuBLAS and with the kernel's default
configs (`tide.layers.gemv.config_for`). Writes gemv_sweep.json. `--tp-size N`: one rank's shapes
under tensor parallelism (qkv, gate_up and lm_head rows split N ways; o and down columns).
`--fp8`: the projections' weights in fp8 with row scales (`quantization="fp8"`; the lm_head stays
bf16 there, but is swept in fp8 too), against `torch._scaled_mm` of the row quantized to fp8 in
place of cuBLAS; no stack.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.run import measure_copy_bandwidth
from benchmarks.shapes import SHAPES
from benchmarks.timing import capture, replay_seconds
from tide.layers import fp8
from tide.layers import gemv as G
from tide.layers import triton_ops



def projections(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, copies timed back to back) of one layer's products and the lm_head."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h, 32), "o": (h, q, 32), "gate_up": (2 * inter, h, 32),
            "down": (h, inter, 32), "lm_head": (cfg["vocab_size"], h, 4)}
CONFIGS = [(bn, bk, w) for bn in (1, 2, 4) for bk in (512, 1024, 2048, 4096) for w in (2, 4, 8)
           if bn * bk <= 8192]


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of `fn` captured once in a CUDA graph."""
    return replay_seconds(capture(fn), reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--tp-size", type=int, default=1, help="one rank's shapes at this TP size")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--fp8", action="store_true", help="fp8 weights with row scales")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    tp = args.tp_size
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    res: dict = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "copy_bandwidth_TBps": bw / 1e12, "tp_size": tp, "shape": args.shape, "shapes": {},
                 "fp8": args.fp8}
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    dt = torch.bfloat16
    for name, (n, k, layers) in projections(shape).items():
        n, k = (n, k // tp) if name in ("o", "down") else (n // tp, k)
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device="cuda", dtype=dt)
        outs = [torch.empty(1, n, device="cuda", dtype=dt) for _ in range(layers)]
        scales: list = [None] * layers
        if args.fp8:
            quantized = [fp8.quantize_rows(w) for w in ws]
            ws = [q for q, _ in quantized]
            scales = [s.t().contiguous() for _, s in quantized]
            xq, xs = fp8.quantize_rows(x)
            nbytes = layers * n * k
            cublas = nbytes / graph_time(lambda: [
                fp8.scaled_product(xq, xs, w, s, dt) for w, s in zip(ws, scales)]) / bw
        else:
            nbytes = layers * n * k * 2
            cublas = nbytes / graph_time(lambda: [F.linear(x, w) for w in ws]) / bw
        rows = {}
        for cfg in CONFIGS + [G.config_for(k, fp8=args.fp8)]:
            if cfg[1] <= triton.next_power_of_2(k):  # uneven K: the last tile is masked
                rows[str(cfg)] = nbytes / graph_time(lambda: [
                    G.gemv(x, w, out=o, config=cfg, scale=s)
                    for w, o, s in zip(ws, outs, scales)]) / bw
        default = str(G.config_for(k, fp8=args.fp8))
        if args.fp8:
            ref = (x.double() @ ws[0].double().t() * scales[0].double()).float()
        else:
            ref = F.linear(x, ws[0]).float()
        err = (G.gemv(x, ws[0], scale=scales[0]).float() - ref).abs().max().item()
        res["shapes"][name] = {"N": n, "K": k, "cublas": cublas, "default_config": default,
                               "default": rows[default], "max_abs_err_vs_cublas": err, "configs": rows}
        top = sorted(rows.items(), key=lambda kv: -kv[1])[:3]
        print(f"{name} N={n} K={k}: cuBLAS {cublas:.3f} of copy bw; default {default} {rows[default]:.3f}; "
              f"top " + ", ".join(f"{c} {v:.3f}" for c, v in top) + f"; max err {err:.1e}", flush=True)
        del ws, outs
    if args.fp8:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    H, I, eps, layers = shape["hidden_size"], shape["intermediate_size"], 1e-5, 32
    qkv_rows, o_cols = projections(shape)["qkv"][0], projections(shape)["o"][1]
    nw = torch.rand(H, device="cuda", dtype=dt) + 0.5
    delta = torch.randn(1, H, device="cuda", dtype=dt)
    resid = torch.randn(1, H, device="cuda", dtype=dt)
    Q, O, Ir = qkv_rows // tp, o_cols // tp, I // tp  # this rank's qkv rows, o columns, MLP width
    wq = [torch.randn(Q, H, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
    wo = [torch.randn(H, O, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
    wg = [torch.randn(2 * Ir, H, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
    wd = [torch.randn(H, Ir, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
    stack_bytes = layers * 2 * (Q * H + H * O + 2 * Ir * H + H * Ir)

    def stack(lin):
        def run():
            h, r = delta, resid
            for i in range(layers):
                a, r = triton_ops.rmsnorm(h, nw, eps, r)
                o = lin(lin(a, wq[i])[:, :O].contiguous(), wo[i])
                a, r = triton_ops.rmsnorm(o, nw, eps, r)
                h = lin(triton_ops.silu_and_mul(lin(a, wg[i])), wd[i])
        return run

    times = {"cublas": graph_time(stack(F.linear)), "triton": graph_time(stack(G.gemv))}
    res["stack"] = {k: {"ms": t * 1e3, "frac": stack_bytes / t / bw} for k, t in times.items()}
    print("32-layer stack with norms and SiLU-mul: " + ", ".join(
        f"{k} {t * 1e3:.3f} ms ({stack_bytes / t / bw:.3f} of copy bw)" for k, t in times.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
