"""Distributed weight update across two GPUs of one host: `python -m benchmarks.handover_dist`.

Rank 0 (a trainer on cuda:0) broadcasts Llama-3.1-8B-shaped bf16 weights to tide on cuda:1 (rank 1)
through `update_weights_from_distributed`, per tensor and as flattened buckets; a raw NCCL broadcast of
the same bytes in one buffer is measured in the same run as the reference bandwidth.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

PORT_RAW, PORT_UPDATE = 29611, 29612


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


def trainer(barrier, result_q) -> None:
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(0)
    shapes = trainer_shapes()
    tensors = [torch.randn(s, dtype=torch.bfloat16, device="cuda") * 0.02 for _, s in shapes]
    nbytes = sum(t.numel() * 2 for t in tensors)
    raw = init_custom_process_group("nccl", "127.0.0.1", PORT_RAW, 0, 2, "raw")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    for _ in range(2):
        raw.broadcast(flat[: 1 << 20])
    barrier.wait()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        raw.broadcast(torch.zeros(1, device="cuda"))  # line up with the receiver
        torch.cuda.synchronize()
        t = time.perf_counter()
        raw.broadcast(flat)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    result_q.put(("raw", nbytes, min(times)))
    barrier.wait()  # engine joins the update group now
    group = init_custom_process_group("nccl", "127.0.0.1", PORT_UPDATE, 0, 2, "weight_update_group")
    for fmt in ("per_tensor", "per_tensor", "flattened_bucket", "flattened_bucket"):
        barrier.wait()
        if fmt == "flattened_bucket":
            group.broadcast(flat)
        else:
            for t in tensors:
                group.broadcast(t)
        torch.cuda.synchronize()
    barrier.wait()


def engine_side(barrier, result_q) -> None:
    sys.path.insert(0, os.getcwd())
    import tide
    from benchmarks.shapes import config_dir
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(1)
    engine = tide.Engine(config_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16", device="cuda:1",
                         max_total_tokens=100_000, disable_cuda_graph=True)
    raw = init_custom_process_group("nccl", "127.0.0.1", PORT_RAW, 1, 2, "raw")
    buf = torch.empty(sum(torch.Size(s).numel() for _, s in trainer_shapes()), dtype=torch.bfloat16,
                      device="cuda")
    for _ in range(2):
        raw.broadcast(buf[: 1 << 20])
    barrier.wait()
    for _ in range(3):
        raw.broadcast(torch.zeros(1, device="cuda"))
        raw.broadcast(buf)
    del buf
    barrier.wait()
    r = engine.init_weights_update_group("127.0.0.1", PORT_UPDATE, 1, 2, backend="nccl")
    assert r["success"], r
    shapes = trainer_shapes()
    names = [n for n, _ in shapes]
    for fmt in ("per_tensor", "per_tensor", "flattened_bucket", "flattened_bucket"):
        barrier.wait()
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = engine.update_weights_from_distributed(
            names, ["bfloat16"] * len(names), [list(s) for _, s in shapes],
            load_format=None if fmt == "per_tensor" else "flattened_bucket")
        torch.cuda.synchronize()
        result_q.put((fmt, r["success"], time.perf_counter() - t, r["message"]))
    barrier.wait()
    engine.shutdown()


def main() -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    q = ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(barrier, q)), ctx.Process(target=engine_side, args=(barrier, q))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=500)
    results = []
    while not q.empty():
        results.append(q.get())
    raw = next(r for r in results if r[0] == "raw")
    nbytes, raw_t = raw[1], raw[2]
    out = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "bytes": nbytes,
           "raw_broadcast_s": raw_t, "raw_GBps": nbytes / raw_t / 1e9, "updates": []}
    print(f"raw NCCL broadcast of {nbytes / 1e9:.2f} GB: {raw_t * 1e3:.1f} ms ({nbytes / raw_t / 1e9:.1f} GB/s)")
    for fmt, ok, t, msg in [r for r in results if r[0] != "raw"]:
        out["updates"].append({"format": fmt, "success": ok, "seconds": t, "GBps": nbytes / t / 1e9,
                               "ratio_to_raw": raw_t / t})
        print(f"update_weights_from_distributed {fmt}: {t * 1e3:.1f} ms ({nbytes / t / 1e9:.1f} GB/s, "
              f"{raw_t / t:.0%} of raw) success={ok}")
    os.makedirs(os.environ.get("OUT", "benchmarks/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "benchmarks/out"), "handover_dist.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
