"""Training <-> rollout handover on a GPU host: `python -m benchmarks.handover [--only 6,7,8] [--out DIR]`.

6. update_weights_from_tensor with flattened buckets (Llama-3.1-8B shape, source tensors on the same
   GPU), against the copy floor (2 x bytes / measured copy bandwidth); the disk path from page cache.
7. 32 decode streams through pause(in_place) -> update -> continue: the longest inter-step gap and the
   mean step time of the next 20 steps, for torch_empty_cache False/True on the update and on continue;
   and the host stall of one empty_device_cache call behind queued GPU work (the ledger's figure).
8. 100 cycles of pause(in_place) -> update with transient allocations -> continue: reserved memory
   and num_alloc_retries, with and without continue_generation(torch_empty_cache=True).
Writes handover.json into --out and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import torch

from benchmarks.run import make_engine, measure_copy_bandwidth
from tide.memory import empty_device_cache
from tide.weights import flatten_by_dtype
from tide.weights.mapping import STACKED_PARAMS


def hf_named_tensors(model: torch.nn.Module, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under HF checkpoint names (fused params split back), as new tensors."""
    out = []
    for name, param in model.named_parameters():
        if getattr(param, "derived", False):
            continue  # an fp8 copy (quantization="fp8"), no checkpoint tensor
        offsets = getattr(param, "shard_offsets", None)
        if offsets is None:
            out.append((name, param.detach() * scale))
            continue
        for fused, part, shard in STACKED_PARAMS:
            if f".{fused}." in name and shard in offsets:
                start, size = offsets[shard]
                out.append((name.replace(f".{fused}.", f".{part}."),
                            param.detach()[start : start + size] * scale))
    return out


def time_tensor_update(engine, buckets, repeats: int = 5) -> list[float]:
    times = []
    for i in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = engine.update_weights_from_tensor(named_tensors=buckets, load_format="flattened_bucket",
                                              weight_version=f"v{i}")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        assert r["success"], r
    return times


def part6(res: dict[str, Any], bw: float, out_dir: str) -> None:
    engine = make_engine("llama-3.1-8b", max_total_tokens=200_000, disable_cuda_graph=False)
    named = hf_named_tensors(engine.model_runner.model, 1.0)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    buckets = flatten_by_dtype(named)
    del named
    times = time_tensor_update(engine, buckets)
    floor = 2 * nbytes / bw
    res["6_tensor_bucket"] = {"bytes": nbytes, "times_ms": [t * 1e3 for t in times],
                              "best_ms": min(times) * 1e3, "copy_floor_ms": floor * 1e3}
    print(f"(6) tensor flattened bucket: best {min(times) * 1e3:.1f} ms, median "
          f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms (copy floor {floor * 1e3:.1f} ms)", flush=True)
    del buckets
    # Disk: save the weights once, read twice (the second read is from page cache).
    from safetensors.torch import save_file

    from benchmarks.shapes import config_dir

    ckpt = "/tmp/tide-llama8b-ckpt"
    os.makedirs(ckpt, exist_ok=True)
    import shutil

    shutil.copy(os.path.join(config_dir("llama-3.1-8b"), "config.json"), ckpt)
    named = hf_named_tensors(engine.model_runner.model, 1.0)
    shard: dict[str, torch.Tensor] = {}
    idx, size, index = 0, 0, {}
    for name, t in named:
        shard[name] = t.contiguous().cpu()
        size += t.numel() * t.element_size()
        if size > 4 << 30:
            fname = f"model-{idx:05d}.safetensors"
            save_file(shard, os.path.join(ckpt, fname))
            index.update({k: fname for k in shard})
            shard, size, idx = {}, 0, idx + 1
    if shard:
        fname = f"model-{idx:05d}.safetensors"
        save_file(shard, os.path.join(ckpt, fname))
        index.update({k: fname for k in shard})
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": index}, f)
    del named, shard
    model = engine.model_runner.model
    checksum = [p.float().sum().item() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    disk_times = []
    for i in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = engine.update_weights_from_disk(ckpt, weight_version=f"disk{i}")
        torch.cuda.synchronize()
        disk_times.append(time.perf_counter() - t)
        assert r["success"], r
    exact = checksum == [p.float().sum().item() for p in model.parameters()]
    res["6_disk"] = {"times_s": disk_times, "page_cache_best_s": min(disk_times[1:]),
                     "weights_restored_exactly": exact}
    print(f"(6) disk update restored every parameter exactly: {exact}", flush=True)
    print(f"(6) disk: first {disk_times[0]:.2f} s, from page cache {min(disk_times[1:]):.2f} s", flush=True)
    engine.shutdown()


class StepClock:
    """Records the wall time at the end of every scheduler step."""

    def __init__(self, engine) -> None:
        self.times: list[float] = []
        sched = engine.scheduler
        inner = sched.step

        def step():
            out = inner()
            if out:
                torch.cuda.synchronize()
                self.times.append(time.perf_counter())
            return out

        sched.step = step


def part7(res: dict[str, Any]) -> None:
    engine = make_engine("llama-3.1-8b", max_total_tokens=200_000)
    buckets = flatten_by_dtype(hf_named_tensors(engine.model_runner.model, 1.0))
    # Start from the engine's own working set: the 16 GB of temporaries that built the buckets
    # above would otherwise sit in the cache and be freed by the first emptying call measured below.
    import gc

    gc.collect()
    empty_device_cache(reason="benchmark_setup", ledger=None)
    clock = StepClock(engine)
    res["7"] = {}
    for upd_empty in (False, True):
        for cont_empty in (False, True):
            prompts = [[1000 + i + j for j in range(64)] for i in range(32)]
            params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
            th = threading.Thread(target=engine.generate, kwargs={"input_ids": prompts, "sampling_params": params})
            clock.times.clear()
            th.start()
            while len(clock.times) < 60:
                time.sleep(0.005)
            steady = [b - a for a, b in zip(clock.times[20:59], clock.times[21:60])]
            wall0 = time.time()
            engine.pause_generation("in_place")
            n_before = len(clock.times)
            t0 = time.perf_counter()
            r = engine.update_weights_from_tensor(named_tensors=buckets, load_format="flattened_bucket",
                                                  torch_empty_cache=upd_empty)
            t_update = time.perf_counter() - t0
            assert r["success"], r
            engine.continue_generation(torch_empty_cache=cont_empty)
            while len(clock.times) < n_before + 21:
                time.sleep(0.005)
            after = clock.times[n_before - 1 : n_before + 21]
            gap = after[1] - after[0]
            next20 = [b - a for a, b in zip(after[1:21], after[2:22])]
            th.join()
            key = f"update_empty={upd_empty},continue_empty={cont_empty}"
            emptied: dict[str, dict[str, float]] = {}
            for e in engine.memory_ledger.events:
                if e.time >= wall0:
                    row = emptied.setdefault(e.reason, {"calls": 0, "stall_ms": 0.0, "freed_MiB": 0.0})
                    row["calls"] += 1
                    row["stall_ms"] += e.stall_s * 1e3
                    row["freed_MiB"] += (e.reserved_before - e.reserved_after) / 2**20
            steady_ms = sorted(steady)[len(steady) // 2] * 1e3
            res["7"][key] = {"update_ms": t_update * 1e3, "longest_gap_ms": gap * 1e3,
                             "next20_mean_step_ms": sum(next20) / len(next20) * 1e3,
                             "steady_step_ms": steady_ms, "empty_device_cache": emptied}
            ok = gap * 1e3 <= t_update * 1e3 + 2 * steady_ms + 1e-9
            print(f"(7) {key}: update {t_update * 1e3:.1f} ms, longest gap {gap * 1e3:.1f} ms, "
                  f"next-20 mean step {sum(next20) / len(next20) * 1e3:.2f} ms, steady {steady_ms:.2f} ms"
                  f"{'  (gap <= update + 2 steps)' if ok else ''}; emptied {emptied}", flush=True)
    # Host stall of one empty_device_cache call behind queued GPU work.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    empty_device_cache(reason="stall_probe", ledger=engine.memory_ledger)
    stall = [e for e in engine.memory_ledger.events if e.reason == "stall_probe"][-1].stall_s
    res["7_empty_cache_stall_ms"] = stall * 1e3
    print(f"(7) empty_device_cache host stall behind ~200 queued 8k matmuls: {stall * 1e3:.1f} ms", flush=True)
    engine.shutdown()


def part8(res: dict[str, Any], cycles: int) -> None:
    for cont_empty in (True, False):
        engine = make_engine("llama-3.1-8b", max_total_tokens=200_000)
        buckets = flatten_by_dtype(hf_named_tensors(engine.model_runner.model, 1.0))
        torch.cuda.reset_peak_memory_stats()
        stats0 = torch.cuda.memory_stats()
        reserved = []
        gen = torch.Generator().manual_seed(0)
        prompts = [[1000 + i + j for j in range(64)] for i in range(32)]
        for c in range(cycles):
            th = threading.Thread(target=engine.generate, kwargs={
                "input_ids": prompts, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
            th.start()
            time.sleep(0.01)
            engine.pause_generation("in_place")
            r = engine.update_weights_from_tensor(named_tensors=buckets, load_format="flattened_bucket")
            assert r["success"], r
            # Transient post-processing allocations of varying size (as a quantizing loader makes).
            tmp = [torch.empty(int(torch.randint(16, 512, (1,), generator=gen)) << 20, dtype=torch.uint8,
                               device="cuda") for _ in range(6)]
            del tmp
            engine.continue_generation(torch_empty_cache=cont_empty)
            th.join()
            reserved.append(torch.cuda.memory_reserved())
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - stats0.get("num_alloc_retries", 0)
        key = f"continue_empty={cont_empty}"
        growth = (reserved[-1] - reserved[0]) / reserved[0]
        res.setdefault("8", {})[key] = {"reserved_cycle1": reserved[0], "reserved_last": reserved[-1],
                                        "growth": growth, "num_alloc_retries": retries,
                                        "reserved_max": max(reserved)}
        print(f"(8) {key}: reserved cycle 1 {reserved[0] / 2**30:.3f} GiB, cycle {cycles} "
              f"{reserved[-1] / 2**30:.3f} GiB ({growth:+.2%}), max {max(reserved) / 2**30:.3f} GiB, "
              f"num_alloc_retries {retries}", flush=True)
        engine.shutdown()
        del engine, buckets
        import gc

        gc.collect()
        empty_device_cache(reason="benchmark_teardown", ledger=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="6,7,8")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--cycles", type=int, default=100)
    args = ap.parse_args()
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    bw = measure_copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    path = os.path.join(args.out, "handover.json")
    for part, fn in (("6", lambda: part6(res, bw, args.out)), ("7", lambda: part7(res)),
                     ("8", lambda: part8(res, args.cycles))):
        if part in parts:
            fn()
            with open(path, "w") as f:
                json.dump(res, f, indent=2)
            import gc

            gc.collect()
            empty_device_cache(reason="benchmark_teardown", ledger=None)


if __name__ == "__main__":
    main()
