"""What constrained decoding costs: `python -m benchmarks.grammar [--shape S] [--requests N]
[--tokens T] [--out FILE]`.

Dummy weights of a real shape with a synthetic tokenizer of the model's vocabulary size (byte-like
single characters first, then random 2-8 character strings of a JSON alphabet, eos last), so
xgrammar's masks cost what they cost at a real vocabulary. N requests of 200 random prompt tokens
each decode T tokens, greedy, in four ways: free (ignore_eos); the regex `[0-9]+`; the regex of an
open JSON string value (`{"text": "` then any characters but a quote or a backslash: every step
inside a string, xgrammar's costliest mask); and free rows beside as many string rows (a mixed
batch). eos, which both grammars allow at every step, gets a logit bias of -100. Prints
seconds, ms per decode step, and the host time of one batch mask fill at the workload's sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import time

import torch

from benchmarks.run import make_engine
from benchmarks.shapes import SHAPES, config_dir


def synthetic_tokenizer(path: str, vocab: int, eos: int, seed: int = 0) -> None:
    """A WordLevel tokenizer of exactly `vocab` tokens, token `eos` its end-of-text."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + ' {}[]":,.-_\n'
    tokens = list(dict.fromkeys(string.printable))
    seen = set(tokens)
    while len(tokens) < vocab - 1:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    tokens.insert(eos, "<|endoftext|>")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)


def timed(engine, ids, params) -> float:
    engine.generate(input_ids=ids[:2], sampling_params=params[:2])  # warm-up (and compile)
    engine.flush_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    lengths = [len(o["output_ids"]) for o in outs]
    assert min(lengths) == max(lengths), lengths  # each way decodes exactly T tokens a row
    return elapsed


def mask_timings(rows: int, vocab: int, reps: int = 20) -> dict[str, float]:
    """Device µs to mask [rows, vocab] bf16 logits with a host bitmask: torch's unpack (tide's CUDA
    path) and xgrammar's Triton kernel, each including the bitmask's copy to the device."""
    import xgrammar as xgr
    from tide.grammar import unpack_and_mask

    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32)
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    ways = {
        "torch unpack": lambda: unpack_and_mask(logits, bitmask.to("cuda", non_blocking=True)),
        "xgrammar triton": lambda: xgr.apply_token_bitmask_inplace(
            logits, bitmask.to("cuda", non_blocking=True), backend="triton"),
    }
    out = {}
    for name, fn in ways.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[name] = 1e6 * (time.perf_counter() - t) / reps
        print(f"mask {rows} x {vocab} logits, {name}: {out[name]:.1f} us (host + device)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    path = config_dir(args.shape)
    synthetic_tokenizer(path, shape["vocab_size"], shape["eos_token_id"])
    engine = make_engine(args.shape)
    n, t = args.requests, args.tokens
    rng = random.Random(0)
    ids = [[rng.randrange(1000, 100000) for _ in range(200)] for _ in range(n)]
    greedy = {"temperature": 0, "max_new_tokens": t}
    # eos is allowed at every step of these grammars; biased away, every row decodes T tokens.
    no_eos = {**greedy, "logit_bias": {shape["eos_token_id"]: -100.0}}
    digits = {**no_eos, "regex": "[0-9]+"}
    in_string = {**no_eos, "regex": '\\{"text": "[^"\\\\]*'}  # an open JSON string
    ways = {
        "free": [{**greedy, "ignore_eos": True}] * n,
        "regex of digits": [digits] * n,
        "inside a JSON string": [in_string] * n,
        "half free, half in a string": [{**greedy, "ignore_eos": True}, in_string] * (n // 2),
    }
    results: dict[str, dict[str, float]] = {}
    for name, params in ways.items():
        seconds = timed(engine, ids, params)
        results[name] = {"seconds": seconds, "ms_per_step": 1e3 * seconds / t}
        print(f"{name:28s} {seconds:7.3f} s  {results[name]['ms_per_step']:6.2f} ms a step")
    # The host fill alone, rows inside a JSON string.
    sched = engine.scheduler
    backend = sched._grammar_compiler()
    compiled = backend.compile("regex", in_string["regex"]).result()
    grammars = [backend.matcher(compiled) for _ in range(n)]
    tok = engine.tokenizer
    for g in grammars:
        for token in tok.convert_tokens_to_ids(list('{"text": "ab')):
            assert g.accept(token)
    from tide.grammar import GrammarMasks

    fills = []
    for _ in range(5):
        masks = GrammarMasks(n, list(enumerate(grammars)))
        a = time.perf_counter()
        masks.bitmask()
        fills.append(time.perf_counter() - a)
    results["host fill, rows in a string"] = {"ms": 1e3 * min(fills)}
    print(f"host mask fill of {n} rows inside a string: {1e3 * min(fills):.2f} ms "
          f"({os.cpu_count()} CPUs)")
    results["mask on the device"] = mask_timings(n, shape["vocab_size"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "requests": n, "tokens": t,
                       "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
