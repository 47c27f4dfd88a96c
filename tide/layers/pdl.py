"""Programmatic dependent launch (PDL, Hopper and later) for tide's Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running, which
hides launch latency and ramp-up between the many short kernels of a decode step. The contract every
PDL kernel in tide keeps: it calls `gdc_launch_dependents()` (the next kernel may launch now) and
`gdc_wait()` (block until the previous kernel has finished and its writes are visible) before it reads
anything an earlier kernel wrote and before it writes anything. Only loads of data that no kernel in
flight writes may come before the wait. Since every PDL kernel waits, "finished" stays transitive along
the stream, and kernels launched without PDL keep plain stream order: a kernel in flight was launched
after the last operation without PDL (a CUDA graph's start, an input copy, a torch op). So weights, the
step's inputs (positions, sequence lengths, the request table: all written by operations without PDL)
and the KV of earlier tokens may be read before the wait; activations and the newest token's K/V, which
PDL kernels of the same forward write, may not. A kernel whose programs may return before waiting must
keep at least one program that waits, or the chain breaks.

`TIDE_PDL=0` in the environment turns it off (for comparisons).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capable(index: int) -> bool:
    if os.environ.get("TIDE_PDL", "1") == "0":
        return False
    import triton.language as tl

    cuda = getattr(tl.extra, "cuda", None)
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda, "gdc_wait")


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL."""
    if not t.is_cuda:
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
