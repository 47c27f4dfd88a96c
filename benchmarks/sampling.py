"""Device time of one sampling step: `python -m benchmarks.sampling [--vocab V] [--out FILE]`.

bf16 logits of B rows (1-256) over Qwen3's vocabulary, six kinds of batch: temperature 1 with
logprobs (an RL rollout), temperature 1 alone, temperature 0.7 seeded with logprobs, and three
truncated ones (top-p, top-k, all three). Each is drawn by the sampler's general path
(`Sampler(one_pass=False)`: cast, scale, softmax, sort to truncate, noise, divide, argmax,
log_softmax) and by `triton_ops.sample_rows` (`Sampler()`, after `truncation_bounds` for the
truncated ones), 20 steps queued behind a device
sleep so the events time the device, not the host. Prints microseconds a step and the one-pass
kernel's bytes read (one pass) as a fraction of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json

import torch
from tide.layers.sampler import Sampler, SamplingBatchInfo
from tide.sampling_params import SamplingParams

from benchmarks.run import measure_copy_bandwidth

CASES = (("temperature 1 + logprobs", {"temperature": 1.0}, True),
         ("temperature 1", {"temperature": 1.0}, False),
         ("temperature 0.7 seeded + logprobs", {"temperature": 0.7, "seed": 1}, True),
         ("top-p 0.9 + logprobs", {"temperature": 1.0, "top_p": 0.9}, True),
         ("top-k 50", {"temperature": 0.7, "top_k": 50}, False),
         ("top-k 50 + top-p 0.95 + min-p 0.05", {"temperature": 1.0, "top_k": 50, "top_p": 0.95,
                                                 "min_p": 0.05}, False))


def step_us(sampler: Sampler, logits: torch.Tensor, info: SamplingBatchInfo, steps: int = 20) -> float:
    for _ in range(3):
        sampler.sample(logits, info)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # the host queues every step before the device reaches them
    a.record()
    for _ in range(steps):
        sampler.sample(logits, info)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = measure_copy_bandwidth()
    rows = []
    for batch in (1, 16, 64, 128, 256):
        logits = torch.randn(batch, args.vocab, device="cuda").to(torch.bfloat16)
        for name, kw, logprob in CASES:
            params = [SamplingParams(**kw) for _ in range(batch)]
            info = SamplingBatchInfo(params, [[]] * batch, [[1]] * batch, [logprob] * batch,
                                     [0] * batch)
            general = step_us(Sampler(0, one_pass=False), logits, info)
            one_pass = step_us(Sampler(0), logits, info)
            row = {"rows": batch, "case": name, "general_us": general, "one_pass_us": one_pass,
                   "one_pass_fraction_of_copy": batch * args.vocab * 2 / (one_pass * 1e-6) / bw}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
