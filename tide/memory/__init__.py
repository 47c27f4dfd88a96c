"""Device memory: pools, radix cache, memory occupation, and the allocator's named release points.

`release.py` holds the one function that empties an allocator cache, `observe.py` reads memory
without changing it, and `ledger.py` is the per-engine timeline of release points and lifecycle marks.
"""

from tide.memory.ledger import MemoryLedger
from tide.memory.observe import available_device_memory, device_memory_stats
from tide.memory.release import empty_device_cache

__all__ = ["MemoryLedger", "available_device_memory", "device_memory_stats", "empty_device_cache"]
