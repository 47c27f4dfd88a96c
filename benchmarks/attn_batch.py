"""Tune the Triton attention kernels at large batch: `python -m benchmarks.attn_batch`.

Decode: 64 and 256 requests with contexts uniform in [100, 1600] (each request's KV in one
contiguous run of pool slots, runs in random order), Qwen3-0.6B (16/8 heads) and Llama-3.1-8B (32/8)
head shapes; times stage 1 + stage 2 in a CUDA graph for each (splits, tokens per block, warps,
stages) and prints the fastest next to the current default, as a fraction of copy bandwidth (KV bytes
read / time). Extend (`extend_sweep`): an 8k-token prefill chunk of prompts uniform in [100, 1024],
one 8k prompt, 4k new tokens on a 4k prefix and one 32k prompt, tide's kernel (default and other
tiles) against torch's varlen flash attention on the same K/V laid out contiguously, in TFLOP/s of
causal attention; `--out FILE` writes those cases as JSON.
`--kv-dtype fp8` sweeps decode over an fp8 (e4m3) pool (`kv_cache_dtype="fp8_e4m3"`); `--only decode`
skips the extend sweep. `--maxnreg 168,128` also tries those register caps (a config's fifth field):
compiled for sm_90, the fp8 stage 1 at 128-key blocks takes 255 registers a thread, so two programs of
4 warps fit an SM where the bf16 one (168) fits three; capped at 168 it does not spill (Triton 3.6;
no default config is capped now, see `DecodeBlocks`). `--v-pairs 0,1`
also reads fp8 values as int16 words (the sixth field, `DecodeBlocks.v_pairs`).
"""

from __future__ import annotations

import itertools
import random

import torch
from tide.layers.attention import split_kv
from tide.layers.attention import triton_kernels as tk

from benchmarks.run import measure_copy_bandwidth
from benchmarks.timing import capture, replay_seconds

D = 128


def _pool(lens: list[int], hk: int, seed: int, d: int = D, dtype: torch.dtype = torch.bfloat16):
    total = sum(lens) + 1
    k = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16).to(dtype)
    v = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16).to(dtype)
    order = list(range(len(lens)))
    random.Random(seed).shuffle(order)
    starts = [0] * len(lens)
    pos = 1
    for i in order:
        starts[i] = pos
        pos += lens[i]
    width = max(lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, (s, n) in enumerate(zip(starts, lens)):
        table[i, :n] = torch.arange(s, s + n, dtype=torch.int32)
    return k, v, table.cuda()


def decode_sweep(bw: float, kv_dtype: torch.dtype = torch.bfloat16,
                 maxnregs: tuple[int, ...] = (), split_counts: tuple[int, ...] = (1, 2, 4),
                 stage_counts: tuple[int, ...] = (2, 3),
                 block_counts: tuple[int, ...] | None = None,
                 warp_counts: tuple[int, ...] = (4, 8),
                 cases: tuple[tuple[int, int, int, int], ...] | None = None,
                 v_pairs: tuple[bool, ...] = (False,),
                 ctx: tuple[int, int] = (100, 1600),
                 ) -> dict[tuple[int, int, int, int], dict[tuple, tuple[float, float, float]]]:
    """`maxnregs`: register caps (Triton's `maxnreg`) tried beside the compiler's own choice, at
    blocks of 64 or more keys: a cap of 168 fits 3 programs of 4 warps on an SM, 128 fits 2 of 8.
    `split_counts`, `stage_counts`, `block_counts`, `warp_counts`: the splits, pipeline depths, keys
    a block and warps tried; `v_pairs`: fp8 values read as bytes (False) and/or as int16 words
    (True, `DecodeBlocks.v_pairs`); `cases`: (query heads, kv heads, head dim, batch) shapes
    (default: all); contexts are uniform in `ctx`. Returns each case's {(splits, keys a block,
    warps, stages, register cap, v_pairs): (us, fraction of copy bandwidth, max difference)}."""
    everything = {}
    cases = cases or [(16, 8, 128, 64), (16, 8, 128, 256), (32, 8, 128, 64), (32, 8, 128, 256),
             (16, 8, 256, 64), (16, 8, 256, 256)]
    for hq, hk, d, batch in cases:
        rng = random.Random(batch)
        lens = [rng.randint(*ctx) for _ in range(batch)]
        k, v, table = _pool(lens, hk, batch, d, kv_dtype)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        req = torch.arange(batch, device="cuda", dtype=torch.int64)
        seq = torch.tensor(lens, device="cuda", dtype=torch.int64)
        kv_bytes = sum(lens) * hk * d * 2 * k.element_size()
        res = {}
        ref = None
        blocks = block_counts or ((32, 64, 128) if k.element_size() > 1 else (32, 64, 128, 256))
        pairs = v_pairs if k.element_size() == 1 else (False,)
        configs = list(itertools.product(split_counts, blocks, warp_counts, stage_counts, (None,),
                                         pairs))
        configs += [c for c in itertools.product(split_counts, blocks, warp_counts, stage_counts,
                                                 maxnregs, pairs) if c[1] >= 64]
        for splits, block_n, warps, stages, maxnreg, pair in configs:
            vv = v.view(torch.int16) if pair else v
            mid_o = torch.empty(batch, hq, splits, d, device="cuda")
            mid_l = torch.empty(batch, hq, splits, device="cuda")

            def run() -> None:
                tk._decode_stage1[(hk, batch, splits)](
                    q, k, vv, table, req, seq, mid_o, mid_l, out, q.stride(0), q.stride(1),
                    k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), table.stride(0),
                    mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_l.stride(0),
                    mid_l.stride(1), out.stride(0), out.stride(1), d**-0.5, 0, 1.0,
                    GROUP=hq // hk, BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=d, HEAD_DIM=d,
                    NUM_SPLITS=splits, MIN_SPLIT_LEN=tk.MIN_SPLIT_LEN, SLIDING=False,
                    SOFT_CAP=False, DOT_PRECISION="tf32", USE_PDL=False, PREFETCH=False,
                    V_PAIRS=pair, ASM=True, num_warps=warps,
                    num_stages=stages, **({} if maxnreg is None else {"maxnreg": maxnreg}))
                if splits == 1:
                    return  # stage 1 wrote the output
                tk._decode_stage2[(batch, hq, d // tk.stage2_columns(d))](
                    mid_o, mid_l, out, seq, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                    mid_l.stride(0), mid_l.stride(1), out.stride(0), out.stride(1), 0,
                    BLOCK_D=tk.stage2_columns(d), HEAD_DIM=d, NUM_SPLITS=splits,
                    MIN_SPLIT_LEN=tk.MIN_SPLIT_LEN, SLIDING=False, USE_PDL=False, num_warps=4)

            try:
                t = replay_seconds(capture(run), reps=20, warmup=2)
            except Exception as e:  # noqa: BLE001 - a config may not fit shared memory
                print(f"   {(splits, block_n, warps, stages, maxnreg, pair)}: "
                      f"{type(e).__name__}", flush=True)
                continue
            if ref is None:
                ref = out.clone()
            err = (out.float() - ref.float()).abs().max().item()
            res[(splits, block_n, warps, stages, maxnreg, pair)] = (
                t * 1e6, kv_bytes / t / bw, err)
        splits = tk.num_kv_splits(batch * hk, 128)
        cfg = tk.decode_block_config(splits, d, k.element_size(), hq // hk)
        default = (splits, cfg.block_n, cfg.warps, cfg.stages, None, cfg.v_pairs)
        if default not in res:
            res[default] = (float("nan"), float("nan"), 0.0)
        print(f"decode hq={hq} hk={hk} d={d} batch={batch} mean ctx {sum(lens) / batch:.0f}: default "
              f"{default}: {res[default][0]:.1f} us ({res[default][1]:.3f} of copy bw)", flush=True)
        for cfg, (us, frac, err) in sorted(res.items(), key=lambda kv: kv[1][0])[:5]:
            print(f"   {cfg}: {us:.1f} us, {frac:.3f} of copy bw, max diff {err:.1e}", flush=True)
        everything[(hq, hk, d, batch)] = res
    return everything


def _varlen_causal() -> dict[str, object]:
    """Keywords that make torch's `varlen_attn` causal, by its signature (torch 2.11 takes
    `window_size`, (-1, 0) being causal; some versions take `is_causal`). It takes GQA K/V as
    they are."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


def extend_case(name: str, lens: list[int], prefixes: list[int], hq: int, hk: int,
                kv_dtype: torch.dtype, tiles: list[tuple[int, int, int, int]], d: int = D) -> dict:
    """Causal attention of each request's new tokens (lens[i] - prefixes[i] of them) over its
    prefix and themselves: tide's `extend_attention` (default tiles), the same kernel with each of
    `tiles` (block_m, block_n, warps, stages), and torch's varlen flash attention on the same K/V
    laid out contiguously (bf16 only). TFLOP/s count the causal products only."""
    from torch.nn.attention.varlen import varlen_attn

    ext = [n - p for n, p in zip(lens, prefixes)]
    k, v, table = _pool(lens, hk, 0, d, dtype=kv_dtype)
    q = torch.randn(sum(ext), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    req = torch.arange(len(lens), device="cuda", dtype=torch.int64)
    prefix = torch.tensor(prefixes, device="cuda", dtype=torch.int64)
    ext_t = torch.tensor(ext, device="cuda", dtype=torch.int64)
    starts = torch.tensor([0] + list(itertools.accumulate(ext))[:-1], device="cuda",
                          dtype=torch.int64)
    flops = sum(4 * hq * d * (e * p + e * (e + 1) / 2) for e, p in zip(ext, prefixes))
    res: dict = {"case": name, "hq": hq, "hk": hk, "d": d, "kv_dtype": str(kv_dtype),
                 "tokens": sum(ext), "requests": len(lens),
                 "default": tuple(tk.extend_block_config(d, k.element_size()))}

    def ours() -> None:
        tk.extend_attention(q, k, v, out, table, req, prefix, ext_t, starts, max(ext), d**-0.5)

    t = replay_seconds(capture(ours), reps=10, warmup=2)
    res["tide_us"], res["tide_tflops"] = t * 1e6, flops / t / 1e12
    ours()
    mine = out.clone()
    if kv_dtype == torch.bfloat16:
        flat = torch.cat([table[i, :n] for i, n in enumerate(lens)]).long()
        kc, vc = k[flat].contiguous(), v[flat].contiguous()
        cu_q = torch.tensor([0] + list(itertools.accumulate(ext)), device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
        kw = _varlen_causal()

        def flash() -> torch.Tensor:
            return varlen_attn(q, kc, vc, cu_q, cu_k, max(ext), max(lens), **kw)

        try:
            t = replay_seconds(capture(flash), reps=10, warmup=2)
            res["flash_us"], res["flash_tflops"] = t * 1e6, flops / t / 1e12
            res["max_diff_vs_flash"] = (mine.float() - flash().float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            res["flash_error"] = f"{type(e).__name__}: {e}"[:300]
    res["tiles"] = {}
    for tile in tiles:
        cfg = split_kv.ExtendBlocks(*tile)
        tk_config = tk.extend_block_config
        tk.extend_block_config = lambda *a, c=cfg, **kw: c  # type: ignore[misc]
        try:
            t = replay_seconds(capture(ours), reps=10, warmup=2)
            res["tiles"][str(tile)] = t * 1e6
            out.zero_()
            ours()
            res.setdefault("tile_max_diff_vs_default", {})[str(tile)] = (
                (out.float() - mine.float()).abs().max().item())
        except Exception as e:  # noqa: BLE001 - a tile may not fit shared memory
            res["tiles"][str(tile)] = f"{type(e).__name__}"
        finally:
            tk.extend_block_config = tk_config
    flash_txt = (f"flash {res['flash_us']:.0f} us ({res['flash_tflops']:.0f} TFLOP/s), "
                 f"max diff {res['max_diff_vs_flash']:.1e}" if "flash_us" in res
                 else res.get("flash_error", "flash: bf16 only"))
    print(f"extend {name} hq={hq} hk={hk} d={d} {kv_dtype}: tide {res['default']} {res['tide_us']:.0f} us "
          f"({res['tide_tflops']:.0f} TFLOP/s); {flash_txt}", flush=True)
    for tile, us in sorted(res["tiles"].items(), key=lambda kv: kv[1] if isinstance(kv[1], float)
                           else 1e12):
        diff = res.get("tile_max_diff_vs_default", {}).get(tile)
        print(f"   {tile}: " + (f"{us:.0f} us, {flops / us / 1e6:.0f} TFLOP/s, max diff {diff:.1e}"
                                if isinstance(us, float) else us), flush=True)
    return res


def extend_sweep(kv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Prefill attention: an 8k-token chunk of prompts uniform in [100, 1024] (Qwen3 and Llama
    heads), one 8k prompt, 4k new tokens on a 4k prefix, one 32k prompt."""
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < 8192:
        lens.append(rng.randint(100, 1024))
    lens[-1] -= sum(lens) - 8192
    tiles = [(64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
             (128, 32, 4, 2), (128, 64, 4, 3)]
    cases = [("chunk8k", lens, [0] * len(lens), 16, 8), ("chunk8k", lens, [0] * len(lens), 32, 8),
             ("one8k", [8192], [0], 32, 8), ("prefix4k+4k", [8192], [4096], 32, 8),
             ("one32k", [32768], [0], 32, 8)]
    return [extend_case(name, ln, pf, hq, hk, kv_dtype, tiles) for name, ln, pf, hq, hk in cases]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--only", choices=["decode", "extend"], default=None)
    ap.add_argument("--maxnreg", default="",
                    help="comma-separated register caps also tried in the decode sweep, e.g. 168,128")
    ap.add_argument("--splits", default="1,2,4", help="split counts tried in the decode sweep")
    ap.add_argument("--stages", default="2,3",
                    help="pipeline depths tried in the decode sweep (one key/value buffer at 3 and "
                         "4 stages, two at 5)")
    ap.add_argument("--v-pairs", default="0", help="fp8 values as bytes (0) and/or int16 words (1)")
    ap.add_argument("--out", default="", help="a JSON file for the extend cases")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    if args.only != "decode":
        found = extend_sweep(kv_dtype)
        if args.out:
            import json

            with open(args.out, "w") as f:
                json.dump(found, f, indent=1)
    if args.only != "extend":
        decode_sweep(bw, kv_dtype,
                     tuple(int(r) for r in args.maxnreg.split(",") if r),
                     tuple(int(n) for n in args.splits.split(",")),
                     tuple(int(n) for n in args.stages.split(",")),
                     v_pairs=tuple(bool(int(n)) for n in args.v_pairs.split(",")))


if __name__ == "__main__":
    main()
