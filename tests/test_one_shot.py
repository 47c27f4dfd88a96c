"""The one-shot all-reduce kernel (`tide.layers.one_shot`) on CPU: run by Triton's interpreter as
rank 0 of two, against a peer whose copy and flag are already in place (its slot and rank 0's
signal written as the peer's kernel would), and compiled for sm_90 without a GPU. The two-GPU run,
with NCCL as the reference and inside CUDA graphs, is in tests/test_tp_gpu.py.

The interpreter must be chosen before triton is imported, so a plain pytest run executes this file
again in a subprocess with `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import INTERPRETED, interpreted, rerun_under_interpreter

triton = pytest.importorskip("triton")


def test_kernel_under_the_interpreter():
    rerun_under_interpreter(__file__)


class _Ranks:
    """Rank 0's and its peer's allocations: signals, two slots of `slot` elements for the plain
    sum, then the row channel's two buffers of one `slot`-element slot per rank, empty (all bits
    set) as `OneShotAllReduce.create` leaves them."""

    def __init__(self, dtype: torch.dtype, slot: int) -> None:
        from tide.layers import one_shot

        self.m, self.dtype, self.slot = one_shot, dtype, slot
        self.es = torch.tensor([], dtype=dtype).element_size()
        self.bits = {2: torch.int16, 4: torch.int32}[self.es]
        self.rows_offset = one_shot.SIGNAL_BYTES + 2 * slot * self.es
        self.own = torch.zeros(self.rows_offset + 4 * slot * self.es, dtype=torch.uint8)
        self.own[self.rows_offset:] = one_shot.EMPTY_BYTE
        self.peer = self.own.clone()
        self.bases = torch.tensor([self.own.data_ptr(), self.peer.data_ptr()], dtype=torch.int64)
        self.counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)
        self.row_counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)

    def data(self, buf: torch.Tensor, flag: int, n: int) -> torch.Tensor:
        start = self.m.SIGNAL_BYTES + (flag & 1) * self.slot * self.es
        return buf[start:start + n * self.es].view(self.dtype)

    def row_slot(self, buf: torch.Tensor, run: int, source: int, n: int) -> torch.Tensor:
        """The row channel's slot of `source` in buffer `run % 2` of `buf`, as raw bits."""
        start = self.rows_offset + ((run & 1) * 2 + source) * self.slot * self.es
        return buf[start:start + n * self.es].view(self.bits)

    def signals(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:self.m.SIGNAL_BYTES].view(torch.int32)[:self.m.SIGNALS]

    def peer_arrives(self, y: torch.Tensor, flag: int, programs: int) -> None:
        self.data(self.peer, flag, y.numel()).copy_(y.reshape(-1))
        for b in range(programs):
            self.signals(self.own)[b * 2 + 1] = flag

    def peer_pushes_rows(self, y: torch.Tensor, run: int) -> None:
        """What the peer's kernel does in its run `run`: its rows into rank 0's buffer."""
        self.row_slot(self.own, run, 1, y.numel()).copy_(y.reshape(-1).view(self.bits))

    def run_rows(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                 spin_limit: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        block = triton.next_power_of_2(x.shape[1])
        self.m._one_shot_norm_kernel[(min(self.m.MAX_BLOCKS, x.shape[0]),)](
            x, r, w, out, res_out, x.shape[0], x.shape[1], eps, self.bases, self.row_counters,
            spin_limit, RANK=0, WORLD=2, BLOCK=block,
            BITS=triton.language.int32 if self.es == 4 else triton.language.int16,
            DATA_OFFSET=self.rows_offset, SLOT_ELEMS=self.slot, PROGRAMS=self.m.MAX_BLOCKS,
            USE_PDL=False, num_warps=self.m.norm_warps(block))
        return out, res_out

    def run(self, x: torch.Tensor, spin_limit: int = 1000) -> int:
        """One call, with the grid `OneShotAllReduce` launches: the programs that have a chunk."""
        programs = min(self.m.MAX_BLOCKS, -(-x.numel() // self.m.BLOCK))
        self.m._one_shot_kernel[(programs,)](
            x, x.numel(), self.bases, self.counters, spin_limit, RANK=0, WORLD=2,
            BLOCK=self.m.BLOCK, DATA_OFFSET=self.m.SIGNAL_BYTES, SLOT_ELEMS=self.slot,
            PROGRAMS=self.m.MAX_BLOCKS, USE_PDL=False)
        return programs


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_calls_sum_in_rank_order_through_alternating_slots(dtype):
    n = 3000
    ranks = _Ranks(dtype, slot=4096)
    programs = 3  # those with a chunk of 1024; the other programs are not launched
    for flag in (1, 2):
        torch.manual_seed(flag)
        x, y = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        ranks.peer_arrives(y, flag, programs)
        got = x.clone()
        ranks.run(got)
        assert torch.equal(got, (x.float() + y.float()).to(dtype))
        assert torch.equal(ranks.data(ranks.own, flag, n), x)  # this rank's copy, in slot flag % 2
        rest = ranks.m.MAX_BLOCKS - programs
        assert ranks.counters.tolist() == [flag] * programs + [0] * rest
        peer_signals = ranks.signals(ranks.peer)
        assert [int(peer_signals[b * 2]) for b in range(ranks.m.MAX_BLOCKS)] == (
            [flag] * programs + [0] * rest)


@interpreted
def test_a_program_counts_only_the_calls_that_give_it_a_chunk():
    """Calls of 5, 1 and 3 chunks: program 0 runs three times, programs 1-2 twice, 3-4 once. Each
    program takes the slot its own count picks and meets the peer's same program at the same
    count, so each call's sum is right although the programs' counts part."""
    block = 1024
    ranks = _Ranks(torch.float32, slot=8 * block)
    for call, chunks in enumerate((5, 1, 3)):
        n = chunks * block
        x, y = torch.full((n,), float(call)), torch.arange(n, dtype=torch.float32)
        for c in range(chunks):  # the peer's program c: its chunk into its slot, then its flag
            flag = int(ranks.counters[c]) + 1
            ranks.data(ranks.peer, flag, n)[c * block:(c + 1) * block].copy_(
                y[c * block:(c + 1) * block])
            ranks.signals(ranks.own)[c * 2 + 1] = flag
        assert ranks.run(x) == chunks
        assert torch.equal(x, y + call), call
    assert ranks.counters[:6].tolist() == [3, 2, 2, 1, 1, 0]


def _norm_reference(x, y, r, w, eps):
    summed = (x.float() + y.float()).to(x.dtype) + r
    sf = summed.float()
    return w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), summed


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_are_summed_added_and_normed_on_their_own_channel(dtype):
    """The fused kernel: rank order sum rounded to the dtype, the residual added in the dtype (the
    residual output exactly), RMSNorm of that. The rows go to the peer's buffer of the run's
    parity, the peer's rows are read from this rank's and emptied at once; the plain sum's flags,
    slots and counters do not move, so calls of the two kinds may interleave."""
    rows, width, eps = 70, 96, 1e-6  # more rows than programs: program 0..5 take two
    ranks = _Ranks(dtype, slot=8192)
    programs = ranks.m.MAX_BLOCKS
    n = rows * width
    torch.manual_seed(0)
    w = (torch.rand(width) + 0.5).to(dtype)
    for run in (1, 2, 3):
        x, y, r = (torch.randn(rows, width).to(dtype) for _ in range(3))
        ranks.peer_pushes_rows(y, run)
        out, res_out = ranks.run_rows(x, r, w, eps)
        ref, summed = _norm_reference(x, y, r, w, eps)
        assert torch.equal(res_out, summed)
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        pushed = ranks.row_slot(ranks.peer, run, 0, n)
        assert torch.equal(pushed.view(dtype).view_as(x), x)
        assert bool((ranks.row_slot(ranks.own, run, 1, n) == -1).all()), "read rows stay full"
        pushed.fill_(-1)  # the peer read them
        assert bool((ranks.own[ranks.rows_offset:].view(ranks.bits) == -1).all())
        assert bool((ranks.peer[ranks.rows_offset:].view(ranks.bits) == -1).all())
        assert ranks.row_counters.tolist() == [run] * programs
        assert ranks.counters.tolist() == [0] * programs  # the plain channel never moved
        assert ranks.signals(ranks.peer).tolist() == [0] * ranks.m.SIGNALS


@interpreted
def test_a_peer_a_run_ahead_writes_the_other_row_buffer():
    """The peer finished run 1 and pushed run 2's rows before this rank runs 1: run 1 reads
    buffer 1 only, and run 2 then finds its rows in buffer 0."""
    ranks = _Ranks(torch.float32, slot=1024)
    w, r = torch.ones(1, 64), torch.zeros(1, 64)
    first, second = torch.full((1, 64), 1.0), torch.full((1, 64), 2.0)
    ranks.peer_pushes_rows(first, 1)
    ranks.peer_pushes_rows(second, 2)
    _, res1 = ranks.run_rows(torch.full((1, 64), 10.0), r, w, 1e-6)
    assert torch.equal(res1, torch.full((1, 64), 11.0))
    assert torch.equal(ranks.row_slot(ranks.own, 2, 1, 64).view(torch.float32), second.view(-1))
    _, res2 = ranks.run_rows(torch.full((1, 64), 20.0), r, w, 1e-6)
    assert torch.equal(res2, torch.full((1, 64), 22.0))


@interpreted
def test_a_row_element_with_the_empty_bits_is_sent_as_another_nan():
    ranks = _Ranks(torch.float16, slot=1024)
    x = torch.zeros(1, 8, dtype=torch.float16)
    x.view(torch.int16)[0, 3] = -1  # a NaN whose bits are the empty mark
    ranks.peer_pushes_rows(torch.ones(1, 8, dtype=torch.float16), 1)
    _, res = ranks.run_rows(x, torch.zeros_like(x), torch.ones(8, dtype=torch.float16), 1e-6)
    pushed = ranks.row_slot(ranks.peer, 1, 0, 8)
    assert int(pushed[3]) != -1 and torch.isnan(pushed.view(torch.float16)[3])
    assert torch.equal(pushed[[0, 1, 2, 4, 5, 6, 7]], x.view(torch.int16)[0, [0, 1, 2, 4, 5, 6, 7]])
    assert torch.isnan(res[0, 3]) and torch.equal(res[0, :3], torch.ones(3, dtype=torch.float16))


@interpreted
def test_a_missing_peer_row_ends_the_wait_at_the_spin_limit():
    ranks = _Ranks(torch.float32, slot=1024)
    x = torch.ones(1, 16)
    ranks.row_slot(ranks.own, 1, 1, 16)[:15] = 0  # one element never arrives
    ranks.run_rows(x, torch.zeros_like(x), torch.ones(16), 1e-6, spin_limit=5)
    assert ranks.row_counters[0].item() == 1


def _row_rank(rank: int, world: int, bases: torch.Tensor, calls: list, w: torch.Tensor,
              results: list, slot: int, sleepy: int) -> None:
    """One forked rank of `test_every_rank_of_two_to_four_gets_every_call_s_sum`."""
    import random
    import time

    from tide.layers import one_shot

    counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)
    delays = random.Random(rank)
    for c, (xs, r) in enumerate(calls):
        if rank == sleepy and delays.random() < 0.5:
            time.sleep(0.02)  # the others run ahead into the other buffer
        x = xs[rank]
        width = x.shape[1]
        one_shot._one_shot_norm_kernel[(min(one_shot.MAX_BLOCKS, x.shape[0]),)](
            x, r, w, torch.empty_like(x), results[rank][c], x.shape[0], width, 1e-6, bases,
            counters, 10**7, RANK=rank, WORLD=world, BLOCK=triton.next_power_of_2(width),
            BITS=triton.language.int32 if x.element_size() == 4 else triton.language.int16,
            DATA_OFFSET=0, SLOT_ELEMS=slot, PROGRAMS=one_shot.MAX_BLOCKS, USE_PDL=False,
            num_warps=1)


@interpreted
@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (4, torch.float32)])
def test_every_rank_of_two_to_four_gets_every_call_s_sum(world, dtype):
    """The row channel's protocol with real concurrency: `world` forked processes, each a rank
    running the interpreted kernel over shared buffers, one of them sleeping at random. Every rank
    gets every call's sum in rank order plus the residual, and every buffer ends empty. (fp32
    only: the interpreter may tear a 2-byte element that another process writes while it loads
    it, which a GPU never does; 16-bit rows are covered by tests/test_tp_gpu.py.)"""
    import multiprocessing

    from tide.layers import one_shot

    slot, width = 8192, 96
    bufs = [torch.full((2 * world * slot * dtype.itemsize,), one_shot.EMPTY_BYTE,
                       dtype=torch.uint8).share_memory_() for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    torch.manual_seed(0)
    w = (torch.rand(width) + 0.5).to(dtype)
    calls = [([torch.randn(rows, width).to(dtype) for _ in range(world)],
              torch.randn(rows, width).to(dtype)) for rows in (2, 1, 70, 1, 64, 3, 80)]
    results = [[torch.zeros(len(r), width, dtype=dtype).share_memory_() for _, r in calls]
               for _ in range(world)]
    ctx = multiprocessing.get_context("fork")  # the buffers keep their addresses in the children
    procs = [ctx.Process(target=_row_rank, args=(k, world, bases, calls, w, results, slot, 1))
             for k in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * world
    for c, (xs, r) in enumerate(calls):
        total = xs[0].float()
        for x in xs[1:]:
            total = total + x.float()
        want = total.to(dtype) + r
        assert all(torch.equal(results[k][c], want) for k in range(world)), c
    assert all(bool((b == one_shot.EMPTY_BYTE).all()) for b in bufs)


@interpreted
def test_a_peer_a_call_ahead_counts_as_arrived():
    ranks = _Ranks(torch.float32, slot=2048)
    x, y = torch.ones(100), torch.full((100,), 2.0)
    ranks.data(ranks.peer, 1, 100).copy_(y)
    for b in range(ranks.m.MAX_BLOCKS):  # the peer signalled call 2 already: call 1's data is in
        ranks.signals(ranks.own)[b * 2 + 1] = 2
    ranks.run(x)
    assert torch.equal(x, torch.full((100,), 3.0))


@interpreted
def test_an_absent_peer_ends_the_wait_at_the_spin_limit():
    ranks = _Ranks(torch.float32, slot=2048)
    x = torch.ones(10)
    ranks.run(x, spin_limit=5)  # returns instead of hanging; the sum is meaningless
    assert ranks.counters[0].item() == 1


def test_kernel_compiles_for_hopper():
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    from tide.layers import one_shot
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = one_shot._one_shot_kernel
    for ty, elems in (("*bf16", 4 << 20), ("*fp32", 2 << 20)):
        sig = {"X": ty, "n": "i32", "Bases": "*i64", "Counters": "*i32", "spin_limit": "i32"}
        sig.update({n: "constexpr" for n in fn.arg_names if n not in sig})
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(
            RANK=1, WORLD=2, BLOCK=one_shot.BLOCK, DATA_OFFSET=one_shot.SIGNAL_BYTES,
            SLOT_ELEMS=elems, PROGRAMS=one_shot.MAX_BLOCKS, USE_PDL=True))
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = kernel.asm["ptx"]
        assert "sys.release" in ptx and "sys.acquire" in ptx, "flags need system-scope ordering"
        assert "griddepcontrol.wait" in ptx  # PDL: nothing is read before the previous kernel ends
    fn = one_shot._one_shot_norm_kernel
    sig = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Out": "*bf16", "ResOut": "*bf16",
           "n_rows": "i32", "n_cols": "i32", "eps": "fp32", "Bases": "*i64", "Counters": "*i32",
           "spin_limit": "i32"}
    sig.update({n: "constexpr" for n in fn.arg_names if n not in sig})
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(
        RANK=0, WORLD=2, BLOCK=4096, BITS=triton.language.int16,
        DATA_OFFSET=one_shot.ROWS_DATA_OFFSET,
        SLOT_ELEMS=one_shot.row_slot_bytes(2) // 2, PROGRAMS=one_shot.MAX_BLOCKS, USE_PDL=True))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 16}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert "ld.volatile.global" in ptx, "the wait for a peer's rows must reload them"
    assert "atom" not in ptx and "fence" not in ptx and "membar" not in ptx  # no flags


def test_only_contiguous_tensors_of_a_slot_or_less_take_the_one_shot_path():
    from tide.layers import one_shot

    reducer = object.__new__(one_shot.OneShotAllReduce)
    assert reducer.fits(torch.empty(4096, dtype=torch.bfloat16))
    assert reducer.fits(torch.empty(one_shot.SLOT_BYTES // 4, dtype=torch.float32))
    assert not reducer.fits(torch.empty(one_shot.SLOT_BYTES // 4 + 1, dtype=torch.float32))
    assert not reducer.fits(torch.empty(8, 8).t())
    assert not reducer.fits(torch.empty(8, dtype=torch.int64))
    assert not reducer.fits(torch.empty(0))


def test_the_row_channel_keeps_its_first_width_and_dtype_and_its_slot_size():
    from tide.layers import one_shot

    reducer = object.__new__(one_shot.OneShotAllReduce)
    reducer._row_width, reducer._row_slot_bytes = None, one_shot.row_slot_bytes(2)

    def fits(rows: int, width: int, dtype: torch.dtype) -> bool:
        x = torch.empty(rows, width, dtype=dtype)
        return reducer.fits_rows(x, torch.empty_like(x))

    assert fits(4, 4096, torch.bfloat16)
    reducer._row_width = (4096, torch.bfloat16)  # as `add_rmsnorm` records its first call
    assert fits(1024, 4096, torch.bfloat16)  # 8 MiB: a whole slot at two ranks
    assert not fits(1025, 4096, torch.bfloat16)
    assert not fits(4, 2048, torch.bfloat16)  # another width
    assert not fits(4, 4096, torch.float32)  # another dtype: rows would change their addresses
    assert one_shot.row_slot_bytes(8) * 2 * 8 <= one_shot.ROWS_REGION_BYTES


def test_an_ipc_handle_keeps_every_byte_through_the_exchange():
    from tide.layers.one_shot import _IpcHandle

    raw = bytes([0, 7, 0, 0, 255] + list(range(59)))  # NUL bytes inside, as real handles have
    handle = _IpcHandle.from_bytes(raw)
    assert handle.to_bytes() == raw
    with pytest.raises(ValueError, match="64 bytes"):
        _IpcHandle.from_bytes(raw[:10])
