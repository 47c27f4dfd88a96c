"""The engine side of a distributed weight update: receive rank 0's broadcasts, write the parameters.

`BroadcastReceiver` takes one update's broadcasts in order. A tensor whose destination rows are
contiguous memory on the group's device is received straight into them; anything else lands in a
receive buffer and is copied out. A flattened dtype buffer arrives in the pieces the group agreed on
(`WeightUpdateGroup.pieces`), alternately into two buffers of one piece each, and `piece_copies` maps
every piece onto the parameters it covers (a tensor may straddle two pieces). A piece whose tensors
lie back to back in one storage, in the trainer's order and dtype, is received straight into them
instead: with `enable_memory_saver` the parameters are one region in module order (gaps only where
a tensor's size is not a multiple of the region's 256-byte alignment), and a trainer that flattens
its model's parameters in module order sends exactly that layout (q/k/v rows follow each other as
in the fused parameter), so such an update copies nothing. Without tensor parallelism only: a rank
keeping parts receives into buffers.

With NCCL the broadcasts are queued on a receive stream and the copies on a copy stream: the copy of
piece i (after an event that marks its arrival) runs while piece i+1 arrives in the other buffer, and
the receive stream waits for the copy of piece i before piece i+2 reuses its buffer. Both streams start
behind the work already queued on the current stream; `finish()` waits for these two streams only.
With gloo everything runs in order on the host.

Under tensor parallelism a rank keeps part of most tensors (`PartDest`): the tensor arrives whole and
only the part is copied out, as soon as it has arrived. In the flattened form a row part is a range of
the flat buffer and is copied straight from the pieces; a column part (strided) is assembled in a
staging tensor of its own, allocated when its first piece arrives and copied out after its last, so
one or two tensors are staged at a time, not the whole update.

Atomicity is the caller's: it validates the whole update first and passes `None` destinations for an
update that failed validation, so every broadcast is still drained and nothing is written.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tide.weights.distributed import UpdateHeader, WeightUpdateGroup


@dataclass(frozen=True, eq=False)
class PartDest:
    """A tensor of `shape` this rank keeps part of: `narrow(dim, start, size)` of it is written into
    `rows` (this rank's parameter memory, of the part's shape)."""

    rows: torch.Tensor
    shape: tuple[int, ...]
    dim: int
    start: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.shape) or not (
                0 <= self.start and self.start + self.size <= self.shape[self.dim]):
            raise ValueError(f"part (dim {self.dim}, start {self.start}, size {self.size}) is "
                             f"outside a tensor of shape {self.shape}")
        part = (*self.shape[: self.dim], self.size, *self.shape[self.dim + 1 :])
        if tuple(self.rows.shape) != part:
            raise ValueError(f"rows of shape {tuple(self.rows.shape)} cannot hold a part of "
                             f"shape {part}")

    def part(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.view(self.shape).narrow(self.dim, self.start, self.size)


Dest = torch.Tensor | PartDest | None


@dataclass(frozen=True)
class PieceCopy:
    """Elements [src_start, src_end) of a received piece are elements [dst_start, ...) of tensor
    `index` (flattened)."""

    index: int
    src_start: int
    src_end: int
    dst_start: int


def piece_copies(numels: Sequence[int], pieces: Sequence[tuple[int, int]]) -> list[list[PieceCopy]]:
    """For each piece [start, end) of the concatenation of tensors of `numels` elements, the parts of
    those tensors it holds, in order. Every element of every tensor is covered exactly once."""
    out: list[list[PieceCopy]] = []
    index, tensor_start = 0, 0
    for start, end in pieces:
        copies: list[PieceCopy] = []
        while index < len(numels) and tensor_start < end:
            tensor_end = tensor_start + numels[index]
            lo, hi = max(start, tensor_start), min(end, tensor_end)
            if hi > lo:
                copies.append(PieceCopy(index, lo - start, hi - start, lo - tensor_start))
            if tensor_end > end:
                break  # the rest of this tensor is in the next piece
            index, tensor_start = index + 1, tensor_end
        out.append(copies)
    return out


class BroadcastReceiver:
    """One update's receiving side (module docstring). Call `finish()` when done, also on error."""

    def __init__(self, group: WeightUpdateGroup,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None) -> None:
        """`streams`: the (receive, copy) streams on the group's CUDA device. Pass the same pair to
        every update: the caching allocator keeps freed receive buffers per stream, so new streams
        on every call would strand the previous calls' buffers in its cache."""
        self.group = group
        self.device = group.device
        self.cuda = self.device.type == "cuda"
        self.buffers_allocated = 0  # receive buffers taken so far (tests read it)
        self.pieces_in_place = 0  # flattened pieces received straight into parameter memory
        self._recv: torch.cuda.Stream | None = None
        self._copy: torch.cuda.Stream | None = None
        if self.cuda:
            if streams is None:
                streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
            self._recv, self._copy = streams
            current = torch.cuda.current_stream(self.device)
            self._recv.wait_stream(current)  # nothing in flight still reads the old weights
            self._copy.wait_stream(current)

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.buffers_allocated += 1
        with self._on(self._recv):
            buf = torch.empty(numel, dtype=dtype, device=self.device)
        if self._copy is not None:
            buf.record_stream(self._copy)  # not handed out again before the copy stream read it
        return buf

    def receive_header(self) -> UpdateHeader:
        """The update's header (`WeightUpdateGroup.receive_update_header`), on the receive
        stream (the host waits for it)."""
        with self._on(self._recv):
            return self.group.receive_update_header()

    def drain(self, header: UpdateHeader) -> None:
        """Receive everything `header` announces into scratch memory, writing nothing."""
        if header.flattened:
            for numel, dtype in header.items:
                self.receive_flattened(dtype, [(None, numel)])
        else:
            self.receive_tensors([((numel,), dtype, None) for numel, dtype in header.items])

    def _receive(self, tensor: torch.Tensor) -> None:
        with self._on(self._recv):
            self.group.broadcast(tensor)

    def _copy_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """dst.copy_(src) for each pair once what was received so far has arrived; the event marks
        the copies' end (None on the host path, where they are done on return)."""
        if self._copy is None or self._recv is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        arrived = torch.cuda.Event()
        arrived.record(self._recv)
        with torch.cuda.stream(self._copy):
            self._copy.wait_event(arrived)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy)
        return done

    def receive_tensors(self, items: Sequence[tuple[tuple[int, ...], torch.dtype, Dest]]) -> None:
        """One broadcast per (shape, dtype, destination or None: drained) in order, in the NCCL
        groups the group agreed (`WeightUpdateGroup.broadcast_many`). A contiguous destination
        on the group's device receives directly; others (and parts) go through a buffer, copied
        out once their group has arrived."""
        step = max(1, self.group.coalesce_tensors) if self.cuda else 1
        for first in range(0, len(items), step):
            targets: list[torch.Tensor] = []
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            for shape, dtype, dest in items[first:first + step]:
                if (isinstance(dest, torch.Tensor) and dest.is_contiguous()
                        and dest.device == self.device):
                    targets.append(dest)  # straight into the parameter's rows
                    continue
                buf = self._buffer(math.prod(shape), dtype).view(shape)
                targets.append(buf)
                if isinstance(dest, PartDest):
                    pairs.append((dest.rows, dest.part(buf)))
                elif dest is not None:
                    pairs.append((dest, buf))
            with self._on(self._recv):
                self.group.broadcast_many(targets)
            if pairs:
                self._copy_out(pairs)

    def receive_flattened(self, dtype: torch.dtype, items: Sequence[tuple[Dest, int]]) -> None:
        """One dtype's flat buffer: `items` are (destination or None, numel) in the trainer's order."""
        numels = [n for _, n in items]
        pieces = self.group.pieces(sum(numels), torch.empty((), dtype=dtype).element_size())
        # Elements [lows[i], lows[i] + flats[i].numel()) of tensor i go to flats[i]; a destination
        # that is not such a range (a column part, non-contiguous memory) is staged whole
        # (`parts`), one tensor at a time, and written once its last piece has arrived.
        flats: list[torch.Tensor | None] = []
        lows: list[int] = []
        parts: dict[int, PartDest] = {}
        stages: dict[int, torch.Tensor] = {}
        for i, (dest, numel) in enumerate(items):
            low, flat = 0, None
            if isinstance(dest, torch.Tensor) and not dest.is_contiguous():
                dest = PartDest(dest, tuple(dest.shape), 0, 0, dest.shape[0])  # all of it
            if isinstance(dest, PartDest):
                if dest.dim == 0 and dest.rows.is_contiguous():  # rows: a range of the tensor
                    low, flat = dest.start * (numel // max(1, dest.shape[0])), dest.rows.view(-1)
                else:
                    parts[i] = dest
            elif dest is not None:
                flat = dest.view(-1)
            flats.append(flat)
            lows.append(low)
        size = max(end - start for start, end in pieces)
        buffers: list[torch.Tensor | None] = [None] * min(2, len(pieces))  # taken on first use
        released: list[torch.cuda.Event | None] = [None] * len(buffers)
        buffered = 0  # pieces received into a buffer so far: they alternate between the two
        for (start, end), copies in zip(pieces, piece_copies(numels, pieces)):
            # (destination memory, [lo, hi) of this piece) for whole ranges of parameters; a
            # piece that also feeds a staged part or a drained tensor is never received in place.
            spans: list[tuple[torch.Tensor, int, int]] = []
            in_place = True
            for c in copies:
                flat = flats[c.index]
                if c.index in parts or flat is None:
                    in_place = False
                    continue
                count = c.src_end - c.src_start
                lo = max(c.dst_start, lows[c.index])
                hi = min(c.dst_start + count, lows[c.index] + flat.numel())
                if hi > lo:
                    skip = lo - c.dst_start
                    spans.append((flat[lo - lows[c.index] : hi - lows[c.index]],
                                  c.src_start + skip, c.src_start + skip + hi - lo))
                if hi - lo != count:
                    in_place = False  # elements this rank does not keep
            direct = _one_run(spans, end - start, self.device, dtype) if in_place else None
            if direct is not None:
                self._receive(direct)  # straight into the parameters: nothing to copy
                self.pieces_in_place += 1
                continue
            slot = buffered % len(buffers)
            buffered += 1
            wait = released[slot]
            if wait is not None and self._recv is not None:
                self._recv.wait_event(wait)  # the copy out of this buffer's last piece is done
            whole = buffers[slot]
            if whole is None:
                whole = buffers[slot] = self._buffer(size, dtype)
            buf = whole[: end - start]
            self._receive(buf)
            pairs = [(dst, buf[lo:hi]) for dst, lo, hi in spans]
            for c in copies:
                part = parts.get(c.index)
                if part is None:
                    continue
                count = c.src_end - c.src_start
                stage = stages.get(c.index)
                if stage is None:
                    with self._on(self._copy):
                        stage = torch.empty(numels[c.index], dtype=dtype, device=self.device)
                    stages[c.index] = stage
                pairs.append((stage[c.dst_start : c.dst_start + count],
                              buf[c.src_start : c.src_end]))
                if c.dst_start + count == numels[c.index]:  # its last elements
                    pairs.append((part.rows, part.part(stages.pop(c.index))))
            if pairs:
                released[slot] = self._copy_out(pairs)

    def finish(self) -> None:
        """Wait (host) until every broadcast has arrived and every copy is done."""
        if self._recv is not None and self._copy is not None:
            self._copy.synchronize()
            self._recv.synchronize()


def back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` are contiguous, of one dtype, in one storage, each starting where the one
    before it ends (as parameters allocated in one region in module order are)."""
    if not tensors:
        return False
    storage = tensors[0].untyped_storage().data_ptr()
    return all(t.is_contiguous() and t.dtype == tensors[0].dtype
               and t.untyped_storage().data_ptr() == storage for t in tensors) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        for a, b in zip(tensors, tensors[1:]))


def _one_run(spans: Sequence[tuple[torch.Tensor, int, int]], length: int,
             device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """One tensor over the memory of `spans` (destination, [lo, hi) of a piece of `length`
    elements) when they cover the piece in order and lie `back_to_back`, as the parameters do when
    they were allocated in one region (`enable_memory_saver`) and the trainer flattened them in the
    model's order, on the group's `device` and of the piece's `dtype`; else None."""
    if not spans or spans[0][1] != 0 or spans[-1][2] != length or spans[0][0].device != device:
        return None
    if spans[0][0].dtype != dtype:
        return None  # a copy converts; a broadcast into the memory would not
    if any(b_lo != a_hi for (_, _, a_hi), (_, b_lo, _) in zip(spans, spans[1:])):
        return None
    dests = [dst for dst, _, _ in spans]
    if not back_to_back(dests):
        return None
    first = dests[0]
    storage = first.untyped_storage()
    offset = (first.data_ptr() - storage.data_ptr()) // first.element_size()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, offset, (length,), (1,))
