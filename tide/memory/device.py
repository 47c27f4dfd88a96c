"""The only place tide empties a device allocator cache, and memory observation that never frees.

`empty_device_cache` waits for all queued device work, so it is called only at named release points;
each call is recorded (reason, host stall, reserved bytes before/after) in `MEMORY_LEDGER`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import ModuleType

import torch


@dataclass(frozen=True)
class ReleaseEvent:
    reason: str
    stall_s: float
    reserved_before: int
    reserved_after: int
    time: float


@dataclass
class MemoryLedger:
    """Every allocator release point, in order; totals per reason."""

    events: list[ReleaseEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, event: ReleaseEvent) -> None:
        with self._lock:
            self.events.append(event)

    def totals(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for e in self.events:
                t = out.setdefault(e.reason, {"count": 0, "stall_s": 0.0, "freed_bytes": 0})
                t["count"] += 1
                t["stall_s"] += e.stall_s
                t["freed_bytes"] += max(0, e.reserved_before - e.reserved_after)
        return out


MEMORY_LEDGER = MemoryLedger()


def _device_module(device_module: ModuleType | None) -> ModuleType | None:
    if device_module is not None:
        return device_module
    if torch.cuda.is_available():
        return torch.cuda
    try:
        return torch.get_device_module()
    except (RuntimeError, AttributeError):
        return None


def _reserved(module: ModuleType) -> int:
    fn = getattr(module, "memory_reserved", None)
    try:
        return int(fn()) if fn is not None else 0
    except (RuntimeError, AssertionError):
        return 0


def empty_device_cache(device_module: ModuleType | None = None, *, reason: str) -> bool:
    """Return cached allocator blocks to the device. False (and nothing done) where the backend has
    no `empty_cache` or no device is initialised."""
    if not reason:
        raise ValueError("reason must be a non-empty string")
    module = _device_module(device_module)
    fn = getattr(module, "empty_cache", None) if module is not None else None
    is_available = getattr(module, "is_available", None)
    if fn is None or (is_available is not None and not is_available()):
        return False
    before = _reserved(module)
    start = time.perf_counter()
    fn()
    stall = time.perf_counter() - start
    MEMORY_LEDGER.record(ReleaseEvent(reason, stall, before, _reserved(module), time.time()))
    return True


def available_device_memory(device: torch.device, empty_cache: bool = False) -> int:
    """Free bytes on `device` (host RAM for CPU). Observes only, unless `empty_cache` is asked for."""
    if device.type == "cuda":
        if empty_cache:
            empty_device_cache(torch.cuda, reason="observe_memory")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
