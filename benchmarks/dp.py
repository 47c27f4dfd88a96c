"""Data-parallel offline throughput on a GPU host: `python -m benchmarks.dp [--replicas 1,2]`.

The standard workload of `benchmarks.run` (b) — 256 requests, prompt and output lengths uniform in
[100, 1024] (seed 0), ignore_eos, dummy weights of a real shape — sent as one batch to
`tide.cluster.ray.RayEngine` with 1 and then N replicas (one GPU each, a local Ray cluster started
here), so the DP=N figure and the DP=1 figure come from the same run. Writes `dp.json` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from benchmarks.run import workload
from benchmarks.shapes import config_dir


def throughput(replicas: int, shape: str, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from tide.cluster.ray import RayEngine

    engine = RayEngine(config_dir(shape), num_replicas=replicas, load_format="dummy",
                       dtype="bfloat16", device="cuda")
    try:
        ids = [r[0] for r in reqs]
        params = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
        engine.generate(input_ids=ids[:4 * replicas], sampling_params=params[:4 * replicas])
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params)
        seconds = time.perf_counter() - start
        assert isinstance(outs, list)
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        in_tokens = sum(len(i) for i in ids)
        served = [r["requests_served"] for r in engine.router.describe()]
    finally:
        engine.shutdown()
    return {"replicas": replicas, "seconds": seconds, "output_tok_s": out_tokens / seconds,
            "total_tok_s": (in_tokens + out_tokens) / seconds, "requests_per_replica": served}


def main() -> None:
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts to run")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args()
    counts = [int(c) for c in args.replicas.split(",")]
    ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "num_gpus": torch.cuda.device_count(), "shape": args.shape, "runs": []}
    reqs = workload(args.num_requests)
    for count in counts:
        run = throughput(count, args.shape, reqs)
        res["runs"].append(run)
        print(f"DP={count} {args.shape}: {run['output_tok_s']:.0f} out tok/s "
              f"({run['seconds']:.1f} s, requests per replica {run['requests_per_replica']})",
              flush=True)
    base = res["runs"][0]["output_tok_s"]
    for run in res["runs"]:
        run["speedup_vs_first"] = run["output_tok_s"] / base
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dp.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
