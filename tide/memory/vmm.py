"""Device memory whose physical pages can be given back and taken again at the same address.

A `VmmRegion` reserves a virtual address range once, backs it with a physical allocation, and hands
out tensors that view it. `unmap()` frees the physical memory (the tensors stay, pointing at an
unmapped range: nothing may touch them); `remap()` creates new physical memory at the same address, so
every pointer captured in a CUDA graph is valid again. Uses the CUDA driver's virtual memory API
through `cuda.bindings` (present on the GPU hosts).
"""

from __future__ import annotations

from typing import Any

import torch

_ALIGN = 256


def vmm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _check(result: Any) -> Any:
    """Unpack a cuda.bindings result tuple `(CUresult, *values)`; raise on an error code."""
    from cuda.bindings import driver as cu

    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else (rest or None)


class _ArrayView:
    """Exposes raw device memory to `torch.as_tensor` (zero copy) via __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int, owner: "VmmRegion") -> None:
        self.owner = owner  # keeps the region alive while any tensor views it
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


class VmmRegion:
    def __init__(self, nbytes: int, device: torch.device) -> None:
        from cuda.bindings import driver as cu

        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        gran = _check(cu.cuMemGetAllocationGranularity(
            self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.size = max(int(gran), -(-nbytes // int(gran)) * int(gran))
        self._ptr = _check(cu.cuMemAddressReserve(self.size, 0, 0, 0))
        self.ptr = int(self._ptr)
        self._handle: Any = None
        self._offset = 0
        self.remap()
        self._bytes = torch.as_tensor(_ArrayView(self.ptr, self.size, self), device=device)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    @property
    def used(self) -> int:
        """Bytes handed out by `tensor()` so far (alignment gaps included)."""
        return self._offset

    def used_bytes(self) -> torch.Tensor:
        """The used part of the region as one uint8 tensor (valid while mapped)."""
        return self._bytes[: self._offset]

    def remap(self) -> None:
        """Back the address range with new physical memory (contents undefined)."""
        from cuda.bindings import driver as cu

        if self._handle is not None:
            return
        if self._ptr is None:
            raise RuntimeError("the region was freed")
        self._handle = _check(cu.cuMemCreate(self.size, self._prop, 0))
        _check(cu.cuMemMap(self._ptr, self.size, 0, self._handle, 0))
        access = cu.CUmemAccessDesc()
        access.location = self._prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(self._ptr, self.size, [access], 1))

    def unmap(self) -> None:
        """Give the physical memory back; the addresses stay reserved."""
        from cuda.bindings import driver as cu

        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        _check(cu.cuMemUnmap(self._ptr, self.size))
        _check(cu.cuMemRelease(self._handle))
        self._handle = None

    def free(self) -> None:
        """Unmap the physical memory and give the address range back (engine shutdown). Every
        tensor viewing the region is invalid afterwards; `remap()` is refused."""
        from cuda.bindings import driver as cu

        if self._ptr is None:
            return
        self.unmap()
        _check(cu.cuMemAddressFree(self._ptr, self.size))
        self._ptr = None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next aligned piece of the region as a tensor of `shape`/`dtype`."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        start = -(-self._offset // _ALIGN) * _ALIGN
        if start + nbytes > self.size:
            raise RuntimeError("VmmRegion is full")
        self._offset = start + nbytes
        return self._bytes[start : start + nbytes].view(dtype).view(shape)


def region_nbytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    total = 0
    for shape, dtype in shapes:
        numel = 1
        for d in shape:
            numel *= d
        total = -(-total // _ALIGN) * _ALIGN + numel * dtype.itemsize
    return total
