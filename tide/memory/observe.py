"""Reading device memory. Nothing here frees, allocates or creates a device context."""

from __future__ import annotations

import os
from typing import TypedDict

import torch

# What "reserved"/"allocated" mean in a reading, by source.
SOURCE_CUDA = "cuda"  # torch.cuda.memory_reserved() / memory_allocated() of the current device
SOURCE_CPU_RSS = "cpu_rss"  # no CUDA context: allocated = this process's resident set, reserved = 0


class MemoryStats(TypedDict):
    reserved: int
    allocated: int
    source: str


def process_rss() -> int:
    """This process's resident set size in bytes (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # peak, not current: the best portable fallback

        scale = 1 if os.uname().sysname == "Darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def device_memory_stats() -> MemoryStats:
    """`{"reserved", "allocated", "source"}` now. CUDA figures when this process has a CUDA context
    (never creates one); otherwise the process RSS as `allocated` and 0 `reserved` (source cpu_rss)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            return {"reserved": int(torch.cuda.memory_reserved()),
                    "allocated": int(torch.cuda.memory_allocated()), "source": SOURCE_CUDA}
        except (RuntimeError, AssertionError):  # a broken context must not fail the caller
            pass
    return {"reserved": 0, "allocated": process_rss(), "source": SOURCE_CPU_RSS}


def reserved_bytes() -> int:
    """Bytes the CUDA caching allocator holds (0 without CUDA)."""
    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


def available_device_memory(device: torch.device) -> int:
    """Free bytes on `device` (host RAM for CPU). Observes only: to count cached blocks as free,
    empty the cache at a named release point first (`empty_device_cache`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
