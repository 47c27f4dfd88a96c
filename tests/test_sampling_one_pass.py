"""The one-pass sampling kernel (`triton_ops.sample_rows`) and the sampler's use of it, on the CPU.

The kernel runs in triton's CPU interpreter (CI has no triton: those tests skip; the interpreter must
be on before triton is first imported, so `test_one_pass_in_the_interpreter` reruns this file in a
subprocess with TRITON_INTERPRET=1); both launches are also compiled for sm_90 without a GPU.
Checked: the Exp(1) noise near u = 1, greedy rows against torch's argmax, logprobs against
`log_softmax`, the draw's frequencies against the softmax, a seeded row's token independent of its
batch and row, rows whose logits are -inf or NaN, and the sampler's split of a batch between this
path and the general one. The row rule itself (`_one_pass`) needs no triton.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tide.layers.sampler import Sampler, SamplingBatchInfo, _one_pass
from tide.sampling_params import SamplingParams

from conftest import INTERPRETED, rerun_under_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED),
    reason="runs in triton's CPU interpreter (TRITON_INTERPRET=1), see test_one_pass_in_the_interpreter",
)
if HAS_TRITON and INTERPRETED:
    import triton
    import triton.language as tl
    from tide.layers.triton_ops import _exp1

    @triton.jit
    def _exp1_probe(U, E, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(E + offs, _exp1(tl.load(U + offs, mask=mask, other=0.5), False), mask=mask)


def test_which_rows_take_one_pass():
    """Greedy and plain temperature rows do; penalties, truncation and top logprobs do not."""
    assert _one_pass(SamplingParams(temperature=0.0), 0)
    assert _one_pass(SamplingParams(temperature=1.0), 0)
    assert _one_pass(SamplingParams(temperature=0.7, seed=3), 0)
    assert _one_pass(SamplingParams(temperature=0.7, top_k=1), 0)  # greedy by top_k
    assert _one_pass(SamplingParams(temperature=0.0, top_p=0.5), 0)  # greedy: truncation moot
    assert not _one_pass(SamplingParams(temperature=1.0), 3)
    assert not _one_pass(SamplingParams(temperature=1.0, top_p=0.9), 0)
    assert not _one_pass(SamplingParams(temperature=1.0, top_k=20), 0)
    assert not _one_pass(SamplingParams(temperature=1.0, min_p=0.1), 0)
    assert not _one_pass(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0)


def test_cpu_sampler_keeps_the_general_path():
    """Without CUDA (and `one_pass` unset) the sampler never reaches for triton: the seeded tokens
    are those of the general path, `one_pass=False` given explicitly."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    info = SamplingBatchInfo(params, [[], [], []], [[1], [1], [1]], [True] * 3, [0] * 3)
    a = Sampler(0)(logits, info)
    b = Sampler(0, one_pass=False)(logits, info)
    assert a.next_ids == b.next_ids and a.logprobs == b.logprobs


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_one_pass_in_the_interpreter():
    """The interpreter tests of this file, in a subprocess with TRITON_INTERPRET=1: all pass (the
    seven interpreted ones and the two that need no triton), none skipped but this one and the
    compile test."""
    summary = rerun_under_interpreter(__file__)
    assert summary.startswith("9 passed, 2 skipped"), summary


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton, compiled (not interpreted)")
def test_kernels_compile_for_hopper():
    """Both launches compile for sm_90 (no GPU needed), bf16 and fp32 logits, with and without
    logprobs, with the inline `lg2.approx` the GPU path uses. The vocabulary and the logits' stride
    stay specialised (only the row count is not), and with them divisible by 16, as a model's are,
    the logits load in vectors: unspecialised, the kernel took 2.5x as long (H100, 256 rows)."""
    import re

    import triton
    from tide.layers import triton_ops as ops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    partial = ops._sample_partial_kernel
    unspecialised = {partial.arg_names[i] if isinstance(i, int) else i
                     for i in partial.do_not_specialize}
    assert unspecialised == {"rows_total"}, unspecialised
    aligned = ("X", "n_cols", "stride_x")

    def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int) -> str:
        sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps})
        return kernel.asm["ptx"]

    ints = {"n_cols": "i32", "stride_x": "i64", "rows_total": "i32"}
    for logits in ("*bf16", "*fp32"):
        for logprob in (True, False):
            ptx = compile_sm90(
                ops._sample_partial_kernel,
                {"X": logits, "Rows": "*i64", "Temps": "*fp32", "Seeds": "*i64", "Part": "*fp32",
                 "Idx": "*i32", **ints},
                dict(CHUNKS=75, CHUNK=ops.SAMPLE_CHUNK, BLOCK=ops._SAMPLE_BLOCK, LOGPROB=logprob,
                     ASM=True, USE_PDL=True), num_warps=4)
            assert "lg2.approx" in ptx
            assert re.search(r"ld\.global(\.\w+)*\.v[24]\.", ptx), "logits not loaded in vectors"
            compile_sm90(
                ops._sample_final_kernel,
                {"X": logits, "Rows": "*i64", "Temps": "*fp32", "Part": "*fp32", "Idx": "*i32",
                 "Out": "*i64", "LogP": "*fp32", **ints},
                dict(CHUNKS=75, CHUNKS_P2=128, LOGPROB=logprob, USE_PDL=True), num_warps=1)


def _sample(logits, temps, seeds, logprobs=True, rows=None):
    from tide.layers import triton_ops

    n = len(temps) if rows is None else len(rows)
    index = torch.arange(n) if rows is None else torch.tensor(rows)
    return triton_ops.sample_rows(logits, index, torch.tensor(temps, dtype=torch.float32),
                                  torch.tensor(seeds, dtype=torch.int64), logprobs)


@interpreted
def test_interpreted_exponential_noise_near_one():
    """E = -log(u) from `_exp1`, against float64, at u where the series serves (within 2^-6 of 1,
    down to the largest uniform below 1) and where the log does: relative error below 1e-6, and
    u = 0 gives +inf (a key of -inf: never drawn)."""
    near = [1 - 2.0**-24, 1 - 2.0**-23, 1 - 3 * 2.0**-24, 1 - 2.0**-20, 1 - 2.0**-10, 1 - 2.0**-6 + 2.0**-24,
            1 - 2.0**-6, 1 - 2.0**-6 - 2.0**-24]
    far = [0.9, 0.5, 0.25, 1e-3, 2.0**-31, 0.0]
    u = torch.tensor(near + far, dtype=torch.float32)
    e = torch.empty_like(u)
    _exp1_probe[(1,)](u, e, u.numel(), BLOCK=16)
    want = -torch.log(u.double())
    assert torch.isinf(e[-1]) and e[-1] > 0
    rel = ((e[:-1].double() - want[:-1]) / want[:-1]).abs()
    assert rel.max().item() < 1e-6, rel


@interpreted
def test_interpreted_greedy_rows_are_the_argmax():
    """Key -1: the first argmax of logits / T, and its log_softmax, across chunk boundaries (a vocab
    of two chunks and a bit), in fp32 and bf16."""
    from tide.layers.triton_ops import SAMPLE_CHUNK

    vocab = 2 * SAMPLE_CHUNK + 37
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
        logits[2, SAMPLE_CHUNK + 9] = logits[2, 100] = 40.0  # a tie across chunks: the first wins
        logits[3, vocab - 1] = 50.0  # the maximum in the last, partial chunk
        temps = [1.0, 0.5, 1.0, 2.0]
        ids, logp = _sample(logits, temps, [-1] * 4)
        scaled = logits.float() / torch.tensor(temps).unsqueeze(1)
        assert ids.tolist() == scaled.argmax(dim=-1).tolist()
        assert ids[2].item() == 100 and ids[3].item() == vocab - 1
        ref = torch.log_softmax(scaled, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)


@interpreted
def test_interpreted_draws_follow_the_softmax(monkeypatch):
    """300 rows of the same 6 logits under distinct keys: each token's frequency is within 0.1 of
    softmax(logits / T) at T = 1 and T = 0.5 (the top token: 0.61 and 0.84), and every logprob is
    the drawn token's log_softmax. The interpreter runs ~10 ms a program, so the tight check (20,000
    rows) is the GPU test's; here chunks of 8 columns in blocks of 4 (two blocks a chunk)."""
    from tide.layers import triton_ops

    monkeypatch.setattr(triton_ops, "SAMPLE_CHUNK", 8)
    monkeypatch.setattr(triton_ops, "_SAMPLE_BLOCK", 4)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 300
    for t in (1.0, 0.5):
        logits = base.repeat(n, 1)
        ids, logp = _sample(logits, [t] * n, list(range(1000, 1000 + n)))
        want = torch.softmax(base / t, dim=0)
        got = torch.bincount(ids, minlength=6).float() / n
        assert (got - want).abs().max().item() < 0.1, (got, want)
        torch.testing.assert_close(logp, torch.log(want)[ids], rtol=1e-5, atol=1e-5)


@interpreted
def test_interpreted_a_seeded_row_ignores_its_batch():
    """The same logits row under the same key gives the same token and logprob whatever row of the
    launch it is and whatever the other rows hold; another key gives other draws."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(5000, generator=g)
    others = torch.randn(5, 5000, generator=g)
    alone, lp_alone = _sample(row.unsqueeze(0), [1.0], [77])
    batch = torch.cat([others[:3], row.unsqueeze(0), others[3:]])
    mixed, lp_mixed = _sample(batch, [0.7, 1.0, 1.0, 1.0, 2.0, 1.0], [5, -1, 9, 77, 11, 77])
    assert mixed[3].item() == alone[0].item() and lp_mixed[3].item() == lp_alone[0].item()
    # `rows` reads the row in place, in any order, with the same result
    picked, _ = _sample(batch, [1.0, 1.0], [77, 77], rows=[3, 3])
    assert picked.tolist() == [alone[0].item()] * 2
    flat = torch.zeros(1, 5000)
    draws = {_sample(flat, [1.0], [k], logprobs=False)[0].item() for k in range(40)}
    assert len(draws) > 30  # uniform over 5,000 tokens: 40 keys rarely repeat


@interpreted
def test_interpreted_masked_and_nan_logits():
    """-inf columns are never drawn, NaN columns never drawn nor argmaxed, a row of nothing but -inf
    returns a token inside the vocabulary, and logprobs stay finite where any column is finite."""
    vocab = 300
    logits = torch.full((4, vocab), float("-inf"))
    logits[0, 17] = 0.0  # one finite column: always drawn, logprob 0
    logits[1, :] = 0.0
    logits[1, ::2] = float("nan")  # NaN on even columns
    logits[2, 100:110] = 1.0
    ids, logp = _sample(logits, [1.0, 1.0, 1.0, 1.0], [1, 2, 3, 4])
    assert ids[0].item() == 17 and abs(logp[0].item()) < 1e-6
    assert ids[1].item() % 2 == 1
    assert 100 <= ids[2].item() < 110
    torch.testing.assert_close(logp[2], torch.tensor(-torch.log(torch.tensor(10.0)).item()))
    assert 0 <= ids[3].item() < vocab
    greedy, _ = _sample(logits[1:2], [1.0], [-1])
    assert greedy.item() % 2 == 1


def _info(params, return_logprob, top, outputs=None):
    n = len(params)
    return SamplingBatchInfo(params, outputs or [[] for _ in range(n)], [[1, 2, 3]] * n,
                             return_logprob, top)


@interpreted
def test_interpreted_sampler_splits_a_mixed_batch():
    """A batch of one-pass rows (greedy, seeded, unseeded) and general rows (top-p, penalties, top
    logprobs): the general rows equal the general path run on them alone, the one-pass rows equal
    `sample_rows` run on them alone, and logprobs / top logprobs land on their own rows."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 400, generator=g) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.8, seed=4),
              SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=6)]
    lp = [True, True, True, False, True, True]
    top = [0, 0, 0, 0, 0, 2]
    outputs = [[], [], [], [], [7, 8], []]
    info = _info(params, lp, top, outputs)
    out = Sampler(0, one_pass=True)(logits, info)
    assert out.logprobs is not None and out.top_logprobs is not None
    general = [1, 4, 5]
    ref = Sampler(0, one_pass=False)(logits[general], info.select(general))
    assert [out.next_ids[i] for i in general] == ref.next_ids
    assert ref.logprobs is not None and ref.top_logprobs is not None
    for j, i in enumerate(general):
        assert out.logprobs[i] == pytest.approx(ref.logprobs[j], abs=1e-6)
    assert out.top_logprobs[5] == ref.top_logprobs[2] and len(out.top_logprobs[5]) == 2
    assert out.top_logprobs[0] == []
    assert out.next_ids[0] == int(logits[0].argmax())
    seeded = Sampler(0, one_pass=True)(logits[2:3], info.select([2]))
    assert seeded.next_ids[0] == out.next_ids[2]
    assert seeded.logprobs is not None
    assert seeded.logprobs[0] == pytest.approx(out.logprobs[2], abs=1e-6)
    scaled = torch.log_softmax(logits / 0.9, dim=-1)
    assert out.logprobs[2] == pytest.approx(scaled[2, out.next_ids[2]].item(), abs=1e-5)


@interpreted
def test_interpreted_sampler_all_rows_one_pass():
    """An RL rollout batch (temperature 1, logprobs, no seeds): every row takes one pass, each
    logprob is the drawn token's log_softmax, and two samplers with the same seed draw the same
    tokens (the per-step keys come from the sampler's seed) while another seed, or another
    stream of the same seed (a data-parallel replica's `dp_rank`), draws others."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 1000, generator=g).to(torch.bfloat16)
    info = _info([SamplingParams(temperature=1.0)] * 8, [True] * 8, [0] * 8)
    a = Sampler(11, one_pass=True)(logits, info)
    b = Sampler(11, one_pass=True)(logits, info)
    c = Sampler(12, one_pass=True)(logits, info)
    d = Sampler(11, one_pass=True, stream=1)(logits, info)
    assert a.next_ids == b.next_ids and a.next_ids != c.next_ids and a.next_ids != d.next_ids
    assert a.logprobs is not None
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, tok in enumerate(a.next_ids):
        assert a.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
