"""Distributed weight update across two GPUs of one host: `python -m benchmarks.handover_dist`.

Rank 0 (a trainer on cuda:0) broadcasts Llama-3.1-8B-shaped bf16 weights to tide on cuda:1 (rank 1)
through `update_weights_from_distributed`. In one run: the raw NCCL broadcast of the same bytes in one
buffer (the reference), the raw per-tensor broadcasts with no engine in between, the time to join
each update group (`init_weights_update_group`, handshake and NCCL warm-up included), and per-tensor
and flattened updates, each on a group of its own so that each form's first call after joining is
measured (`first`) as well as its later calls. `--bucket-mb` is the piece size of flattened updates;
`--engine KEY=VALUE` passes engine options (`--engine enable_memory_saver=true` lays the parameters
out in one region, where a flattened update in module order lands in place).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

PORT_RAW = 29611
GROUPS = {"per_tensor": ("wu_per_tensor", 29612), "flattened_bucket": ("wu_flattened", 29613)}


def trainer_shapes() -> list[tuple[str, tuple[int, ...]]]:
    from benchmarks.shapes import LLAMA_31_8B as c

    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def trainer(barrier, result_q, calls: int, bucket_bytes: int, coalesce: int) -> None:
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(0)
    shapes = trainer_shapes()
    tensors = [torch.randn(s, dtype=torch.bfloat16, device="cuda") * 0.02 for _, s in shapes]
    named = [(n, t) for (n, _), t in zip(shapes, tensors)]
    nbytes = sum(t.numel() * 2 for t in tensors)
    raw = init_custom_process_group("nccl", "127.0.0.1", PORT_RAW, 0, 2, "raw")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    barrier.wait()
    one, per_tensor = [], []
    for _ in range(3):
        raw.broadcast(torch.zeros(1, device="cuda"))  # line up with the receiver
        one.append(_timed(lambda: raw.broadcast(flat)))
        raw.broadcast(torch.zeros(1, device="cuda"))
        per_tensor.append(_timed(lambda: [raw.broadcast(t) for t in tensors]))
    result_q.put(("raw", nbytes, min(one), min(per_tensor)))
    torch.cuda.synchronize()
    raw.close()  # its store is this process's: left open, the engine's side polls it after exit
    for fmt, (name, port) in GROUPS.items():
        barrier.wait()  # the engine joins this group now
        t = time.perf_counter()
        group = init_custom_process_group("nccl", "127.0.0.1", port, 0, 2, name,
                                          bucket_bytes=bucket_bytes, coalesce_tensors=coalesce)
        result_q.put(("trainer_join", fmt, time.perf_counter() - t))
        for _ in range(calls):
            barrier.wait()
            if fmt == "flattened_bucket":
                group.broadcast_flattened(flat)  # one dtype: the whole model in one flat buffer
            else:
                group.broadcast_weights(named)
            torch.cuda.synchronize()
    barrier.wait()


def engine_side(barrier, result_q, calls: int, options: dict) -> None:
    sys.path.insert(0, os.getcwd())
    import tide
    from tide.weights import init_custom_process_group

    from benchmarks.shapes import config_dir

    torch.cuda.set_device(1)
    engine = tide.Engine(config_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16",
                         device="cuda:1", max_total_tokens=100_000, disable_cuda_graph=True,
                         **options)
    shapes = trainer_shapes()
    raw = init_custom_process_group("nccl", "127.0.0.1", PORT_RAW, 1, 2, "raw")
    buf = torch.empty(sum(torch.Size(s).numel() for _, s in shapes), dtype=torch.bfloat16,
                      device="cuda")
    parts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for _, s in shapes]
    barrier.wait()
    for _ in range(3):
        raw.broadcast(torch.zeros(1, device="cuda"))
        raw.broadcast(buf)
        raw.broadcast(torch.zeros(1, device="cuda"))
        for p in parts:
            raw.broadcast(p)
    torch.cuda.synchronize()
    raw.close()
    del buf, parts
    names = [n for n, _ in shapes]
    for fmt, (name, port) in GROUPS.items():
        barrier.wait()
        t = time.perf_counter()
        r = engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name=name,
                                             backend="nccl")
        result_q.put(("engine_join", fmt, time.perf_counter() - t))
        if not r["success"]:
            raise RuntimeError(r["message"])
        for call in range(calls):
            barrier.wait()
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = engine.update_weights_from_distributed(
                names, ["bfloat16"] * len(names), [list(s) for _, s in shapes], group_name=name,
                load_format=None if fmt == "per_tensor" else "flattened_bucket")
            torch.cuda.synchronize()
            result_q.put(("update", fmt, call, r["success"], time.perf_counter() - t, r["message"]))
    barrier.wait()
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=4, help="updates per form (the first included)")
    ap.add_argument("--bucket-mb", type=int, default=256,
                    help="piece size of flattened updates in MiB (0: one broadcast per dtype)")
    ap.add_argument("--coalesce", type=int, default=16,
                    help="per-tensor updates in NCCL groups of this many tensors (0: one by one)")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option, e.g. enable_memory_saver=true")
    args = ap.parse_args()
    from benchmarks.run import engine_options

    options = engine_options(args.engine)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    q = ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(barrier, q, args.calls, args.bucket_mb << 20,
                                                   args.coalesce)),
             ctx.Process(target=engine_side, args=(barrier, q, args.calls, options))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=500)
    results = []
    while not q.empty():
        results.append(q.get())
    _, nbytes, raw_t, raw_per_tensor_t = next(r for r in results if r[0] == "raw")
    out = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
           "bytes": nbytes, "bucket_bytes": args.bucket_mb << 20, "coalesce_tensors": args.coalesce,
           "engine_options": options,
           "raw_broadcast_s": raw_t, "raw_GBps": nbytes / raw_t / 1e9,
           "raw_per_tensor_broadcast_s": raw_per_tensor_t, "raw_per_tensor_ratio": raw_t / raw_per_tensor_t,
           "join_s": {f"{side}:{fmt}": t for side, fmt, t in
                      [(r[0].split("_")[0], r[1], r[2]) for r in results if r[0].endswith("_join")]},
           "updates": [], "summary": {}}
    print(f"raw NCCL broadcast of {nbytes / 1e9:.2f} GB in one buffer: {raw_t * 1e3:.1f} ms "
          f"({nbytes / raw_t / 1e9:.1f} GB/s); per tensor, no engine: {raw_per_tensor_t * 1e3:.1f} ms "
          f"({raw_t / raw_per_tensor_t:.0%})")
    for key, t in out["join_s"].items():
        print(f"join {key}: {t * 1e3:.0f} ms")
    for _, fmt, call, ok, t, msg in sorted(r for r in results if r[0] == "update"):
        out["updates"].append({"format": fmt, "call": call, "first": call == 0, "success": ok,
                               "message": msg, "seconds": t, "GBps": nbytes / t / 1e9,
                               "ratio_to_raw": raw_t / t})
        print(f"update_weights_from_distributed {fmt} call {call}{' (first)' if call == 0 else ''}:"
              f" {t * 1e3:.1f} ms ({nbytes / t / 1e9:.1f} GB/s, {raw_t / t:.0%} of raw) success={ok}")
    for fmt in GROUPS:
        rows = [u for u in out["updates"] if u["format"] == fmt]
        if rows:
            later = [u["ratio_to_raw"] for u in rows if not u["first"]]
            out["summary"][fmt] = {"first_ratio": rows[0]["ratio_to_raw"],
                                   "later_ratio_median": sorted(later)[len(later) // 2] if later else None,
                                   "worst_ratio": min(u["ratio_to_raw"] for u in rows)}
    print(json.dumps(out["summary"], indent=2))
    os.makedirs(os.environ.get("OUT", "benchmarks/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "benchmarks/out"), "handover_dist.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
