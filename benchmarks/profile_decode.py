"""Where does a bs1 decode step go? `python -m benchmarks.profile_decode [--shape llama-3.1-8b]`.

Prints: GPU time of one captured decode graph replay, the full engine time per token, and the top
kernels of a profiled replay window. With `--tp-size 2` a graph cannot be replayed alone (the other
rank must meet its all-reduces), so it prints the engine time per token and rank 0's kernels over
a profiled generate: a one-shot all-reduce much longer than ~5 us is rank 0 waiting for rank 1.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.run import make_engine
from benchmarks.timing import replay_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args()
    engine = make_engine(args.shape, tp_size=args.tp_size)
    ids = list(range(1000, 1000 + args.context))
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params=params)
    engine.flush_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 1})
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 129})
    t129 = time.perf_counter() - t
    per_token = (t129 - t1) / 128
    from torch.profiler import ProfilerActivity, profile

    if args.tp_size > 1:
        print(f"engine per token {per_token * 1e3:.3f} ms ({1 / per_token:.1f} tok/s) at "
              f"TP={args.tp_size}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 33})
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                        max_name_column_width=70))
        engine.shutdown()
        return
    gr = engine.model_runner.cuda_graph_runner
    g = gr.graphs[1]
    replay = replay_seconds(g, reps=50, warmup=5)
    print(f"engine per token {per_token * 1e3:.3f} ms ({1 / per_token:.1f} tok/s); "
          f"graph replay {replay * 1e3:.3f} ms ({1 / replay:.1f} tok/s); "
          f"host/other {(per_token - replay) * 1e3:.3f} ms")

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 8})
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
