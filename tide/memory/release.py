"""The only place tide empties a device allocator cache.

`empty_device_cache` waits for all queued device work, so it is called only at named release points
(`reason`: "flush_cache", "weight_update", "continue_generation", "release_memory", ...). The caller
passes the ledger of the engine it acts for, and the call is recorded there (reason, host stall,
reserved bytes before/after); `ledger=None` is for code that belongs to no engine (benchmark set-up
and teardown).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import torch

from tide.memory.ledger import MemoryLedger, ReleaseEvent


def _device_module(device_module: Any) -> Any:
    if device_module is not None:
        return device_module
    if torch.cuda.is_available():
        return torch.cuda
    try:
        return torch.get_device_module()
    except (RuntimeError, AttributeError):
        return None


def _query(module: Any, name: str) -> int:
    fn = getattr(module, name, None)
    try:
        return int(fn()) if fn is not None else 0
    except (RuntimeError, AssertionError):
        return 0


def empty_device_cache(device_module: ModuleType | Any | None = None, *, reason: str,
                       ledger: MemoryLedger | None) -> bool:
    """Return cached allocator blocks to the device and record it in `ledger`. False (and nothing
    done) where the backend has no `empty_cache` or no device is initialised. `device_module`: the
    backend module (`torch.cuda` by default, or any object with the same functions)."""
    if not reason:
        raise ValueError("reason must be a non-empty string")
    module = _device_module(device_module)
    fn = getattr(module, "empty_cache", None) if module is not None else None
    is_available = getattr(module, "is_available", None)
    if fn is None or (is_available is not None and not is_available()):
        return False
    before = _query(module, "memory_reserved")
    start = time.perf_counter()
    fn()
    stall = time.perf_counter() - start
    if ledger is not None:
        ledger.record(ReleaseEvent(reason, stall, before, _query(module, "memory_reserved"),
                                   time.time(), _query(module, "memory_allocated")))
    return True
