"""Timing helpers shared by the GPU benchmarks."""

from __future__ import annotations

from typing import Callable

import torch


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 20, warmup: int = 1) -> float:
    """Mean seconds per replay of a captured graph, between two CUDA events after `warmup` replays."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` run once on a side stream (warm-up, compilation), then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
