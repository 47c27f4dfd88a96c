"""The stage profiler: time and memory of every stage of a batch, measured without side effects.

Time: on CUDA, an event recorded on the compute stream at each stage boundary (the component moves of
the stage's hooks included), read once the batch is done — the decode stage's copy of the images to the
host already waited for the device, so reading them adds no synchronisation; elsewhere the host clock.
Memory: a `MemoryObserver` read at the boundaries — on CUDA the caching allocator's counters
(`memory_allocated`, `max_memory_allocated`, whose peak is reset at each stage start; host-side
counters, no device synchronisation, nothing freed); on other devices the bytes of component weights
the residency manager holds on the compute device. The debug log line per stage is written after the
batch, from the numbers already taken, so turning it on changes neither timing nor memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

SOURCE_CUDA_ALLOCATOR = "cuda_allocator"
SOURCE_PLACED_WEIGHTS = "placed_weights"


class MemoryObserver(Protocol):
    """Reads device memory without changing it (a peak reset is the only write)."""

    source: str

    def reset_peak(self) -> None: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...


class CudaMemoryObserver:
    """The CUDA caching allocator's own counters for one device."""

    source = SOURCE_CUDA_ALLOCATOR

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class PlacedWeightsObserver:
    """Bytes of component weights a residency manager holds on the compute device (used where the
    device has no allocator counters, e.g. the CPU)."""

    source = SOURCE_PLACED_WEIGHTS

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def reset_peak(self) -> None:
        self.manager.reset_peak()

    def allocated(self) -> int:
        return int(self.manager.device_bytes())

    def peak(self) -> int:
        return int(self.manager.peak_device_bytes)


@dataclass
class StageProfile:
    """One stage of one batch."""

    name: str
    ms: float
    peak_bytes: int
    allocated_bytes: int


@dataclass
class BatchProfile:
    """Every stage of one batch, in order, and the batch's peak."""

    stages: list[StageProfile] = field(default_factory=list)
    memory_source: str = ""

    @property
    def timings_ms(self) -> dict[str, float]:
        return {s.name: s.ms for s in self.stages}

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages), default=0)

    def memory(self) -> dict[str, dict[str, int]]:
        return {s.name: {"peak_bytes": s.peak_bytes, "allocated_bytes": s.allocated_bytes}
                for s in self.stages}


class StageProfiler:
    """Collects one batch's stage spans; `finish()` reads them once the batch is done."""

    def __init__(self, device: torch.device, observer: MemoryObserver | None) -> None:
        self.cuda = device.type == "cuda"
        self.observer = observer
        self._open: tuple[str, Any] | None = None
        self._spans: list[tuple[str, Any, Any, int, int]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, name: str) -> None:
        if self.observer is not None:
            self.observer.reset_peak()
        self._open = (name, self._now())

    def end(self, name: str) -> None:
        assert self._open is not None and self._open[0] == name
        stop = self._now()
        peak = allocated = 0
        if self.observer is not None:
            peak, allocated = self.observer.peak(), self.observer.allocated()
        self._spans.append((name, self._open[1], stop, peak, allocated))
        self._open = None

    def finish(self) -> BatchProfile:
        """The batch's profile (on CUDA: waits for the last event, already passed by the decode's
        host copy); then one debug line per stage."""
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()
        profile = BatchProfile(memory_source=self.observer.source if self.observer else "")
        for name, start, stop, peak, allocated in self._spans:
            ms = start.elapsed_time(stop) if self.cuda else (stop - start) * 1000.0
            profile.stages.append(StageProfile(name, float(ms), peak, allocated))
        self._spans.clear()
        if logger.isEnabledFor(logging.DEBUG):
            for s in profile.stages:
                logger.debug("stage %s: %.2f ms, peak %.1f MiB, allocated %.1f MiB (%s)", s.name, s.ms,
                             s.peak_bytes / 2**20, s.allocated_bytes / 2**20, profile.memory_source)
        return profile
