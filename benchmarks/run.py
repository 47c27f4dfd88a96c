"""Benchmarks on a GPU host: `python -m benchmarks.run [--only a,b,c,d] [--out DIR]`.

(a) bs1 decode tok/s, Llama-3.1-8B shape, 128 prompt / 256 new tokens, with the device copy bandwidth
    measured in the same run and the roofline (parameter bytes per token / bandwidth);
(b) offline throughput, 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0),
    ignore_eos, Qwen3-0.6B and Llama-3.1-8B shapes;
(c) HF transformers `generate` on the same workloads (the peer);
(d) bs1 decode tok/s at 1k, 8k and 32k context.
Writes results.json and results.md into --out and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from typing import Any

import torch

from benchmarks.shapes import config_dir
from tide.memory import empty_device_cache


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """`--engine KEY=VALUE` pairs as EngineConfig keywords (true/false, ints and floats parsed)."""
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine takes KEY=VALUE, got {pair!r}")
        low = value.lower()
        if low in ("true", "false"):
            opts[key] = low == "true"
            continue
        for cast in (int, float):
            try:
                opts[key] = cast(value)
                break
            except ValueError:
                pass
        else:
            opts[key] = value
    return opts


def make_engine(shape: str, **kw: Any):
    import tide

    return tide.Engine(config_dir(shape), load_format="dummy", dtype="bfloat16", **kw)


def param_bytes(engine) -> int:
    """Bytes of the weights a decode step reads: with fp8 projections (`quantization="fp8"`), their
    fp8 copies and scales instead of the model-dtype masters."""
    model = engine.model_runner.model
    masters = {id(m.weight) for m in model.modules() if getattr(m, "weight_fp8", None) is not None}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in masters)


def bs1_decode(engine, context: int, new_tokens: int) -> float:
    """Decode tok/s for one request: (new_tokens - 1) / (t(new_tokens) - t(1))."""
    rng = random.Random(0)
    ids = [rng.randrange(1000, 100000) for _ in range(context)]

    def timed(n: int) -> float:
        engine.flush_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                         "ignore_eos": True})
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(8)  # warm-up
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(new_tokens) for _ in range(2))
    return (new_tokens - 1) / (tn - t1)


def workload(n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0, vocab: int = 100000):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p, o = rng.randint(lo, hi), rng.randint(lo, hi)
        reqs.append(([rng.randrange(1000, vocab) for _ in range(p)], o))
    return reqs


def tide_throughput(engine, reqs, temperature: float = 0.0,
                    return_logprob: bool = False) -> dict[str, float]:
    """The workload `reqs` through `engine.generate` (greedy by default; `temperature` > 0 with
    `return_logprob` is an RL rollout's sampling)."""
    ids = [r[0] for r in reqs]
    params = [{"max_new_tokens": o, "temperature": temperature, "ignore_eos": True} for _, o in reqs]
    engine.generate(input_ids=ids[:4], sampling_params=params[:4],
                    return_logprob=return_logprob)  # warm-up
    engine.flush_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params, return_logprob=return_logprob)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    in_tokens = sum(len(i) for i in ids)
    return {"seconds": dt, "output_tok_s": out_tokens / dt, "total_tok_s": (in_tokens + out_tokens) / dt}


def hf_throughput(shape: str, reqs, batch_size: int) -> dict[str, float]:
    """HF `generate` with static batches of similar output length (left padded, greedy)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir(shape))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][1])
    torch.cuda.synchronize()
    t = time.perf_counter()
    out_tokens = 0
    for s in range(0, len(order), batch_size):
        batch = [reqs[i] for i in order[s : s + batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        out_tokens += sum(o for _, o in batch)  # only the tokens the workload asked for
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    in_tokens = sum(len(p) for p, _ in reqs)
    del model
    gc.collect()
    empty_device_cache(reason="benchmark_teardown", ledger=None)
    return {"seconds": dt, "output_tok_s": out_tokens / dt, "total_tok_s": (in_tokens + out_tokens) / dt,
            "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="a,b,c,d")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every tide engine, e.g. disable_overlap_schedule=true")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="(b): sample at this temperature instead of greedy")
    ap.add_argument("--logprobs", action="store_true", help="(b): return every token's logprob")
    args = ap.parse_args()
    options = engine_options(args.engine)
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "engine_options": options,
    }
    bw = measure_copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    reqs = workload(args.num_requests)
    shapes = args.shapes.split(",")

    def save() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=2)

    for shape in shapes:
        if not parts & {"a", "b", "d"} or (shape != "llama-3.1-8b" and not parts & {"b"}):
            continue
        engine = make_engine(shape, **options)
        if shape == "llama-3.1-8b" and "a" in parts:
            nbytes = param_bytes(engine)
            tps = bs1_decode(engine, 128, 256)
            roof = bw / nbytes
            res["a"] = {"shape": shape, "tok_s": tps, "roofline_tok_s": roof, "ratio": tps / roof,
                        "param_bytes": nbytes}
            print(f"(a) bs1 decode {shape}: {tps:.1f} tok/s, roofline {roof:.1f} ({tps / roof:.1%})", flush=True)
            save()
        if shape == "llama-3.1-8b" and "d" in parts:
            res["d"] = {}
            for ctx in (1024, 8192, 32768):
                res["d"][ctx] = bs1_decode(engine, ctx, 128)
                print(f"(d) bs1 decode @ {ctx}: {res['d'][ctx]:.1f} tok/s", flush=True)
            save()
        if "b" in parts:
            r = tide_throughput(engine, reqs, args.temperature, args.logprobs)
            r.update(temperature=args.temperature, logprobs=args.logprobs)
            res.setdefault("b", {})[shape] = r
            print(f"(b) tide throughput {shape}: {r['output_tok_s']:.0f} out tok/s ({r['seconds']:.1f}s)", flush=True)
            save()
        engine.shutdown()
        del engine
        gc.collect()
        empty_device_cache(reason="benchmark_teardown", ledger=None)
    if "c" in parts:
        for shape in shapes:
            r = hf_throughput(shape, reqs, args.hf_batch_size)
            res.setdefault("c", {})[shape] = r
            print(f"(c) HF throughput {shape}: {r['output_tok_s']:.0f} out tok/s ({r['seconds']:.1f}s)", flush=True)
            save()
    save()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
