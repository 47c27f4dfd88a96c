"""Release/resume on a GPU host: `python -m benchmarks.memory_saver [--cycles 50] [--full-cycles 5]`.

Llama-3.1-8B shape (dummy bf16 weights), KV pool of >= 80 GB, CUDA graphs on, memory saver with CPU
backup: device memory used before/after releasing every tag (as `mem_get_info` sees it), the time of
releasing and resuming every tag per cycle (the first cycle allocates the pinned host backup of the
weights, later cycles reuse it; the backup's allocation and copy times are reported apart), release
and resume time of `kv_cache`, greedy tokens before release and after every resume through the same
captured graphs, and device memory over repeated release/resume cycles.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.run import make_engine


def used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _thp() -> str:
    """The kernel's transparent huge page mode (pinning the host backup is faster with them)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--full-cycles", type=int, default=5,
                    help="release/resume cycles of every tag (the first one included)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args()
    baseline = used()
    engine = make_engine("llama-3.1-8b", enable_memory_saver=True, enable_cpu_backup=True)
    runner = engine.model_runner
    kv_gb = runner.token_to_kv_pool.region.size / 1e9
    prompts = [[1000 + 7 * i + j for j in range(100)] for i in range(8)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    before_tokens = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    graphs = dict(runner.cuda_graph_runner.graphs)
    footprint = used() - baseline
    t = time.perf_counter()
    engine.release_memory_occupation()
    t_release_all = time.perf_counter() - t
    released = used() - baseline
    # What stays, split: the caching allocator's live and cached bytes, and memory outside it.
    breakdown = {"torch_allocated_GB": torch.cuda.memory_allocated() / 1e9,
                 "torch_reserved_GB": torch.cuda.memory_reserved() / 1e9}
    breakdown["outside_torch_GB"] = released / 1e9 - breakdown["torch_reserved_GB"]
    t = time.perf_counter()
    engine.resume_memory_occupation()
    t_resume_all = time.perf_counter() - t
    same_graphs = all(runner.cuda_graph_runner.graphs[bs] is g for bs, g in graphs.items())
    after_tokens = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    backup = engine.worker.memory_occupation.backup
    full = [{"release_s": t_release_all, "resume_s": t_resume_all,
             "backup_alloc_s": backup.buffer.alloc_s if backup.buffer is not None else None,
             "backup_copy_s": backup.last_save_s, "restore_copy_s": backup.last_restore_s}]
    repeat_tokens_equal = True
    for _ in range(args.full_cycles - 1):
        t0 = time.perf_counter()
        assert engine.release_memory_occupation()["success"]
        t1 = time.perf_counter()
        assert engine.resume_memory_occupation()["success"]
        t2 = time.perf_counter()
        full.append({"release_s": t1 - t0, "resume_s": t2 - t1, "backup_copy_s": backup.last_save_s,
                     "restore_copy_s": backup.last_restore_s})
        out = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        repeat_tokens_equal &= out == before_tokens
    repeat = sorted(c["release_s"] for c in full[1:]) or [float("nan")]
    kv_times = []
    usage = []
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        engine.release_memory_occupation(["kv_cache"])
        t1 = time.perf_counter()
        engine.resume_memory_occupation(["kv_cache"])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        kv_times.append((t1 - t0, t2 - t1))
        usage.append(used() - baseline)
    cycle_tokens = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    kv_total = sorted(a + b for a, b in kv_times)
    res = {
        "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
        "kv_region_GB": kv_gb, "footprint_GB": footprint / 1e9, "after_release_all_GB": released / 1e9,
        "after_release_ratio": released / footprint, "after_release_breakdown": breakdown,
        "release_all_s": t_release_all,
        "resume_all_s": t_resume_all, "graphs_kept": same_graphs,
        "release_all_first_s": full[0]["release_s"],
        "release_all_repeat_s_median": repeat[len(repeat) // 2],
        "release_all_repeat_s_max": repeat[-1],
        "host_backup_GB": backup.host_bytes / 1e9, "host_backup_allocations": backup.allocations,
        "host_backup_registered": bool(backup.buffer is not None and backup.buffer.registered),
        "full_cycles": full, "transparent_hugepage": _thp(),
        "tokens_equal_after_resume": after_tokens == before_tokens,
        "tokens_equal_after_full_cycles": repeat_tokens_equal,
        "tokens_equal_after_cycles": cycle_tokens == before_tokens,
        "kv_release_plus_resume_s_median": kv_total[len(kv_total) // 2],
        "kv_release_plus_resume_s_max": kv_total[-1],
        "usage_first_GB": usage[0] / 1e9, "usage_last_GB": usage[-1] / 1e9,
        "usage_max_GB": max(usage) / 1e9,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_saver.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
