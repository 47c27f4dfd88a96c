"""The CUDA batch-invariant kernels (`tide.layers.batch_invariant_triton`) run by Triton's interpreter on
CPU tensors: a row's result is bit-identical whatever the batch around it, and close to a torch
reference. Skipped where triton is not installed (CI); `pip install triton` runs them on any machine.

The interpreter must be chosen before triton is imported (`TRITON_INTERPRET=1`), so a plain pytest run
executes this file again in a subprocess with it set (`test_kernels_under_the_interpreter`); the other
tests run only in that process, or directly with
`TRITON_INTERPRET=1 pytest tests/test_batch_invariant_triton.py`.

The interpreter computes `tl.dot` with numpy's matmul, whose BLAS blocking makes one output row depend
on where it sits in the tile (measured: permuting a [64, 16] fp16 operand's rows changes the last bits),
which GPU tensor-core MMAs do not do: an MMA output element is its row of A times its column of B,
accumulated in a fixed K order. For these tests `tl.dot` is therefore modelled that way (each output
element sums its products in K order, in fp32), so what is checked is the kernels' own structure
(tiling, loop bounds, masks, block boundaries), which is what decides batch invariance on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import INTERPRETED, interpreted, rerun_under_interpreter

triton = pytest.importorskip("triton")


def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__)


def _compile_sm90(fn, types: dict[str, str], constexprs: dict, **options):
    """Compile `fn` for an H100/H200 (sm_90) without a GPU; arguments specialised as a real launch
    specialises aligned tensors (16-byte pointers, strides and sizes divisible by 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: types.get(n, "i32" if n.startswith("stride") else "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride") or n in ("N", "K", "n_cols")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def test_kernels_compile_for_hopper():
    """The CUDA compile path (which the interpreter skips) accepts every kernel, and the GEMM's K
    loop is software-pipelined (shared memory for all its stages, not one)."""
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    from tide.layers import batch_invariant_triton as bt

    for cfg in bt._candidate_configs(4096):
        gemm = _compile_sm90(
            bt._matmul_kernel,
            {"A": "*bf16", "W": "*bf16", "Bias": "*bf16", "C": "*bf16", "M": "i32", "N": "i32",
             "K": "i32", "num_progs": "i32", "has_bias": "i32"},
            dict(EVEN_K=True, PRECISION="tf32", BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, USE_PDL=True),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        stage_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k * 2
        assert gemm.metadata.shared >= (cfg.num_stages - 1) * stage_bytes, cfg
        assert gemm.metadata.shared <= 227 * 1024, cfg  # an H100's shared memory per block
        if cfg.tma:
            tma = _compile_sm90(
                bt._matmul_tma_kernel,
                {"a_desc": f"tensordesc<bf16[{cfg.block_m},{cfg.block_k}]>",
                 "w_desc": f"tensordesc<bf16[{cfg.block_n},{cfg.block_k}]>", "Bias": "*bf16",
                 "C": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
                 "num_progs": "i32", "has_bias": "i32"},
                dict(PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, USE_PDL=True),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            assert "cp.async.bulk.tensor" in tma.asm["ptx"], cfg  # loads by the copy engine
            assert tma.metadata.shared >= (cfg.num_stages - 1) * stage_bytes, cfg
            assert tma.metadata.shared <= 227 * 1024, cfg
    # Extend's 64-row programs on 4 warps, and the decode's 16 rows on one.
    for rows, warps in ((bt.ATTN_BLOCK_M, 4), (bt.ATTN_DECODE_BLOCK_M, 1)):
        _compile_sm90(
            bt._attention_kernel,
            {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "ReqToToken": "*i32",
             "ReqPoolIdx": "*i64", "SeqLens": "*i64", "ExtendLens": "*i64", "ExtendStarts": "*i64",
             "MidO": "*fp32", "MidLse": "*fp32", "Order": "*i64", "sm_scale": "fp32",
             "is_decode": "i32",
             "write_partials": "i32", "split_progs": "i32", "logit_cap": "fp32", "window": "i32"},
            dict(HAS_CAP=True, GROUP=4, GROUP_P=4, BLOCK_M=rows, BLOCK_N=64, SPLIT=bt.ATTN_SPLIT,
                 BLOCK_D=128, HEAD_DIM=128, PRECISION="tf32", USE_PDL=True, ORDERED=rows == 16,
                 HAS_WINDOW=rows == 64, IDX64=rows == 64),
            num_warps=warps, num_stages=2 if warps > 1 else bt._DECODE_ROW_STAGES,
            enable_fp_fusion=False)
    _compile_sm90(bt._combine_kernel,
                  {"MidO": "*fp32", "MidLse": "*fp32", "Out": "*bf16", "SeqLens": "*i64",
                   "window": "i32"},
                  dict(SPLIT=bt.ATTN_SPLIT, BLOCK_D=128, HEAD_DIM=128, USE_PDL=True),
                  num_warps=4, enable_fp_fusion=False)
    _compile_sm90(bt._log_softmax_kernel, {"X": "*fp32", "Out": "*fp32", "n_cols": "i32"},
                  dict(BLOCK=4096, USE_PDL=True), num_warps=8, enable_fp_fusion=False)
    _compile_sm90(bt._rms_norm_kernel, {"X": "*bf16", "W": "*bf16", "Out": "*bf16", "n_cols": "i32",
                                        "eps": "fp32", "offset": "fp32"},
                  dict(BLOCK=4096, USE_PDL=True), num_warps=16, enable_fp_fusion=False)


def _mma_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    import numpy as np
    from triton.runtime import interpreter

    x = a.data.astype(np.float32)
    y = b.data.astype(np.float32)
    acc = d.data.astype(np.float32).copy()
    for k in range(x.shape[1]):
        acc += x[:, k : k + 1] * y[k : k + 1, :]
    return interpreter.TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)


@pytest.fixture(scope="module")
def bt():
    from tide.layers import batch_invariant_triton
    from triton.runtime import interpreter

    patch = pytest.MonkeyPatch()
    patch.setattr(interpreter.InterpreterBuilder, "create_dot", _mma_dot)
    try:
        yield batch_invariant_triton
    finally:
        patch.undo()


# ---- GEMM


@interpreted
@pytest.mark.parametrize("k", [96, 80])  # a multiple of BLOCK_K, and one with a ragged last slice
def test_linear_rows_independent_of_batch(bt, k):
    gen = torch.Generator().manual_seed(k)
    n = 72
    w = torch.randn(n, k, generator=gen).half()
    bias = torch.randn(n, generator=gen).half()
    x = torch.randn(150, k, generator=gen).half()
    cfg = bt.GemmConfig(32, 32, 32, num_warps=4, num_stages=2, group_m=2)
    full = bt.linear(x, w, bias, config=cfg)
    ref = x.float() @ w.float().T + bias.float()
    assert (full.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item() / 10
    # The same rows in batches of other sizes and at other offsets in the tiles.
    for start, m in [(0, 1), (5, 1), (5, 7), (31, 2), (40, 33), (149, 1), (3, 130)]:
        part = bt.linear(x[start : start + m], w, bias, config=cfg)
        assert torch.equal(part, full[start : start + m]), (start, m)


@interpreted
@pytest.mark.parametrize("k", [128, 80])
def test_tma_tiles_give_the_pointer_tiles_rows(bt, k):
    """The TMA kernel (descriptor loads, zero rows and K columns past the edge) computes the same
    tiles as the pointer kernel: equal rows for every batch size, with a bias and a ragged last K
    slice. A row stride TMA cannot carry (not a multiple of 16 bytes) runs the pointer kernel."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(72, k, generator=gen).half()
    bias = torch.randn(72, generator=gen).half()
    x = torch.randn(150, k, generator=gen).half()
    ptr = bt.GemmConfig(32, 32, 32, num_warps=4, num_stages=2, group_m=2)
    tma = bt.GemmConfig(32, 32, 32, num_warps=4, num_stages=2, group_m=2, tma=True)
    assert bt._tma_ok(x, w)
    calls = []
    real = bt._matmul_tma_kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bt, "_matmul_tma_kernel", _Counting(real, calls))
        full = bt.linear(x, w, bias, config=tma)
        assert torch.equal(full, bt.linear(x, w, bias, config=ptr))
        for start, m in [(0, 1), (5, 7), (31, 2), (40, 33), (3, 130)]:
            assert torch.equal(bt.linear(x[start : start + m], w, bias, config=tma),
                               full[start : start + m]), (start, m)
        assert len(calls) == 6
        odd = torch.randn(9, k + 1, generator=gen).half()[:, :k]  # row stride k + 1 halves
        assert not bt._tma_ok(odd, w)
        assert torch.equal(bt.linear(odd, w, bias, config=tma), bt.linear(odd, w, bias, config=ptr))
        assert len(calls) == 6
        # A column slice of a wider buffer: the columns past K (NaN here) are never read.
        wide = torch.full((150, k + 8), float("nan")).half()
        wide[:, :k] = x
        assert bt._tma_ok(wide[:, :k], w)
        assert torch.equal(bt.linear(wide[:, :k], w, bias, config=tma), full)
        assert len(calls) == 7


class _Counting:
    """A launcher stand-in that counts `kernel[grid](...)` launches."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@interpreted
def test_linear_shapes_and_config(bt):
    x = torch.randn(2, 3, 64).half()
    w = torch.randn(40, 64).half()
    cfg = bt.GemmConfig(16, 32, 32, num_warps=4, num_stages=2)
    y = bt.linear(x, w, config=cfg)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.reshape(6, 40), bt.linear(x.reshape(6, 64), w, config=cfg))
    assert bt.linear(torch.empty(0, 64).half(), w, config=cfg).shape == (0, 40)
    with pytest.raises(ValueError, match="input features"):
        bt.linear(x, torch.randn(40, 32).half(), config=cfg)
    # Every tile shape steps K alike (that fixes a row's bits); shapes differ by M and N.
    # Every shape any M up to 2048 and any N around the width thresholds can pick is one the
    # start-up check runs (`tile_shapes_agree`).
    picks = {bt.gemm_config(m, n, 4096) for m in range(1, 2049)
             for n in (2048, 4096, 6143, 6144, 16383, 16384, 28672, 128256)}
    assert {c.block_k for c in picks} | {bt.fixed_config(n, 4096).block_k for n in (4096, 28672)} \
        == {bt.K_STEP}
    assert len(picks) >= 4
    assert set(bt._candidate_configs(4096)) >= picks


@interpreted
def test_tile_shapes_agree_picks_by_m_and_rows_stay_equal(bt):
    """With MMA-like dots every tile shape gives the same bits: the check says so (once, then
    remembered), and rows of products picked by M equal the rows of a large product."""
    k = 128
    bt._AGREE.pop((k, torch.float16, torch.device("cpu")), None)
    assert bt.tile_shapes_agree(k, torch.float16, torch.device("cpu"))
    assert bt._AGREE[(k, torch.float16, torch.device("cpu"))] is True
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, k, generator=gen).half()
    x = torch.randn(300, k, generator=gen).half()
    full = bt.linear(x, w)  # 300 rows: a 128-row tile shape
    assert bt._pick_config(300, 96, k, x) != bt._pick_config(1, 96, k, x)
    for start, m in [(0, 1), (7, 8), (3, 64), (100, 129), (40, 256)]:
        assert torch.equal(bt.linear(x[start : start + m], w), full[start : start + m]), (start, m)


@interpreted
def test_tile_shapes_that_differ_fall_back_to_one_shape(bt, monkeypatch):
    """A device whose tile shapes give different bits serves every M with `fixed_config`."""
    k = 192
    key = (k, torch.float16, torch.device("cpu"))
    monkeypatch.delitem(bt._AGREE, key, raising=False)
    real = bt.linear
    calls = []

    def perturbed(x, w, bias=None, config=None):
        calls.append(config)
        y = real(x, w, bias, config=config)
        return y + 1 if config is not None and config.block_m == 16 else y

    monkeypatch.setattr(bt, "linear", perturbed)
    assert not bt.tile_shapes_agree(k, torch.float16, torch.device("cpu"))
    assert len(calls) >= 2
    monkeypatch.setattr(bt, "linear", real)
    x = torch.randn(3, k).half()
    assert bt._pick_config(3, 4096, k, x) == bt.fixed_config(4096, k)
    assert bt._pick_config(3000, 4096, k, x) == bt.fixed_config(4096, k)
    bt._AGREE.pop(key)  # the monkeypatch would restore nothing: it was absent


# ---- row-wise reductions


@interpreted
def test_log_softmax_rows_independent_and_close(bt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5000, generator=gen) * 4  # two 4096-wide chunks, the second ragged
    x[2, 100:3000] = float("-inf")  # masked logits (top-k'd vocab, penalties)
    x[3, :4096] = float("-inf")  # a whole chunk masked
    full = bt.log_softmax(x)
    ref = torch.log_softmax(x, dim=-1)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(full))
    assert (full[finite] - ref[finite]).abs().max().item() < 1e-5
    for i in range(6):
        assert torch.equal(bt.log_softmax(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(bt.log_softmax(x[1:4]), full[1:4])
    with pytest.raises(ValueError, match="2-D"):
        bt.log_softmax(x[0])


@interpreted
def test_gemma_rms_norm_rows_independent_and_close(bt):
    from tide.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 96, generator=gen).half()
    norm = GemmaRMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96, generator=gen) * 0.1
    full = bt.rms_norm(x, norm.weight, 1e-6, offset=1.0)
    assert (full.float() - norm(x.float())).abs().max().item() < 1e-2
    for i in (0, 4, 8):
        assert torch.equal(bt.rms_norm(x[i : i + 1], norm.weight, 1e-6, offset=1.0), full[i : i + 1])


@interpreted
def test_llama_rmsnorm_kernel_rows_independent():
    """The default GPU RMSNorm (`triton_ops.rmsnorm`, used in deterministic mode as is) is one
    program per row with a block set by the hidden size: a row's bits do not depend on the batch."""
    from tide.layers import triton_ops as ops

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 80, generator=gen).half()
    r = torch.randn(11, 80, generator=gen).half()
    w = torch.randn(80, generator=gen).half()
    out, res = ops.rmsnorm(x, w, 1e-5, r)
    for i in (0, 6, 10):
        o1, r1 = ops.rmsnorm(x[i : i + 1], w, 1e-5, r[i : i + 1])
        assert torch.equal(o1, out[i : i + 1]) and torch.equal(r1, res[i : i + 1])


# ---- attention


class _Paged:
    """Requests' K/V scattered over a pool through req_to_token, and each token's query."""

    def __init__(self, lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int = 16,
                 window: int | None = None, cap: float | None = None):
        self.window, self.cap = window, cap
        gen = torch.Generator().manual_seed(sum(lens) + num_heads)
        self.lens, self.hq, self.hk, self.d = lens, num_heads, num_kv_heads, head_dim
        size = sum(lens) + 8
        self.k = torch.randn(size, num_kv_heads, head_dim, generator=gen).half()
        self.v = torch.randn(size, num_kv_heads, head_dim, generator=gen).half()
        self.req_to_token = torch.zeros(len(lens) + 1, max(lens) + 4, dtype=torch.int32)
        perm = torch.randperm(size - 1, generator=gen) + 1  # slot 0: the pool's padding slot
        off = 0
        for i, n in enumerate(lens):
            self.req_to_token[i, :n] = perm[off : off + n].int()
            off += n
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen).half() for n in lens]
        self.scale = 1 / math.sqrt(head_dim)

    def extend(self, bt, reqs: list[int], prefix: list[int], upto: list[int] | None = None):
        """Attention of tokens prefix[j]..upto[j] of request reqs[j] (K/V of 0..upto[j] cached), all
        in one extend batch; returns {req: [new, Hq, D]}."""
        upto = upto or [self.lens[i] for i in reqs]
        q = torch.cat([self.q[i][p:e] for i, p, e in zip(reqs, prefix, upto)])
        out = torch.empty_like(q)
        ext = [e - p for p, e in zip(prefix, upto)]
        starts = [sum(ext[:j]) for j in range(len(ext))]
        bt.attention(q, self.k, self.v, out, self.req_to_token, torch.tensor(reqs),
                     torch.tensor(upto), self.scale,
                     extend=(torch.tensor(ext), torch.tensor(starts), max(ext)),
                     sliding_window=self.window, logit_cap=self.cap)
        return {i: out[s : s + n] for i, s, n in zip(reqs, starts, ext)}

    def decode(self, bt, reqs: list[int], pos: list[int], scratch=None,
               rows: int | None = None, ordered: bool = False) -> dict[int, torch.Tensor]:
        """One decode step: the token at pos[j] of each request (K/V of 0..pos[j] cached);
        `ordered`: programs start with the longest request (`decode_order`)."""
        q = torch.stack([self.q[i][p] for i, p in zip(reqs, pos)])
        out = torch.empty_like(q)
        seq_lens = torch.tensor([p + 1 for p in pos])
        bt.attention(q, self.k, self.v, out, self.req_to_token, torch.tensor(reqs), seq_lens,
                     self.scale, scratch=scratch, sliding_window=self.window, logit_cap=self.cap,
                     decode_rows=rows, longest_first=bt.decode_order(seq_lens) if ordered else None)
        return {i: out[j] for j, i in enumerate(reqs)}

    def reference(self, i: int) -> torch.Tensor:
        n = self.lens[i]
        slots = self.req_to_token[i, :n].long()
        rep = self.hq // self.hk
        k = self.k[slots].float().repeat_interleave(rep, 1)
        v = self.v[slots].float().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", self.q[i].float(), k) * self.scale
        if self.cap is not None:
            s = torch.tanh(s / self.cap) * self.cap
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
        if self.window is not None:
            hidden |= torch.ones(n, n, dtype=torch.bool).tril(-self.window)
        s = s.masked_fill(hidden, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.fixture
def small_splits(bt, monkeypatch):
    """Splits of 128 keys (two key blocks), so short test sequences cross several."""
    monkeypatch.setattr(bt, "ATTN_SPLIT", 128)
    return bt


@interpreted
# -inf - -inf and log(0) of rows with no key in a split: computed, then left out of the merge.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("heads,window,cap", [((8, 2), None, None), ((4, 4), None, None),
                                              ((6, 2), None, None), ((8, 2), 150, 5.0),
                                              ((4, 2), 40, None)],
                         ids=["gqa4", "mha", "gqa3", "window150-cap", "window40"])
@pytest.mark.parametrize("idx64", [False, True], ids=["int32-offsets", "int64-offsets"])
def test_attention_same_bits_for_decode_extend_chunks_and_prefix(small_splits, heads, window, cap,
                                                                 idx64, monkeypatch):
    bt = small_splits
    if idx64:  # as for K/V buffers past 2**31 elements
        monkeypatch.setattr(bt, "_max_offset", lambda t: 2**31)
    paged = _Paged([37, 5, 200, 19], *heads, window=window, cap=cap)
    full = paged.extend(bt, [0, 1, 2, 3], [0, 0, 0, 0])
    for i in range(4):
        assert (full[i].float() - paged.reference(i)).abs().max().item() < 2e-3
    # Alone, and in another batch order.
    assert torch.equal(paged.extend(bt, [2], [0])[2], full[2])
    other = paged.extend(bt, [3, 2, 0], [0, 0, 0])
    assert all(torch.equal(other[i], full[i]) for i in (0, 2, 3))
    # On a cached prefix (block and split boundaries of the new tokens shift with it).
    for p in (13, 64, 127, 128, 150):
        assert torch.equal(paged.extend(bt, [2, 0], [p, min(p, 36)])[2], full[2][p:]), p
    # Chunked prefill: chunks of 61 tokens, the K/V of later tokens not cached yet.
    for size in (61,):
        for s in range(0, 200, size):
            e = min(s + size, 200)
            assert torch.equal(paged.extend(bt, [2], [s], [e])[2], full[2][s:e]), (size, s)
    # Decode steps, one token per request, in batches of other compositions; the splits of
    # batches up to `scratch.max_batch` run in parallel programs, larger ones in one; programs of
    # extend's 64 rows and of the decode's 16.
    scratch = bt.DecodeSplitScratch(2, heads[0], 16, 512, "cpu")
    for reqs, pos in [([0, 1, 2, 3], [36, 4, 199, 18]), ([2], [199]), ([2, 0], [127, 0]),
                      ([3, 2], [0, 128])]:
        for sc, rows, ordered in [(None, None, False), (None, bt.ATTN_DECODE_BLOCK_M, False),
                                  (None, bt.ATTN_DECODE_BLOCK_M, True), (scratch, None, False),
                                  (scratch, bt.ATTN_DECODE_BLOCK_M, True)]:
            out = paged.decode(bt, reqs, pos, sc, rows, ordered)
            for i, p in zip(reqs, pos):
                assert torch.equal(out[i], full[i][p]), (reqs, i, p, sc is not None, rows, ordered)


@interpreted
# The windowed case leaves a token without keys in the first split: computed, then left out.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_decode_tiles_agree_checks_once(bt):
    """With MMA-like dots a 16-row decode program gives extend's bits: the check says so and is
    remembered; a group too wide for fewer rows keeps extend's row count."""
    key = (4, 16, torch.float16, torch.device("cpu"))
    bt._DECODE_AGREE.pop(key, None)
    assert bt.decode_tiles_agree(8, 2, 16, torch.float16, torch.device("cpu"))
    assert bt._DECODE_AGREE[key] is True
    assert not bt.decode_tiles_agree(64, 1, 16, torch.float16, torch.device("cpu"))
    assert not bt.decode_tiles_agree(8, 2, 256, torch.float16, torch.device("cpu"))
    bt._DECODE_AGREE.pop(key)
    paged = _Paged([20], 8, 2)
    with pytest.raises(ValueError, match="decode_rows"):
        paged.decode(bt, [0], [19], rows=8)
    q = paged.q[0][:2]
    with pytest.raises(ValueError, match="longest_first"):
        bt.attention(q, paged.k, paged.v, torch.empty_like(q), paged.req_to_token,
                     torch.tensor([0, 0]), torch.tensor([5, 9]), paged.scale,
                     longest_first=torch.tensor([1, 0, 2]))


@interpreted
def test_attention_rejects_groups_wider_than_the_kernel(bt):
    paged = _Paged([4], 128, 1)
    with pytest.raises(ValueError, match="q heads per kv head"):
        paged.extend(bt, [0], [0])
