"""Large host buffers for device copies: allocated once, page-locked fast, freed on request.

`HostBuffer(nbytes, pin=True)` is `nbytes` of host memory as one uint8 tensor. Pinned, it is an
anonymous mapping (transparent huge pages asked for) whose pages are first touched by torch's
intra-op threads in parallel and then registered with the CUDA runtime (`cudaHostRegister`). torch's
pinned allocator (`pin_memory=True`: `cudaHostAlloc`, sizes rounded up to a power of two, pages
faulted by one thread) took seconds for 16 GB; this way the kernel zeroes the pages on many cores and
the driver pins a few thousand huge pages. Where registering fails the buffer falls back to
`torch.empty(..., pin_memory=True)` (`registered` says which).

The memory stays taken until `close()` (or until the last view of it is gone): owners keep one buffer
for the lifetime of what they back up and say so in their docs.
"""

from __future__ import annotations

import logging
import mmap
import time

import torch

logger = logging.getLogger(__name__)

_TOUCH_STRIDE = 4096  # one write per base page faults every page in (a whole huge page at once)


class HostBuffer:
    """`nbytes` of host memory (`tensor`, uint8), page-locked when `pin`. Not thread-safe."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.nbytes = nbytes
        self.pinned = False
        self.registered = False
        self._map: mmap.mmap | None = None
        start = time.perf_counter()
        if not pin:
            self.tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8)
        else:
            self.tensor = self._register(nbytes)
            if self.tensor is None:
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.pinned = True
        self.alloc_s = time.perf_counter() - start
        logger.info("host buffer of %.2f GB in %.2f s (%s)", nbytes / 1e9, self.alloc_s,
                    "registered" if self.registered else "pinned" if pin else "pageable")

    def _register(self, nbytes: int) -> torch.Tensor | None:
        """A registered anonymous mapping, or None where the platform refuses it."""
        try:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: no MAP_ANONYMOUS
            logger.warning("anonymous mapping of %d bytes failed (%s); using pin_memory", nbytes, e)
            return None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # huge pages are an optimisation
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        tensor[::_TOUCH_STRIDE].fill_(0)  # fault every page in, on torch's intra-op threads
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of %d bytes failed (error %s); using pin_memory",
                           nbytes, int(err))
            del tensor
            mapping.close()
            return None
        self._map = mapping
        self.registered = True
        return tensor

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime may be gone
            pass

    @property
    def closed(self) -> bool:
        return self.tensor is None

    def close(self) -> None:
        """Unpin and drop the memory. Views handed out earlier must be dropped by their owners; the
        mapping goes back to the system once the last of them is gone."""
        if self.tensor is None:
            return
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view still exists: the mapping closes with its last reference
            self._map = None
