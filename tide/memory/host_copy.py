"""Small host lists onto the device without waiting for it."""

from __future__ import annotations

import torch


def device_tensor(values: list[int] | list[float], dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without its stream sync: torch copies a
    list to a CUDA device blocking (it waits for all queued work), which would stall the overlap
    schedule once per call. On CUDA the values go through pinned host memory and an asynchronous
    copy (the caching host allocator keeps the buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
