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
        self.own = torch.zeros(one_shot.SIGNAL_BYTES + 2 * slot * self.es, dtype=torch.uint8)
        self.peer = torch.zeros_like(self.own)
        self.bases = torch.tensor([self.own.data_ptr(), self.peer.data_ptr()], dtype=torch.int64)
        self.counters = torch.zeros(one_shot.MAX_BLOCKS, dtype=torch.int32)

    def data(self, buf: torch.Tensor, flag: int, n: int) -> torch.Tensor:
        start = self.m.SIGNAL_BYTES + (flag & 1) * self.slot * self.es
        return buf[start:start + n * self.es].view(self.dtype)

    def signals(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:self.m.SIGNAL_BYTES].view(torch.int32)

    def peer_arrives(self, y: torch.Tensor, flag: int, programs: int) -> None:
        self.data(self.peer, flag, y.numel()).copy_(y)
        for b in range(programs):
            self.signals(self.own)[b * 2 + 1] = flag

    def run(self, x: torch.Tensor, spin_limit: int = 1000) -> int:
        programs = self.m.MAX_BLOCKS  # always all of them: a chunk's program never changes
        self.m._one_shot_kernel[(programs,)](
            x, x.numel(), self.bases, self.counters, spin_limit, RANK=0, WORLD=2,
            BLOCK=self.m.BLOCK, DATA_OFFSET=self.m.SIGNAL_BYTES, SLOT_ELEMS=self.slot,
            USE_PDL=False)
        return programs


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_calls_sum_in_rank_order_through_alternating_slots(dtype):
    n = 3000
    ranks = _Ranks(dtype, slot=4096)
    programs = ranks.m.MAX_BLOCKS  # 3 of them copy and sum, all of them signal and wait
    for flag in (1, 2):
        torch.manual_seed(flag)
        x, y = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        ranks.peer_arrives(y, flag, programs)
        got = x.clone()
        ranks.run(got)
        assert torch.equal(got, (x.float() + y.float()).to(dtype))
        assert torch.equal(ranks.data(ranks.own, flag, n), x)  # this rank's copy, in slot flag % 2
        assert ranks.counters.tolist() == [flag] * programs
        peer_signals = ranks.signals(ranks.peer)
        assert [int(peer_signals[b * 2]) for b in range(programs)] == [flag] * programs


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
            SLOT_ELEMS=elems, USE_PDL=True))
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = kernel.asm["ptx"]
        assert "sys.release" in ptx and "sys.acquire" in ptx, "flags need system-scope ordering"
        assert "griddepcontrol.wait" in ptx  # PDL: nothing is read before the previous kernel ends


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
