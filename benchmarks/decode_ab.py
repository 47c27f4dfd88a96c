"""A/B of one-row GEMV configs in full bs1 decode: `python -m benchmarks.decode_ab [variant ...]`.

Each variant replaces `tide.layers.gemv.config_for`, builds a Llama-3.1-8B-shape engine (dummy weights,
one graph bucket) and reports bs1 decode tok/s (best of two) and the decode-graph replay time.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable


import tide.layers.gemv as gemv
from benchmarks.run import bs1_decode, make_engine
from benchmarks.timing import replay_seconds
from tide.memory import empty_device_cache

Config = tuple[int, int, int]


def _rule(short: Config, long: Config) -> Callable[[int], Config]:
    """`short` for K <= 8192, `long` beyond (the down projection's K = 14336)."""
    return lambda k: long if k > 8192 else short


VARIANTS: dict[str, Callable[[int], Config]] = {
    **{f"k4096={c}": _rule(c, (1, 2048, 8)) for c in [(1, 1024, 4), (1, 4096, 2), (1, 4096, 4),
                                                      (2, 4096, 4), (2, 4096, 8)]},
    **{f"down={c}": _rule((1, 4096, 4), c) for c in [(1, 2048, 4), (1, 1024, 4), (2, 2048, 8)]},
}


def main() -> None:
    original = gemv.config_for
    for name in sys.argv[1:] or list(VARIANTS):
        gemv.config_for = VARIANTS[name]
        engine = make_engine("llama-3.1-8b", cuda_graph_max_bs=1, max_total_tokens=20000)
        tok_s = max(bs1_decode(engine, 128, 256) for _ in range(2))
        ms = replay_seconds(engine.model_runner.cuda_graph_runner.graphs[1], reps=50, warmup=5) * 1e3
        print(f"{name}: {tok_s:.1f} tok/s, replay {ms:.3f} ms", flush=True)
        engine.shutdown()
        del engine
        gc.collect()
        empty_device_cache(reason="benchmark_teardown", ledger=None)
    gemv.config_for = original


if __name__ == "__main__":
    main()
