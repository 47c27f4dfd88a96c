"""Tune split-KV decode attention on a GPU host: `python -m benchmarks.decode_attn_sweep [--shape S]`.

bs1, 8 layers of distinct KV at 1k, 8k and 32k context (`--contexts`): times stage 1 + stage 2 in a CUDA
graph for each (max splits, tokens per block, warps, stages, shortest split) and prints the six fastest
per context next to the config the engine uses now, with microseconds per layer, the KV bytes read as a
fraction of copy bandwidth, and the largest output difference from the first config (all configs compute
the same attention). Shapes: `llama` (Llama-3.1-8B: 32 q heads, 8 kv heads, head dim 128, full
attention), `gemma3` (Gemma-3-12B: 16 q heads, 8 kv heads, head dim 256, full attention as its global
layers) and `gemma3-local` (the same heads over a 1024-token window, as its sliding layers).
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.run import measure_copy_bandwidth
from benchmarks.timing import replay_seconds
from tide.layers.attention import split_kv
from tide.layers.attention import triton_kernels as tk

LAYERS = 8
SHAPES = {"llama": (32, 8, 128, 0), "gemma3": (16, 8, 256, 0), "gemma3-local": (16, 8, 256, 1024)}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--current-only", action="store_true", help="time only the engine's config")
    ap.add_argument("--splits", default="64,128,256", help="max split counts tried")
    ap.add_argument("--blocks", default="16,32,64,128", help="keys a block tried")
    ap.add_argument("--warps", default="4,8", help="warps a program tried")
    ap.add_argument("--stages", default="2,3",
                    help="pipeline depths tried (sm_90, Triton 3.6: stage 1 holds one key/value "
                         "buffer at 3 and 4 stages, two at 5, three at 6)")
    args = ap.parse_args()
    HQ, HK, D, window = SHAPES[args.shape]
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    for ctx in (int(c) for c in args.contexts.split(",")):
        size = ctx + 16
        ks = [torch.randn(size, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        vs = [torch.randn(size, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        table = torch.arange(size, device="cuda", dtype=torch.int32).view(1, size)
        req = torch.zeros(1, dtype=torch.int64, device="cuda")
        seq = torch.full((1,), ctx, dtype=torch.int64, device="cuda")
        kv_bytes = LAYERS * min(ctx, window or ctx) * HK * D * 2 * 2
        res: dict[tuple[int, ...], tuple[float, float, float]] = {}
        ref = None
        splits = tk.num_kv_splits(HK, 128)
        now = (splits, *tk.decode_block_config(splits, D))
        now = (now[0], now[1], 4, now[2], tk.MIN_SPLIT_LEN)
        configs = [now] if args.current_only else itertools.product(
            *(tuple(int(n) for n in a.split(",")) for a in (args.splits, args.blocks, args.warps,
                                                             args.stages)), (16, 32, 64))
        for splits, block_n, warps, stages, min_len in configs:
            if ctx <= 2048 and splits != 128:
                continue  # short contexts: the shortest split, not the count, sets the launch
            if block_n > max(min_len, ctx // splits):
                continue  # no split is that long
            if min_len < tk.MIN_SPLIT_LEN and ctx // splits >= tk.MIN_SPLIT_LEN:
                continue  # the shortest split does not bind: the same launch as min_len 64
            mid_o = torch.empty(1, HQ, splits, D, device="cuda")
            mid_l = torch.empty(1, HQ, splits, device="cuda")

            def run() -> None:
                for k, v in zip(ks, vs):
                    tk._decode_stage1[(HK, 1, splits)](
                        q, k, v, table, req, seq, mid_o, mid_l, out, q.stride(0), q.stride(1),
                        k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0),
                        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_l.stride(0),
                        mid_l.stride(1), out.stride(0), out.stride(1), D**-0.5, window, 1.0,
                        GROUP=HQ // HK, BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=D,
                        HEAD_DIM=D, NUM_SPLITS=splits, MIN_SPLIT_LEN=min_len, SLIDING=window > 0,
                        SOFT_CAP=False, DOT_PRECISION="tf32", USE_PDL=True,
                        PREFETCH=D > split_kv.PREFETCH_MAX_SMALL_HEAD_DIM, V_PAIRS=False, ASM=True,
                        num_warps=warps,
                        num_stages=stages, launch_pdl=True)
                    tk._decode_stage2[(1, HQ, D // tk.stage2_columns(D))](
                        mid_o, mid_l, out, seq, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                        mid_l.stride(0), mid_l.stride(1), out.stride(0), out.stride(1), window,
                        BLOCK_D=tk.stage2_columns(D), HEAD_DIM=D, NUM_SPLITS=splits,
                        MIN_SPLIT_LEN=min_len, SLIDING=window > 0, USE_PDL=True, num_warps=4,
                        launch_pdl=True)

            try:
                run()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            except Exception as e:  # noqa: BLE001 - a config may not fit shared memory
                print(f"   {(splits, block_n, warps, stages, min_len)}: {type(e).__name__}", flush=True)
                continue
            t = replay_seconds(graph, reps=20)
            if ref is None:
                ref = out.clone()
            err = (out.float() - ref.float()).abs().max().item()
            res[(splits, block_n, warps, stages, min_len)] = (t / LAYERS * 1e6, kv_bytes / t / bw, err)
        print(f"{ctx}: current config {now}: {res[now][0] if now in res else float('nan'):.2f} "
              "us/layer", flush=True)
        for cfg, (us, frac, err) in sorted(res.items(), key=lambda kv: kv[1][0])[:6]:
            print(f"   {cfg}: {us:.2f} us/layer, {frac:.3f} of copy bw, max diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
