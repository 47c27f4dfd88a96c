"""Data-parallel offline throughput on a GPU host: `python -m benchmarks.dp [--replicas 1,2]
[--via serve|ray]`.

The standard workload of `benchmarks.run` (b) — 256 requests, prompt and output lengths uniform in
[100, 1024] (seed 0), ignore_eos, dummy weights of a real shape — sent as one batch, first with one
replica and then with N (one GPU each), so every figure comes from the same run:

- `--via serve` (default, no extra dependency): `tide serve --dp-size N --skip-tokenizer-init` with
  the batch as one `/generate` request of token ids (the server spreads its sequences);
- `--via ray`: `tide.cluster.ray.RayEngine(num_replicas=N)` on a local Ray cluster started here.

Writes `dp.json` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.run import workload
from benchmarks.shapes import config_dir

Requests = list[tuple[list[int], int]]


def _batch(reqs: Requests) -> tuple[list[list[int]], list[dict[str, Any]]]:
    ids = [r[0] for r in reqs]
    params = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
    return ids, params


def _result(replicas: int, seconds: float, outs: list[dict[str, Any]], ids: list[list[int]],
            served: list[int]) -> dict[str, Any]:
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    in_tokens = sum(len(i) for i in ids)
    return {"replicas": replicas, "seconds": seconds, "output_tok_s": out_tokens / seconds,
            "total_tok_s": (in_tokens + out_tokens) / seconds, "requests_per_replica": served}


def via_ray(replicas: int, shape: str, reqs: Requests) -> dict[str, Any]:
    from tide.cluster.ray import RayEngine

    engine = RayEngine(config_dir(shape), num_replicas=replicas, load_format="dummy",
                       dtype="bfloat16", device="cuda", skip_tokenizer_init=True)
    try:
        ids, params = _batch(reqs)
        engine.generate(input_ids=ids[:4 * replicas], sampling_params=params[:4 * replicas])
        engine.flush_cache()
        before = [r["requests_served"] for r in engine.router.describe()]
        start = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params)
        seconds = time.perf_counter() - start
        assert isinstance(outs, list)
        served = [r["requests_served"] - b for r, b in zip(engine.router.describe(), before)]
    finally:
        engine.shutdown()
    return _result(replicas, seconds, outs, ids, served)


def via_serve(replicas: int, shape: str, reqs: Requests) -> dict[str, Any]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tide", "serve", "--model", config_dir(shape), "--load-format",
           "dummy", "--dtype", "bfloat16", "--skip-tokenizer-init", "--dp-size", str(replicas),
           "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tide serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tide serve did not get ready")
            time.sleep(1)
        ids, params = _batch(reqs)
        with httpx.Client(base_url=url, timeout=3600) as http:
            warm = 4 * replicas
            http.post("/generate", json={"input_ids": ids[:warm], "sampling_params": params[:warm]})
            http.post("/flush_cache", json={"timeout": 60})
            before = [r["requests_served"] for r in http.get("/get_server_info").json()
                      .get("replicas", [{"requests_served": 0}])]
            start = time.perf_counter()
            resp = http.post("/generate", json={"input_ids": ids, "sampling_params": params})
            seconds = time.perf_counter() - start
            resp.raise_for_status()
            after = [r["requests_served"] for r in http.get("/get_server_info").json()
                     .get("replicas", [{"requests_served": len(ids) + before[0]}])]
        return _result(replicas, seconds, resp.json(), ids,
                       [a - b for a, b in zip(after, before)])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts to run")
    ap.add_argument("--via", choices=["serve", "ray"], default="serve")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args()
    counts = [int(c) for c in args.replicas.split(",")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    res: dict[str, Any] = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"),
                           "num_gpus": torch.cuda.device_count(), "shape": args.shape,
                           "via": args.via, "runs": []}
    if args.via == "ray":
        import ray

        ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    reqs = workload(args.num_requests)
    run_one = via_ray if args.via == "ray" else via_serve
    for count in counts:
        run = run_one(count, args.shape, reqs)
        res["runs"].append(run)
        print(f"DP={count} {args.shape} via {args.via}: {run['output_tok_s']:.0f} out tok/s "
              f"({run['seconds']:.1f} s, requests per replica {run['requests_per_replica']})",
              flush=True)
    base = res["runs"][0]["output_tok_s"]
    for run in res["runs"]:
        run["speedup_vs_first"] = run["output_tok_s"] / base
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dp.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
