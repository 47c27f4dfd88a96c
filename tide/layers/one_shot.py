"""One-shot all-reduce for small tensors between the GPUs of one host (sglang's and vLLM's
"custom all-reduce"): the sum a decode step's row-parallel layers need, in one kernel of a few
microseconds, where NCCL's all-reduce of a few KiB costs tens of microseconds inside a CUDA graph.

Each rank owns one device allocation, mapped into every other rank's address space with CUDA IPC:

    [ signals: MAX_BLOCKS x MAX_RANKS int32 | slot 0 | slot 1 | row channel: ROWS_REGION_BYTES ]

Program `b` of the kernel copies its share of the input into this rank's slot, writes its flag into
every peer's signal `[b, rank]` (a release store at system scope), waits until every peer's flag
has reached its own signals `[b, peer]` (acquire loads), then reads the same share from every
rank's slot and adds them in rank order, in fp32. The flag is program `b`'s call count, kept in
this rank's device memory, so a captured graph replays with fresh flags and no host input.

Element `i` is always handled by program `(i // BLOCK) % MAX_BLOCKS` (the programs stride by
`MAX_BLOCKS` chunks whatever the grid), and a call launches only the programs that have a chunk.
Program `b` therefore runs in the same calls on every rank (they sum the same sizes), and its flag
counts those calls: `b`'s `j`-th run on one rank meets `b`'s `j`-th run on the others. Why two
slots are enough: program `b` writes its chunks of slot `j % 2` in its run `j` and can only start
run `j + 2` after every peer's program `b` has signalled run `j + 1`, which it does only after it
finished reading run `j`; no other program touches those chunks. (A stride that followed the grid
would hand a chunk to another program from one call to the next, and break this.) Flags are
compared as `seen - flag >= 0` in int32, so a peer already one run ahead is seen as arrived.

A second channel sums whole rows and then adds the residual and applies RMSNorm in the same launch
(`add_rmsnorm`: a row-parallel projection's partial products, then the next layer's norm, as the
one-shot sum followed by `triton_ops.rmsnorm` would compute them, bit for bit). It is the one a
decode step waits on twice a layer, so it has no flags: each rank writes its rows straight into
every peer's buffer, and the data is its own flag. Its region holds two buffers (by the program's
call count, odd or even) of one slot per source rank; a slot element whose bits are all ones (a
NaN; a row element with those bits is sent as another NaN) is empty. A program
pushes its rows to its peers, then reads each peer's rows in its own buffer until none is empty,
and empties them again at once. Row `r` is always program `r % MAX_BLOCKS`'s (a bs1 decode step
runs one program), and the program runs in the same calls on every rank, so its `j`-th run reads
what the peers' same program wrote in their `j`-th; a peer can be at most one run ahead (its run
`j + 2` needs this rank's push of run `j + 1`, which comes after this rank emptied run `j`'s rows),
so it writes only into the other buffer. That holds while rows keep their addresses, so the channel
serves one row width and dtype, the first it is given (the hidden size, the model dtype), and others
take the plain sum.
Against flags, a call saves the release fence, the flag round trip and the read of the peer's
slot across the link: a row crosses once, as a write.

The sum is the same for an element whatever the tensor's size (rank order, fp32), so it serves the
deterministic mode too. Every rank must call it for the same tensor sizes in the same order, as
for any collective; tensors larger than a slot, or not contiguous, go to NCCL (`fits`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch
import triton
import triton.language as tl

from tide.layers import pdl

logger = logging.getLogger(__name__)

MAX_RANKS = 8
MAX_BLOCKS = 64
BLOCK = 1024
SIGNALS = MAX_BLOCKS * MAX_RANKS  # int32 flags of the plain sum
SIGNAL_BYTES = 4096  # >= SIGNALS * 4
SLOT_BYTES = 8 << 20
ROWS_DATA_OFFSET = SIGNAL_BYTES + 2 * SLOT_BYTES  # the row channel's region, after the sum's slots
ROWS_REGION_BYTES = 32 << 20  # two buffers of one slot per source rank: 8 MiB slots at 2 ranks
BUFFER_BYTES = ROWS_DATA_OFFSET + ROWS_REGION_BYTES
EMPTY_BYTE = 0xFF  # the row channel's empty mark: all bits set (a NaN)
SPIN_LIMIT = 1 << 26  # ~ tens of seconds: a dead peer leaves garbage, never a GPU hung forever
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array reads back cut at its first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    def to_bytes(self) -> bytes:
        return bytes(self.reserved)

    @classmethod
    def from_bytes(cls, raw: bytes) -> _IpcHandle:
        if len(raw) != 64:
            raise ValueError(f"a CUDA IPC handle has 64 bytes, got {len(raw)}")
        return cls.from_buffer_copy(raw)


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (found in this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle,
                                             ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetLastError.argtypes = []
        return lib
    return None


class OneShotAllReduce:
    """The one-shot sum over the ranks of `pg` (one GPU each, this rank's current device);
    built collectively by `create`, which every rank calls."""

    def __init__(self, lib: ctypes.CDLL, rank: int, size: int, device: torch.device, own: int,
                 peers: dict[int, int]) -> None:
        self._lib, self.rank, self.size, self.device = lib, rank, size, device
        self._own, self._peers = own, peers
        bases = [own if r == rank else peers[r] for r in range(size)]
        self._bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self._counters = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device)
        self._row_counters = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device)
        self._row_width: tuple[int, torch.dtype] | None = None  # (width, dtype) the rows keep
        self._row_slot_bytes = row_slot_bytes(size)

    @classmethod
    def create(cls, pg: Any, rank: int, size: int, device: torch.device) -> OneShotAllReduce | None:
        """Collective over `pg`: every rank allocates its buffer and maps its peers'. None on every
        rank (NCCL is used) unless every rank succeeded: peers without peer access, a CUDA
        runtime not found, or more than `MAX_RANKS` ranks."""
        lib = _cudart() if size <= MAX_RANKS else None
        own = ctypes.c_void_p()
        handle = _IpcHandle()
        ok = lib is not None
        if ok:
            ok = all(torch.cuda.can_device_access_peer(device, torch.device("cuda", d))
                     for d in range(torch.cuda.device_count()) if d != device.index)
        if ok and lib is not None:
            ok = (lib.cudaMalloc(ctypes.byref(own), BUFFER_BYTES) == 0
                  and lib.cudaMemset(own, 0, ROWS_DATA_OFFSET) == 0
                  and lib.cudaMemset(ctypes.c_void_p((own.value or 0) + ROWS_DATA_OFFSET),
                                     EMPTY_BYTE, ROWS_REGION_BYTES) == 0
                  and lib.cudaIpcGetMemHandle(ctypes.byref(handle), own) == 0)
            torch.cuda.synchronize(device)
        peers: dict[int, int] = {}
        handles = _all_gather_bytes(pg, size, device, handle.to_bytes(), ok)
        if all(flag for _, flag in handles) and lib is not None:
            for r, (raw, _) in enumerate(handles):
                if r == rank:
                    continue
                ptr = ctypes.c_void_p()
                if lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_bytes(raw),
                                            _IPC_LAZY_ENABLE_PEER_ACCESS) != 0:
                    ok = False
                    break
                peers[r] = int(ptr.value or 0)
        else:
            ok = False
        if lib is not None:
            lib.cudaGetLastError()  # a failed call above must not surface in torch's next check
        agreed = all(flag for _, flag in _all_gather_bytes(pg, size, device, b"", ok))
        result = None
        if agreed and lib is not None:
            result = cls(lib, rank, size, device, int(own.value or 0), peers)
        if result is None:
            if lib is not None:
                for address in peers.values():
                    lib.cudaIpcCloseMemHandle(ctypes.c_void_p(address))
                if own.value:
                    lib.cudaFree(own)
            logger.info("tensor parallel: NCCL all-reduce only (one-shot all-reduce unavailable)")
        return result

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the one-shot kernel (else NCCL); the same on every rank."""
        return x.is_contiguous() and self.fits_numel(x.numel(), x.dtype)

    @staticmethod
    def fits_numel(numel: int, dtype: torch.dtype) -> bool:
        """Whether a contiguous tensor of `numel` elements of `dtype` fits one slot."""
        return dtype in _DTYPES and 0 < numel * dtype.itemsize <= SLOT_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (`fits(x)` must hold); returns `x`."""
        use_pdl = pdl.enabled(x)
        grid = (min(MAX_BLOCKS, triton.cdiv(x.numel(), BLOCK)),)
        _one_shot_kernel[grid](x, x.numel(), self._bases, self._counters, SPIN_LIMIT,
                               RANK=self.rank, WORLD=self.size, BLOCK=BLOCK,
                               DATA_OFFSET=SIGNAL_BYTES, SLOT_ELEMS=SLOT_BYTES // x.element_size(),
                               PROGRAMS=MAX_BLOCKS, USE_PDL=use_pdl, num_warps=4,
                               launch_pdl=use_pdl)
        return x

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `add_rmsnorm(x, residual, ...)` takes the fused kernel: contiguous, a sum's
        dtype, at most one row slot (`row_slot_bytes`), 2-D, a residual of the same shape and
        dtype, and the row width and dtype this channel serves. The same on every rank (they see
        the same shapes in the same order)."""
        return (self.fits(x) and x.numel() * x.element_size() <= self._row_slot_bytes
                and x.dim() == 2 and residual.shape == x.shape
                and residual.dtype == x.dtype and residual.is_contiguous()
                and (x.shape[1], x.dtype) == (self._row_width or (x.shape[1], x.dtype)))

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(s + residual) * weight, s + residual) with s = `x` summed over the ranks, in one
        launch (`fits_rows(x, residual)` must hold). Rounds as the one-shot sum followed by
        `triton_ops.rmsnorm` does: s to the dtype, the residual add in the dtype, the norm in fp32
        rounded before the weight. `x` is left as it was."""
        self._row_width = (x.shape[1], x.dtype)
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        block = triton.next_power_of_2(x.shape[1])
        use_pdl = pdl.enabled(x)
        _one_shot_norm_kernel[(min(MAX_BLOCKS, x.shape[0]),)](
            x, residual, weight, out, res_out, x.shape[0], x.shape[1], eps, self._bases,
            self._row_counters, SPIN_LIMIT, RANK=self.rank, WORLD=self.size, BLOCK=block,
            BITS=tl.int32 if x.element_size() == 4 else tl.int16, DATA_OFFSET=ROWS_DATA_OFFSET,
            SLOT_ELEMS=self._row_slot_bytes // x.element_size(), PROGRAMS=MAX_BLOCKS,
            USE_PDL=use_pdl, num_warps=norm_warps(block), launch_pdl=use_pdl)
        return out, res_out

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after every rank stopped using them)."""
        for ptr in self._peers.values():
            self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
        self._peers = {}
        if self._own:
            self._lib.cudaFree(ctypes.c_void_p(self._own))
            self._own = 0


@triton.jit
def _one_shot_kernel(X, n, Bases, Counters, spin_limit, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr, DATA_OFFSET: tl.constexpr, SLOT_ELEMS: tl.constexpr,
                     PROGRAMS: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may launch and prefetch its weights while the ranks meet
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    step = PROGRAMS * BLOCK
    dtype = X.dtype.element_ty
    flag = tl.load(Counters + pid) + 1
    slot = (flag & 1).to(tl.int64) * SLOT_ELEMS
    own_data = tl.multiple_of((tl.load(Bases + RANK) + DATA_OFFSET).to(tl.pointer_type(dtype)) + slot, 16)
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, step):
        idx = tl.max_contiguous(tl.multiple_of(start + offs, BLOCK), BLOCK)
        tl.store(own_data + idx, tl.load(X + idx, mask=idx < n), mask=idx < n)
    _meet(Bases, pid, flag, spin_limit, RANK, WORLD)
    for start in range(pid * BLOCK, n, step):
        idx = tl.max_contiguous(tl.multiple_of(start + offs, BLOCK), BLOCK)
        mask = idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(X + idx, mask=mask).to(tl.float32)
            else:
                data = tl.multiple_of(
                    (tl.load(Bases + r) + DATA_OFFSET).to(tl.pointer_type(dtype)) + slot, 16)
                acc += tl.load(data + idx, mask=mask, cache_modifier=".cv").to(tl.float32)
        tl.store(X + idx, acc.to(dtype), mask=mask)
    tl.store(Counters + pid, flag)


def row_slot_bytes(world: int) -> int:
    """Bytes of one source rank's slot in one buffer of the row channel."""
    return ROWS_REGION_BYTES // (2 * world)


def norm_warps(block: int) -> int:
    """Warps of a one-row norm launch of `block` columns (`triton_ops.rmsnorm` uses the same, so
    the fused kernel's row sum adds in the same order)."""
    return min(16, max(1, block // 256))


@triton.jit
def _meet(Bases, pid, flag, spin_limit, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `pid` tells every peer it reached call `flag` (its copy is in this rank's slot)
    and waits until every peer's program `pid` has told it the same."""
    tl.debug_barrier()  # every thread's copy is in before the flag goes out
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_signals = tl.load(Bases + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_signals + pid * WORLD + RANK, flag, sem="release", scope="sys")
    own_signals = tl.load(Bases + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(own_signals + pid * WORLD + r, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen - flag < 0) & (spins < spin_limit):
                seen = tl.atomic_add(own_signals + pid * WORLD + r, 0, sem="acquire", scope="sys")
                spins += 1
    tl.debug_barrier()  # no thread reads a peer's slot before its flag was seen


@triton.jit
def _one_shot_norm_kernel(X, R, W, Out, ResOut, n_rows, n_cols, eps, Bases, Counters, spin_limit,
                          RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                          BITS: tl.constexpr, DATA_OFFSET: tl.constexpr, SLOT_ELEMS: tl.constexpr,
                          PROGRAMS: tl.constexpr, USE_PDL: tl.constexpr):
    """The row channel (module docstring): `BITS`, the integer type of the dtype's width, carries
    the rows and the empty mark (-1: all bits set)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    dtype = X.dtype.element_ty
    run = tl.load(Counters + pid) + 1
    buffer = (run & 1).to(tl.int64) * (WORLD * SLOT_ELEMS)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    for row in range(pid, n_rows, PROGRAMS):
        at = row * n_cols + cols  # < SLOT_ELEMS: int32 suffices
        bits = tl.load(X + at, mask=mask).to(BITS, bitcast=True)
        bits = tl.where(bits == -1, bits ^ 1, bits)  # a NaN with the empty mark's bits: another NaN
        for r in tl.static_range(WORLD):
            if r != RANK:
                peer = (tl.load(Bases + r) + DATA_OFFSET).to(tl.pointer_type(BITS))
                tl.store(peer + buffer + RANK * SLOT_ELEMS + at, bits, mask=mask)
    own = (tl.load(Bases + RANK) + DATA_OFFSET).to(tl.pointer_type(BITS)) + buffer
    for row in range(pid, n_rows, PROGRAMS):
        at = row * n_cols + cols  # < SLOT_ELEMS: int32 suffices
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
            else:
                slot = own + r * SLOT_ELEMS + at
                got = tl.load(slot, mask=mask, other=0, volatile=True)
                spins = 0
                while (tl.max((got == -1).to(tl.int32), 0) > 0) & (spins < spin_limit):
                    got = tl.load(slot, mask=mask, other=0, volatile=True)
                    spins += 1
                tl.store(slot, tl.full([BLOCK], -1, BITS), mask=mask)  # empty for run + 2
                acc += got.to(dtype, bitcast=True).to(tl.float32)
        # From here as `triton_ops._rmsnorm_kernel` with a residual: the same roundings.
        x = acc.to(dtype) + tl.load(R + at, mask=mask, other=0.0)
        tl.store(ResOut + at, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        normed = (xf * tl.rsqrt(var + eps)).to(dtype)
        tl.store(Out + at, tl.load(W + cols, mask=mask, other=0.0) * normed, mask=mask)
    tl.store(Counters + pid, run)


def _all_gather_bytes(pg: Any, size: int, device: torch.device, payload: bytes,
                      ok: bool) -> list[tuple[bytes, bool]]:
    """Every rank's (payload, ok), payloads of equal length (at most 64 bytes)."""
    row = torch.zeros(65, dtype=torch.uint8)
    row[0] = int(ok)
    if payload:
        row[1:1 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    local = row.to(device)
    out = torch.empty(size * 65, dtype=torch.uint8, device=device)
    pg._allgather_base(out, local).wait()
    rows = out.view(size, 65).cpu()
    return [(bytes(r[1:].tolist()), bool(r[0])) for r in rows]
