"""Large host buffers for device copies: allocated once, page-locked fast, freed on request.

`HostBuffer(nbytes, pin=True)` is `nbytes` of host memory as one uint8 tensor. Pinned, it is an
anonymous mapping (transparent huge pages asked for), pinned chunk by chunk (`chunks`, 1 GiB each):
a chunk's pages are first touched by torch's intra-op threads in parallel, then the chunk is
registered with the CUDA runtime (`cudaHostRegister`). torch's pinned allocator (`pin_memory=True`:
`cudaHostAlloc`, sizes rounded up to a power of two, pages faulted by one thread) took seconds for
16 GB; here the kernel zeroes pages on many cores and the driver pins huge pages. `pin_chunks()`
pins lazily and yields each chunk as soon as it is pinned, so a caller can start copying into the
first chunks while later ones are still being pinned. A copy must not straddle two chunks (each is
its own registration). A chunk the runtime refuses to register stays pageable (correct, slower; a
warning says so); if the platform has no anonymous mappings, the buffer is one
`torch.empty(..., pin_memory=True)`.

The memory stays taken until `close()` (or until the last view of it is gone): owners keep one buffer
for the lifetime of what they back up and say so in their docs.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context
_HUGE_PAGE = 2 << 20
_TOUCH_STRIDE = 4096  # one write per base page faults every page in (a whole huge page at once)


class HostBuffer:
    """`nbytes` of host memory (`tensor`, uint8), page-locked chunk by chunk when `pin`. Not
    thread-safe."""

    def __init__(self, nbytes: int, pin: bool, chunk_bytes: int = CHUNK_BYTES) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if pin and chunk_bytes % _HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a multiple of {_HUGE_PAGE} to pin, got {chunk_bytes}")
        self.nbytes = nbytes
        self.pinned = pin
        self._capacity = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE  # mapped and registered: whole pages
        self.chunks = [(s, min(nbytes, s + chunk_bytes)) for s in range(0, nbytes, chunk_bytes)]
        self._to_pin: list[int] = []  # chunk indices not pinned yet
        self._registered: list[int] = []  # chunk indices registered with the runtime
        self._map: mmap.mmap | None = None
        self._whole: torch.Tensor | None = None  # the whole mapping (pinned path)
        start = time.perf_counter()
        self.tensor: torch.Tensor | None = None
        if pin:
            self.tensor = self._map_anonymous(nbytes)
            if self.tensor is None:
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                self._to_pin = list(range(len(self.chunks)))
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.alloc_s = time.perf_counter() - start  # grows as chunks are pinned

    def _map_anonymous(self, nbytes: int) -> torch.Tensor | None:
        try:
            mapping = mmap.mmap(-1, self._capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: no MAP_ANONYMOUS
            logger.warning("anonymous mapping of %d bytes failed (%s); using pin_memory", nbytes, e)
            return None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # huge pages are an optimisation
        self._map = mapping
        self._whole = torch.frombuffer(mapping, dtype=torch.uint8)
        return self._whole[:nbytes]

    def _pin(self, index: int) -> None:
        assert self._whole is not None  # open, mapped
        start = time.perf_counter()
        lo, hi = self.chunks[index]
        if index == len(self.chunks) - 1:
            hi = self._capacity  # up to the end of the last page
        piece = self._whole[lo:hi]
        piece[::_TOUCH_STRIDE].fill_(0)  # fault every page in, on torch's intra-op threads
        err = int(torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), hi - lo,
                                                       _REGISTER_PORTABLE))
        if err == 0:
            self._registered.append(index)
        else:
            logger.warning("cudaHostRegister of %d bytes failed (error %d); that part of the host "
                           "buffer stays pageable (slower copies)", hi - lo, err)
        self.alloc_s += time.perf_counter() - start

    @property
    def registered(self) -> bool:
        """Every chunk is registered with the CUDA runtime (False for the pin_memory fallback)."""
        return self._map is not None and len(self._registered) == len(self.chunks)

    def pin_chunks(self) -> Iterator[tuple[int, int]]:
        """Each chunk's byte range [start, end), in order, once it is pinned (pinning it now if
        needed)."""
        for index, chunk in enumerate(self.chunks):
            if index in self._to_pin:
                self._pin(index)
                self._to_pin.remove(index)
            yield chunk

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
        if self._whole is not None:
            for index in self._registered:
                torch.cuda.cudart().cudaHostUnregister(self._whole[self.chunks[index][0]:].data_ptr())
        self._registered = []
        self._to_pin = []
        self.tensor = self._whole = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view still exists: the mapping closes with its last reference
            self._map = None
