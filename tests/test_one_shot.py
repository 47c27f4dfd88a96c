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
    """Rank 0's and its peer's allocations (signals, then two slots of `slot` elements)."""

    def __init__(self, dtype: torch.dtype, slot: int) -> None:
        from tide.layers import one_shot

        self.m, self.dtype, self.slot = one_shot, dtype, slot
        self.es = torch.tensor([], dtype=dtype).element_size()
        # Both channels: signals, two slots of sums, two slots of rows.
        self.own = torch.zeros(one_shot.SIGNAL_BYTES + 4 * slot * self.es, dtype=torch.uint8)
        self.peer = torch.zeros_like(self.own)
        self.bases = torch.tensor([self.own.data_ptr(), self.peer.data_ptr()], dtype=torch.int64)
        self.counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)
        self.row_counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)
        self.rows_offset = one_shot.SIGNAL_BYTES + 2 * slot * self.es

    def data(self, buf: torch.Tensor, flag: int, n: int, rows: bool = False) -> torch.Tensor:
        start = (self.rows_offset if rows else self.m.SIGNAL_BYTES) + (flag & 1) * self.slot * self.es
        return buf[start:start + n * self.es].view(self.dtype)

    def signals(self, buf: torch.Tensor, rows: bool = False) -> torch.Tensor:
        first = self.m.SIGNALS if rows else 0
        return buf[:self.m.SIGNAL_BYTES].view(torch.int32)[first:first + self.m.SIGNALS]

    def peer_arrives(self, y: torch.Tensor, flag: int, programs: int, rows: bool = False) -> None:
        self.data(self.peer, flag, y.numel(), rows).copy_(y.reshape(-1))
        for b in range(programs):
            self.signals(self.own, rows)[b * 2 + 1] = flag

    def run_rows(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        block = triton.next_power_of_2(x.shape[1])
        self.m._one_shot_norm_kernel[(min(self.m.MAX_BLOCKS, x.shape[0]),)](
            x, r, w, out, res_out, x.shape[0], x.shape[1], eps, self.bases, self.row_counters,
            1000, RANK=0, WORLD=2, BLOCK=block, SIGNAL_OFFSET=self.m.SIGNALS,
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


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_are_summed_added_and_normed_on_their_own_channel(dtype):
    """The fused kernel: rank order sum rounded to the dtype, the residual added in the dtype (the
    residual output exactly), RMSNorm of that; its flags, slots and counters are not the plain
    sum's, so calls of the two kinds may interleave."""
    rows, width, eps = 70, 96, 1e-6  # more rows than programs: program 0..5 take two
    ranks = _Ranks(dtype, slot=8192)
    programs = ranks.m.MAX_BLOCKS
    torch.manual_seed(0)
    w = (torch.rand(width) + 0.5).to(dtype)
    for flag in (1, 2):
        x, y, r = (torch.randn(rows, width).to(dtype) for _ in range(3))
        ranks.peer_arrives(y, flag, programs, rows=True)
        out, res_out = ranks.run_rows(x, r, w, eps)
        summed = (x.float() + y.float()).to(dtype) + r
        assert torch.equal(res_out, summed)
        sf = summed.float()
        ref = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        assert torch.equal(ranks.data(ranks.own, flag, x.numel(), rows=True).view_as(x), x)
        assert ranks.row_counters.tolist() == [flag] * programs
        assert ranks.counters.tolist() == [0] * programs  # the plain channel never moved
        assert ranks.signals(ranks.peer).tolist() == [0] * ranks.m.SIGNALS
        peer_rows = ranks.signals(ranks.peer, rows=True)
        assert [int(peer_rows[b * 2]) for b in range(programs)] == [flag] * programs


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
        RANK=0, WORLD=2, BLOCK=4096, SIGNAL_OFFSET=one_shot.SIGNALS,
        DATA_OFFSET=one_shot.ROWS_DATA_OFFSET, SLOT_ELEMS=4 << 20, PROGRAMS=one_shot.MAX_BLOCKS,
        USE_PDL=True))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 16}).asm["ptx"]
    assert "sys.release" in ptx and "sys.acquire" in ptx and "griddepcontrol.wait" in ptx


def test_only_contiguous_tensors_of_a_slot_or_less_take_the_one_shot_path():
    from tide.layers import one_shot

    reducer = object.__new__(one_shot.OneShotAllReduce)
    assert reducer.fits(torch.empty(4096, dtype=torch.bfloat16))
    assert reducer.fits(torch.empty(one_shot.SLOT_BYTES // 4, dtype=torch.float32))
    assert not reducer.fits(torch.empty(one_shot.SLOT_BYTES // 4 + 1, dtype=torch.float32))
    assert not reducer.fits(torch.empty(8, 8).t())
    assert not reducer.fits(torch.empty(8, dtype=torch.int64))
    assert not reducer.fits(torch.empty(0))


def test_an_ipc_handle_keeps_every_byte_through_the_exchange():
    from tide.layers.one_shot import _IpcHandle

    raw = bytes([0, 7, 0, 0, 255] + list(range(59)))  # NUL bytes inside, as real handles have
    handle = _IpcHandle.from_bytes(raw)
    assert handle.to_bytes() == raw
    with pytest.raises(ValueError, match="64 bytes"):
        _IpcHandle.from_bytes(raw[:10])
