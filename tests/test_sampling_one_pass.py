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
from tide.layers.sampler import Sampler, SamplingBatchInfo, _one_pass, _truncates, truncate
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


def _one_pass_row(p: SamplingParams, top_logprobs_num: int = 0, output: int = 0,
                  ending: tuple[int, ...] = (), offset: int = 0) -> bool:
    info = SamplingBatchInfo([p], [[5] * output], [[1]], [top_logprobs_num > 0], [top_logprobs_num],
                             output_offset=offset, ending_ids=[ending])
    return _one_pass(info, 0)


def test_which_rows_take_one_pass():
    """Greedy, temperature and truncated (top-k / top-p / min-p) rows do; penalties, top logprobs
    and rows whose ending tokens are banned (`min_new_tokens` not reached) do not. Only drawn rows
    search for a truncation bound."""
    _one_pass = _one_pass_row
    assert _one_pass(SamplingParams(temperature=0.0), 0)
    assert _one_pass(SamplingParams(temperature=1.0), 0)
    assert _one_pass(SamplingParams(temperature=0.7, seed=3), 0)
    assert _one_pass(SamplingParams(temperature=1.0, top_p=0.9), 0)
    assert _one_pass(SamplingParams(temperature=1.0, top_k=20), 0)
    assert _one_pass(SamplingParams(temperature=1.0, min_p=0.1), 0)
    assert not _one_pass(SamplingParams(temperature=1.0), 3)
    assert not _one_pass(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0)
    assert not _one_pass(SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5), 0)
    minimum = SamplingParams(temperature=1.0, min_new_tokens=3)
    assert not _one_pass(minimum, 0, output=2, ending=(7,))  # its third token: 7 banned
    assert _one_pass(minimum, 0, output=3, ending=(7,))
    assert _one_pass(minimum, 0, output=2, ending=(7,), offset=1)  # overlap: one more on the device
    assert _one_pass(minimum, 0, output=0, ending=())  # nothing would end it (ignore_eos, no ids)
    assert _truncates(SamplingParams(temperature=1.0, top_p=0.9))
    assert _truncates(SamplingParams(temperature=1.0, top_k=20))
    assert _truncates(SamplingParams(temperature=1.0, min_p=0.1))
    assert not _truncates(SamplingParams(temperature=1.0))
    assert not _truncates(SamplingParams(temperature=0.7, top_k=1))  # greedy by top_k
    assert not _truncates(SamplingParams(temperature=0.0, top_p=0.5))  # greedy: truncation moot


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
    eleven interpreted ones and the two that need no triton), none skipped but this one and the
    compile test."""
    summary = rerun_under_interpreter(__file__)
    assert summary.startswith("13 passed, 2 skipped"), summary


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton, compiled (not interpreted)")
def test_kernels_compile_for_hopper():
    """The sampling and truncation launches compile for sm_90 (no GPU needed), bf16 and fp32
    logits, with and without logprobs and truncation, with the inline `lg2.approx` the GPU path
    uses. The vocabulary and the logits' stride
    stay specialised (only the row count is not), and with them divisible by 16, as a model's are,
    the logits load in vectors: unspecialised, the kernel took 2.5x as long (H100, 256 rows)."""
    import re

    import triton
    from tide.layers import triton_ops as ops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fn in (ops._sample_partial_kernel, ops._sample_final_kernel, ops._trunc_partial_kernel,
               ops._trunc_final_kernel):
        unspecialised = {fn.arg_names[i] if isinstance(i, int) else i
                         for i in fn.do_not_specialize}
        assert unspecialised == {"rows_total"}, unspecialised
    aligned = ("X", "n_cols", "stride_x")

    def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int) -> str:
        sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned
                 if n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps})
        return kernel.asm["ptx"]

    ints = {"n_cols": "i32", "stride_x": "i64", "rows_total": "i32"}
    for logits in ("*bf16", "*fp32"):
        shift = 16 if logits == "*bf16" else 0
        for logprob, trunc in ((True, False), (False, False), (True, True)):
            ptx = compile_sm90(
                ops._sample_partial_kernel,
                {"X": logits, "Rows": "*i64", "Temps": "*fp32", "Seeds": "*i64", "Floor": "*i32",
                 "MinX": "*fp32", "Part": "*fp32", "Idx": "*i32", **ints},
                dict(CHUNKS=75, CHUNK=ops.SAMPLE_CHUNK, BLOCK=ops._SAMPLE_BLOCK, LOGPROB=logprob,
                     TRUNC=trunc, SHIFT=shift, ASM=True, USE_PDL=True), num_warps=4)
            assert "lg2.approx" in ptx
            assert re.search(r"ld\.global(\.\w+)*\.v[24]\.", ptx), "logits not loaded in vectors"
        for search_k, search_p in ((True, True), (True, False), (False, True), (False, False)):
            flags = dict(PIVOTS=ops.TRUNC_PIVOTS[32 - shift], SEARCH_K=search_k, SEARCH_P=search_p,
                         USE_PDL=True)
            compile_sm90(
                ops._trunc_partial_kernel,
                {"X": logits, "Rows": "*i64", "Temps": "*fp32", "Bounds": "*i64", "Part": "*fp32",
                 "Cnt": "*i32", **ints},
                dict(CHUNKS=75, CHUNK=ops.SAMPLE_CHUNK, BLOCK=ops._TRUNC_BLOCK, SHIFT=shift,
                     **flags), num_warps=4)
            compile_sm90(
                ops._trunc_final_kernel,
                {"TopK": "*i64", "TopP": "*fp32", "MinP": "*fp32", "Bounds": "*i64",
                 "Part": "*fp32", "Cnt": "*i32", "Floor": "*i32", "MinX": "*fp32",
                 "rows_total": "i32"},
                dict(CHUNKS=75, CHUNKS_P2=128, PIVOTS=flags["PIVOTS"],
                     SEARCH=search_k or search_p, USE_PDL=True), num_warps=4)
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
    """A batch of one-pass rows (greedy, seeded, unseeded) and general rows (penalties, top
    logprobs): the general rows equal the general path run on them alone, the one-pass rows equal
    `sample_rows` run on them alone, and logprobs / top logprobs land on their own rows."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 400, generator=g) * 2
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, presence_penalty=0.5),
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


def _order_key(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`triton_ops._order_key` in torch: the fp32 bits (-0 as +0), negatives' magnitude flipped,
    shifted."""
    x = x.float()
    b = torch.where(x == 0, 0.0, x).view(torch.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)) >> (32 - bits)


def _truncation_rows(dtype: torch.dtype, n: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of distinct logits (no ties, so the sort's order is the only one)."""
    g = torch.Generator().manual_seed(seed)
    if dtype != torch.float32:  # distinct 16-bit values, shuffled per row
        base = torch.unique((torch.arange(-vocab, vocab, 2, dtype=torch.float32) / 300).to(dtype))
        return torch.stack([base[torch.randperm(base.numel(), generator=g)] for _ in range(n)])
    return torch.randn(n, vocab, generator=g) * 3


TRUNCATIONS = [  # (temperature, top_k, top_p, min_p)
    (1.0, -1, 0.9, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 1, 1.0, 0.0), (1.0, 400, 0.5, 0.05),
    (0.9, -1, 0.95, 0.0), (1.0, 7, 0.3, 0.01), (1.0, -1, 1.0, 0.2), (1.0, 100_000, 0.999, 0.0),
    (0.5, 2, 1e-6, 0.0), (1.0, -1, 1.0, 0.0),
]


@interpreted
def test_interpreted_truncation_bounds_keep_what_the_sort_keeps():
    """For bf16 (16-bit keys, 8 passes), fp32 and fp16 logits (32-bit keys, 11 passes) over 2.5
    chunks, the tokens `truncation_bounds` keeps are exactly those the general path's sort-based
    `truncate` keeps, row by row: top-k alone, top-p alone, both, with min-p, a top-k beyond the vocabulary,
    a top-p below the top token's mass, and no truncation at all."""
    from tide.layers import triton_ops

    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        logits = _truncation_rows(dtype, len(TRUNCATIONS), 5000, seed=1)
        temps = [t for t, _, _, _ in TRUNCATIONS]
        floor, min_x = triton_ops.truncation_bounds(
            logits, torch.arange(len(TRUNCATIONS)), torch.tensor(temps),
            [k for _, k, _, _ in TRUNCATIONS], [p for _, _, p, _ in TRUNCATIONS],
            [m for _, _, _, m in TRUNCATIONS])
        raw = logits.float()
        scaled = raw / torch.tensor(temps).unsqueeze(1)
        bits = 16 if dtype == torch.bfloat16 else 32
        key = _order_key(raw, bits)
        kept = (key >= floor.unsqueeze(1)) & (scaled >= min_x.unsqueeze(1))
        # The search ends on a key the row holds (or keeps everything): its interval collapsed.
        none = -(2**15) - 1 if bits == 16 else -(2**31)
        for i in range(len(TRUNCATIONS)):
            assert floor[i] == none or bool((key[i] == floor[i]).any()), (dtype, TRUNCATIONS[i])
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
                  for t, k, p, m in TRUNCATIONS]
        want = truncate(torch.softmax(scaled, dim=-1), params) > 0
        # The last row truncates nothing. (The sort path, run with the others, drops its tail
        # tokens whose preceding mass rounds above 1 in fp32: not compared.)
        for i, row in enumerate(TRUNCATIONS[:-1]):
            assert torch.equal(kept[i], want[i]), (dtype, row, kept[i].sum(), want[i].sum())
        assert kept[2].sum() == 1 and kept[8].sum() == 1 and kept[9].all()


@interpreted
def test_interpreted_truncated_draws_follow_the_truncated_softmax(monkeypatch):
    """150 seeded draws through `Sampler` from one bf16 row of 12 logits (chunks of 8 columns, as
    the untruncated test) under top-p 0.8 and under top-k 3: only kept tokens come out, each within
    0.1 of its renormalized probability; logprobs are those of the untruncated scores, as the
    general path returns."""
    from tide.layers import triton_ops

    monkeypatch.setattr(triton_ops, "SAMPLE_CHUNK", 8)
    monkeypatch.setattr(triton_ops, "_SAMPLE_BLOCK", 4)
    monkeypatch.setattr(triton_ops, "_TRUNC_BLOCK", 4)
    base = torch.tensor([0.5, -3.0, 1.0, -2.0, -4.0, -1.0, 2.0, -5.0, 0.0, -6.0, 1.5, -7.0])
    base = base.to(torch.bfloat16)
    n = 150
    logits = base.repeat(n, 1)
    for top_p, top_k in ((0.8, -1), (1.0, 3)):
        params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=i)
                  for i in range(n)]
        out = Sampler(0, one_pass=True)(logits, _info(params, [True] * n, [0] * n))
        probs = truncate(torch.softmax(base.float(), 0).unsqueeze(0), params[:1])[0]
        probs = probs / probs.sum()
        got = torch.bincount(torch.tensor(out.next_ids), minlength=12).float() / n
        assert set(torch.nonzero(got).flatten().tolist()) <= set(
            torch.nonzero(probs).flatten().tolist()), (got, probs)
        assert (got - probs).abs().max().item() < 0.1, (got, probs)
        logp = torch.log_softmax(base.float(), 0)
        assert out.logprobs is not None
        assert all(out.logprobs[i] == pytest.approx(logp[t].item(), abs=1e-5)
                   for i, t in enumerate(out.next_ids))


@interpreted
def test_interpreted_truncated_seeded_row_ignores_its_batch():
    """A seeded top-p row draws the same token alone, in a batch of truncated and plain rows, and
    read through `rows`; greedy rows with truncation parameters are still the argmax."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=11),
              SamplingParams(temperature=0.8, top_k=5, seed=12), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, top_p=0.1), SamplingParams(temperature=1.0, min_p=0.3),
              SamplingParams(temperature=1.0, top_p=0.7, seed=11)]
    out = Sampler(0, one_pass=True)(logits, _info(params, [True] * 6, [0] * 6))
    alone = Sampler(3, one_pass=True)(logits[:1], _info(params[:1], [True], [0]))
    assert out.next_ids[0] == alone.next_ids[0]
    assert out.next_ids[3] == int(logits[3].argmax())
    moved = Sampler(0, one_pass=True)._one_pass(
        logits, _info([params[5], params[1]], [True] * 2, [0] * 2), torch.tensor([0, 1]))
    assert int(moved.next_ids[0]) == out.next_ids[0]
    kept = truncate(torch.softmax(logits / torch.tensor([1.0, 0.8, 1, 1, 1, 1]).unsqueeze(1), -1),
                    params) > 0
    for i in (0, 1, 4, 5):
        assert kept[i, out.next_ids[i]]


@interpreted
def test_interpreted_truncation_edge_rows():
    """A vocabulary smaller than a chunk (17 columns): a row of -inf and NaN but for two tokens
    keeps only what it can (top-p 0.5 keeps the top one, top-k 5 both finite ones and the
    -inf/NaN ties below them, which are never drawn); a row of nothing but -inf keeps everything;
    zeros of both signs are one key (top-k 3 of a row of +-0 and one 1.0 keeps all 17)."""
    from tide.layers import triton_ops

    nan, inf = float("nan"), float("-inf")
    a = torch.full((17,), inf)
    a[[3, 9]] = torch.tensor([2.0, 1.0])
    a[[4, 5]] = nan
    b = torch.full((17,), inf)
    c = torch.zeros(17)
    c[::2] = -0.0
    c[7] = 1.0
    logits = torch.stack([a, a, b, c])
    floor, min_x = triton_ops.truncation_bounds(
        logits, torch.arange(4), torch.ones(4), [-1, 5, 3, 3], [0.5, 1.0, 0.5, 1.0], [0.0] * 4)
    key = _order_key(torch.where(logits.isnan(), inf, logits), 32)
    kept = key >= floor.unsqueeze(1)
    assert kept[0].nonzero().flatten().tolist() == [3]
    assert kept[1][[3, 9]].all() and torch.isinf(min_x).all()
    assert kept[2].all() and kept[3].all()
    out = Sampler(0, one_pass=True)(logits[:2], _info(
        [SamplingParams(temperature=1.0, top_k=5, seed=s) for s in (1, 2)], [True] * 2, [0] * 2))
    assert set(out.next_ids) <= {3, 9}
