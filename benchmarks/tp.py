"""Tensor parallel on the GPUs of one host: `python -m benchmarks.tp [--only ...]` (dummy weights).

Parts (`--only`, comma separated; default decode,throughput,tensor,70b):
- decode: bs1 decode tok/s of the Llama-3.1-8B shape at TP=1 and TP=2, each against its weight-read
  roofline (bytes of one rank's weights / the device copy bandwidth measured in this run).
- throughput: the standard 256-request offline workload (benchmarks.run.workload) at TP=1 and TP=2.
- tensor: `update_weights_from_tensor` of the full 8B bf16 weights (on cuda:0) at TP=2 (rank 0 holds
  them, broadcasts them over the rank group, each rank keeps its part), against a raw NCCL broadcast
  of the same bytes over the same group in the same run (the NCCL broadcast limit).
- distributed: `update_weights_from_distributed` at TP=2 from a trainer process on a third GPU
  (`--trainer-gpu`, default 2: NCCL needs one GPU per rank of the trainer group), against a raw
  broadcast of the same bytes in the same 3-rank group. Needs 3 GPUs.
- allreduce: the sum a decode step needs ([bs, hidden] bf16), 64 of them in one CUDA graph per
  rank, NCCL's all-reduce against the one-shot kernel (`tide.layers.one_shot`), and at hidden 4096
  the fused sum + residual + RMSNorm of its row channel: µs per sum.
- 70b: bs1 decode of the Llama-3.1-70B shape at TP=2 (141 GB of weights: not one GPU's worth)
  against the two-GPU weight-read roofline.

Writes `$OUT/tp.json` (default benchmarks/out) and prints one line per figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch
from tide.memory import empty_device_cache

from benchmarks.run import bs1_decode, measure_copy_bandwidth, param_bytes, tide_throughput, workload
from benchmarks.shapes import config_dir

SHAPE_8B, SHAPE_70B = "llama-3.1-8b", "llama-3.1-70b"
PORT = 29631


def make_engine(shape: str, tp_size: int, **kw: Any):
    import tide

    return tide.Engine(config_dir(shape), load_format="dummy", dtype="bfloat16", tp_size=tp_size,
                       **kw)


def close(engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    empty_device_cache(reason="benchmark_teardown", ledger=None)


def decode(res: dict, bw: float, shape: str, tp_sizes: tuple[int, ...]) -> None:
    for tp in tp_sizes:
        engine = make_engine(shape, tp)
        nbytes = param_bytes(engine)  # one rank's weights: every rank reads its own in parallel
        tps = bs1_decode(engine, 128, 256)
        roof = bw / nbytes
        res.setdefault("decode", {}).setdefault(shape, {})[f"tp{tp}"] = {
            "tok_s": tps, "roofline_tok_s": roof, "ratio": tps / roof, "rank_param_bytes": nbytes}
        print(f"bs1 decode {shape} TP={tp}: {tps:.1f} tok/s, roofline {roof:.1f} "
              f"({tps / roof:.1%})", flush=True)
        close(engine)
    runs = res["decode"][shape]
    if "tp1" in runs and "tp2" in runs:
        runs["speedup_tp2"] = runs["tp2"]["tok_s"] / runs["tp1"]["tok_s"]
        print(f"bs1 decode {shape}: TP=2 / TP=1 = {runs['speedup_tp2']:.2f}x", flush=True)


def throughput(res: dict, num_requests: int) -> None:
    reqs = workload(num_requests)
    for tp in (1, 2):
        engine = make_engine(SHAPE_8B, tp)
        r = tide_throughput(engine, reqs)
        res.setdefault("throughput", {})[f"tp{tp}"] = r
        print(f"offline throughput {SHAPE_8B} TP={tp}: {r['output_tok_s']:.0f} out tok/s "
              f"({r['seconds']:.1f} s)", flush=True)
        close(engine)


def dummy_named(device: str) -> list[tuple[str, torch.Tensor]]:
    """The model's checkpoint names at their full (unsharded) shapes, random bf16 on `device`."""
    from benchmarks.handover_dist import trainer_shapes

    return [(n, torch.empty(s, dtype=torch.bfloat16, device=device).uniform_(-0.02, 0.02))
            for n, s in trainer_shapes()]


def tensor_update(res: dict) -> None:
    engine = make_engine(SHAPE_8B, 2, mem_fraction_static=0.5, disable_cuda_graph=True)
    group = engine.worker
    named = dummy_named("cuda:0")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.cat([t.reshape(-1) for _, t in named])

    def raw(flat: torch.Tensor) -> float:
        # The same bytes over the same rank group, in one broadcast: the NCCL limit.
        group.runtime.outbox = [("flat", flat)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        group.call("receive_tensors", -1, [("flat", tuple(flat.shape), flat.dtype)])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        group.call("discard", -1)
        return dt

    raw(flat)
    raw_s = min(raw(flat) for _ in range(3))
    del flat
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = engine.update_weights_from_tensor(named_tensors=named)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        assert r["success"], r["message"]
    best = min(times)
    res["tensor"] = {"bytes": nbytes, "raw_broadcast_s": raw_s, "update_s": best,
                     "update_GBps": nbytes / best / 1e9, "raw_GBps": nbytes / raw_s / 1e9,
                     "ratio_to_raw": raw_s / best}
    print(f"update_weights_from_tensor TP=2 ({nbytes / 1e9:.1f} GB): {best * 1e3:.0f} ms "
          f"({nbytes / best / 1e9:.1f} GB/s); raw NCCL broadcast {raw_s * 1e3:.0f} ms "
          f"({nbytes / raw_s / 1e9:.1f} GB/s): {raw_s / best:.0%} of the limit", flush=True)
    del named
    close(engine)


def _all_reduce_rank(rank: int, port: int, queue) -> None:
    """One of two ranks: µs per all-reduce in a replayed graph of 64, NCCL vs one-shot."""
    sys.path.insert(0, os.getcwd())
    from tide.layers.one_shot import OneShotAllReduce
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_custom_process_group("nccl", "127.0.0.1", port, rank, 2, "ar-bench", device=device)
    one_shot = OneShotAllReduce.create(group.pg, rank, 2, device)
    assert one_shot is not None
    opts = torch.distributed.AllreduceOptions()

    def nccl(x: torch.Tensor) -> torch.Tensor:
        group.pg.allreduce([x], opts).wait()
        return x

    rows = []
    for bs, hidden in ((1, 4096), (1, 8192), (32, 4096), (256, 4096), (256, 8192)):
        x = torch.randn(bs, hidden, device=device, dtype=torch.bfloat16)
        row = {"bs": bs, "hidden": hidden, "bytes": x.numel() * 2}
        residual, weight = torch.randn_like(x), torch.ones(hidden, device=device, dtype=x.dtype)
        fns = [("nccl", nccl), ("one_shot", one_shot)]
        if hidden == 4096:  # the row channel serves one width
            fns.append(("fused_norm", lambda x: one_shot.add_rmsnorm(x, residual, weight, 1e-5)))
        for name, fn in fns:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn(x)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(64):
                    fn(x)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize(device)
            row[f"{name}_us"] = (time.perf_counter() - t) / (20 * 64) * 1e6
        rows.append(row)
    queue.put((rank, rows))


def all_reduce(res: dict) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, PORT + 7, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    rows = dict(queue.get(timeout=300) for _ in procs)[0]
    for p in procs:
        p.join(30)
    res["all_reduce"] = rows
    for r in rows:
        fused = f", sum + residual + norm {r['fused_norm_us']:.1f} us" if "fused_norm_us" in r else ""
        print(f"all-reduce [{r['bs']}, {r['hidden']}] bf16 in a graph: NCCL {r['nccl_us']:.1f} us, "
              f"one-shot {r['one_shot_us']:.1f} us{fused}", flush=True)


def _trainer(gpu: int, barrier, queue) -> None:
    """Rank 0 of a 3-rank group (trainer + the two engine ranks): raw broadcasts, then updates."""
    sys.path.insert(0, os.getcwd())
    from tide.weights import init_custom_process_group

    from benchmarks.handover_dist import trainer_shapes

    torch.cuda.set_device(gpu)
    tensors = [torch.empty(s, dtype=torch.bfloat16, device="cuda").uniform_(-0.02, 0.02)
               for _, s in trainer_shapes()]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    group = init_custom_process_group("nccl", "127.0.0.1", PORT, 0, 3, "weight_update_group")
    for _ in range(4):  # 1 warm-up + 3 timed raw broadcasts, each after a barrier
        barrier.wait()
        torch.cuda.synchronize()
        t = time.perf_counter()
        group.broadcast_flattened(flat)  # one piece with the default bucket_bytes
        torch.cuda.synchronize()
        queue.put(("raw", time.perf_counter() - t))
    for fmt in ("per_tensor", "per_tensor", "flattened_bucket", "flattened_bucket"):
        barrier.wait()
        if fmt == "flattened_bucket":
            group.broadcast_flattened(flat)
        else:
            group.broadcast_weights([(n, t) for (n, _), t in zip(trainer_shapes(), tensors)])
        torch.cuda.synchronize()
    barrier.wait()


def distributed_update(res: dict, trainer_gpu: int) -> None:
    import torch.multiprocessing as mp

    from benchmarks.handover_dist import trainer_shapes

    if torch.cuda.device_count() <= trainer_gpu:
        print(f"distributed: skipped (the trainer needs GPU {trainer_gpu}; NCCL allows one rank "
              "per GPU)", flush=True)
        return
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(trainer_gpu, barrier, queue))
    trainer.start()
    engine = make_engine(SHAPE_8B, 2, mem_fraction_static=0.5, disable_cuda_graph=True)
    r = engine.init_weights_update_group("127.0.0.1", PORT, 1, 3, backend="nccl")
    assert r["success"], r["message"]
    shapes = trainer_shapes()
    names = [n for n, _ in shapes]
    nbytes = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    # The raw limit: the engine ranks receive the flat broadcast in the same group. A name the
    # model lacks fails validation on every rank, so each drains the bytes into scratch memory.
    for _ in range(4):
        barrier.wait()
        r = engine.update_weights_from_distributed(["raw"], ["bfloat16"], [[nbytes // 2]],
                                                   load_format="flattened_bucket")
        assert not r["success"]
    raw_s = min(queue.get()[1] for _ in range(4))
    updates = []
    for fmt in ("per_tensor", "per_tensor", "flattened_bucket", "flattened_bucket"):
        barrier.wait()
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = engine.update_weights_from_distributed(
            names, ["bfloat16"] * len(names), [list(s) for _, s in shapes],
            load_format=None if fmt == "per_tensor" else "flattened_bucket")
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        assert r["success"], r["message"]
        updates.append({"format": fmt, "seconds": dt, "GBps": nbytes / dt / 1e9,
                        "ratio_to_raw": raw_s / dt})
        print(f"update_weights_from_distributed TP=2 {fmt}: {dt * 1e3:.0f} ms "
              f"({nbytes / dt / 1e9:.1f} GB/s, {raw_s / dt:.0%} of the raw broadcast "
              f"{raw_s * 1e3:.0f} ms)", flush=True)
    barrier.wait()
    trainer.join(60)
    res["distributed"] = {"bytes": nbytes, "raw_broadcast_s": raw_s, "updates": updates}
    close(engine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="allreduce,decode,throughput,tensor,70b")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--trainer-gpu", type=int, default=2)
    args = ap.parse_args()
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "num_gpus": torch.cuda.device_count(),
                           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    bw = measure_copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (cuda:0)", flush=True)

    def save() -> None:
        with open(os.path.join(args.out, "tp.json"), "w") as f:
            json.dump(res, f, indent=2)

    if "allreduce" in parts:
        all_reduce(res)
        save()
    if "decode" in parts:
        decode(res, bw, SHAPE_8B, (1, 2))
        save()
    if "throughput" in parts:
        throughput(res, args.num_requests)
        save()
    if "tensor" in parts:
        tensor_update(res)
        save()
    if "distributed" in parts:
        distributed_update(res, args.trainer_gpu)
        save()
    if "70b" in parts:
        decode(res, bw, SHAPE_70B, (2,))
        save()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
