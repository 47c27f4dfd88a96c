"""Device memory: pools, radix cache, and the single named release point of the allocator cache."""

from tide.memory.device import available_device_memory, empty_device_cache

__all__ = ["available_device_memory", "empty_device_cache"]
