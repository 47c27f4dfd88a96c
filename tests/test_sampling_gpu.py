"""The one-pass sampling kernel on a GPU: real vocabulary sizes, tight frequency checks, batch
independence of seeded rows, and the sampler's use of it (`pytest -m gpu tests/test_sampling_gpu.py`)."""

from __future__ import annotations

import pytest
import torch
from tide.layers.sampler import Sampler, SamplingBatchInfo
from tide.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 151936  # Qwen3's


def _sample(logits, temps, seeds, logprobs=True, rows=None):
    from tide.layers import triton_ops

    n = len(temps) if rows is None else len(rows)
    index = torch.arange(n, device="cuda") if rows is None else torch.tensor(rows, device="cuda")
    return triton_ops.sample_rows(logits, index,
                                  torch.tensor(temps, dtype=torch.float32, device="cuda"),
                                  torch.tensor(seeds, dtype=torch.int64, device="cuda"), logprobs)


def test_greedy_rows_match_torch_at_full_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, VOCAB, device="cuda", generator=g) * 4).to(torch.bfloat16)
    temps = [1.0 if i % 3 else 0.6 for i in range(256)]
    ids, logp = _sample(logits, temps, [-1] * 256)
    scaled = logits.float() / torch.tensor(temps, device="cuda").unsqueeze(1)
    assert torch.equal(ids, scaled.argmax(dim=-1))
    ref = torch.log_softmax(scaled, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-4)


def test_draws_follow_the_softmax_across_chunks():
    """20,000 rows of one 10,000-column distribution whose mass sits in 5 columns of 3 different
    chunks plus a uniform floor: every frequency within 0.012 of the softmax, at T = 1 and 0.7."""
    base = torch.full((10_000,), -6.0, device="cuda")
    hot = [3, 4100, 4101, 8300, 9999]
    base[hot] = torch.tensor([2.0, 1.5, 1.0, 0.0, 0.5], device="cuda")
    n = 20_000
    for t in (1.0, 0.7):
        logits = base.to(torch.bfloat16).repeat(n, 1)
        ids, _ = _sample(logits, [t] * n, list(range(7, 7 + n)), logprobs=False)
        want = torch.softmax(base.to(torch.bfloat16).float() / t, dim=0)
        got = torch.bincount(ids, minlength=10_000).float() / n
        assert (got[hot] - want[hot]).abs().max().item() < 0.012, (got[hot], want[hot])
        rest = [i for i in range(10_000) if i not in hot]
        assert abs(got[rest].sum().item() - want[rest].sum().item()) < 0.012


def test_a_peaked_row_never_draws_the_tail():
    """Token 0 at logit 0, every other at -40: each other token has probability ~4e-18, so 4,096
    rows x 151,935 tail columns should draw none (~2.6e-9 expected). Noise computed as +inf or
    badly wrong for uniforms near 1 (an approximate log there) would draw tail tokens."""
    logits = torch.full((4096, VOCAB), -40.0, device="cuda", dtype=torch.bfloat16)
    logits[:, 0] = 0.0
    ids, logp = _sample(logits, [1.0] * 4096, list(range(100, 4196)))
    assert torch.all(ids == 0)
    assert logp is not None and logp.abs().max().item() < 1e-5


def test_seeded_row_is_independent_of_batch_and_row():
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(64, VOCAB, device="cuda", generator=g).to(torch.bfloat16)
    alone, lp_alone = _sample(logits[40:41], [0.8], [1234])
    ids, lp = _sample(logits, [0.8] * 64, [1234 if i == 40 else i for i in range(64)])
    assert ids[40].item() == alone.item() and lp[40].item() == lp_alone.item()
    moved, lp_moved = _sample(logits, [1.0, 0.8], [5, 1234], rows=[3, 40])
    assert moved[1].item() == alone.item() and lp_moved[1].item() == lp_alone.item()


def test_sampler_rollout_batch_on_cuda():
    """An RL rollout batch (temperature 1, logprobs, half the rows seeded) through `Sampler`: the
    logprobs are the drawn tokens' log_softmax; a seeded row's token is the same in the batch and
    alone; a mixed batch (a top-p row among them) keeps the one-pass rows' tokens."""
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(32, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=1.0, seed=(i if i % 2 else None)) for i in range(32)]
    info = SamplingBatchInfo(params, [[]] * 32, [[1]] * 32, [True] * 32, [0] * 32)
    out = Sampler(0)(logits, info)
    assert out.logprobs is not None
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, tok in enumerate(out.next_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-4)
    alone = Sampler(99)(logits[5:6], info.select([5]))
    assert alone.next_ids[0] == out.next_ids[5]
    mixed = list(params)
    mixed[0] = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    out2 = Sampler(0)(logits, SamplingBatchInfo(mixed, [[]] * 32, [[1]] * 32, [True] * 32, [0] * 32))
    assert all(out2.next_ids[i] == out.next_ids[i] for i in range(1, 32, 2))


def test_warmup_compiles_every_kernel_serving_samples_with():
    """After `Sampler.warmup` for a model's vocabulary (bf16 decode-graph logits, fp32 otherwise),
    sampled steps of 1 to 256 rows, with and without logprobs, from a slice of a larger logits
    buffer as the decode graphs leave it, compile nothing more: no compile in a rollout's
    first steps."""
    from tide.layers import triton_ops

    vocab = 151_937  # not 16-divisible: another specialisation than the other tests compile
    device = torch.device("cuda")
    sampler = Sampler(0)
    sampler.warmup(vocab, (torch.bfloat16, torch.float32), device)
    index = torch.cuda.current_device()
    caches = [k.device_caches[index][0] for k in (triton_ops._sample_partial_kernel,
                                                   triton_ops._sample_final_kernel)]
    compiled = [len(c) for c in caches]
    assert all(n > 0 for n in compiled)
    for dtype in (torch.bfloat16, torch.float32):
        buffer = torch.randn(256, vocab, device=device).to(dtype)
        for rows in (1, 3, 16, 97, 256):
            for logprob in (False, True):
                params = [SamplingParams(temperature=1.0, seed=(i if i % 2 else None))
                          for i in range(rows)]
                info = SamplingBatchInfo(params, [[]] * rows, [[1]] * rows, [logprob] * rows,
                                         [0] * rows)
                out = sampler.sample(buffer[:rows], info)
                assert out.next_ids.shape == (rows,)
    torch.cuda.synchronize()
    assert [len(c) for c in caches] == compiled


def _order_key(x: torch.Tensor, bits: int) -> torch.Tensor:
    x = x.float()
    b = torch.where(x == 0, 0.0, x).view(torch.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)) >> (32 - bits)


def _kept_exactly(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The truncation rule in float64 with ties kept together: token i is kept iff fewer than
    top_k tokens score above it, the probability of those above it is at most top_p, and its own
    is at least min_p times the top one's. Also where a token is within float rounding of a
    boundary (either answer is right there)."""
    x = scaled.double()
    p = torch.softmax(x, 0)
    v, order = x.sort(descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    first = torch.searchsorted(-v, -x, side="left")  # tokens scoring strictly above each
    above = before[first]
    k = top_k if top_k > 0 else x.numel()
    kept = (first < k) & (above <= top_p) & (p >= min_p * p.max())
    near = ((above - top_p).abs() < 1e-5) | ((p - min_p * p.max()).abs() < 1e-5 * p)
    return kept, near


def test_truncation_bounds_at_full_vocabulary():
    """64 rows of Qwen3's vocabulary, fp32 and bf16 logits (bf16: many ties), under top-k, top-p,
    both, and min-p: the kept tokens are the rule's, computed exactly in float64 with tied tokens
    kept together, except where a token is within rounding of a boundary (at most a few)."""
    from tide.layers import triton_ops

    g = torch.Generator(device="cuda").manual_seed(3)
    settings = [(1.0, -1, 0.9, 0.0), (0.7, 50, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 400, 0.5, 0.0),
                (0.9, 20, 0.95, 0.0), (1.0, -1, 0.99, 0.0), (1.2, 2000, 1.0, 0.0),
                (1.0, -1, 1.0, 0.1)] * 8
    n = len(settings)
    temps = [t for t, _, _, _ in settings]
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(n, VOCAB, device="cuda", generator=g) * 3).to(dtype)
        floor, min_x = triton_ops.truncation_bounds(
            logits, torch.arange(n, device="cuda"), torch.tensor(temps, device="cuda"),
            [k for _, k, _, _ in settings], [p for _, _, p, _ in settings],
            [m for _, _, _, m in settings])
        raw = logits.float()
        scaled = raw / torch.tensor(temps, device="cuda").unsqueeze(1)
        bits = 16 if dtype == torch.bfloat16 else 32
        kept = (_order_key(raw, bits) >= floor.unsqueeze(1)) & (scaled >= min_x.unsqueeze(1))
        for i, (_, k, p, m) in enumerate(settings):
            want, near = _kept_exactly(scaled[i], k, p, m)
            wrong = kept[i] != want
            assert not (wrong & ~near).any(), (dtype, settings[i], kept[i].sum(), want.sum())
            assert wrong.sum() <= 3 and kept[i].any()


def test_truncated_draws_follow_the_truncated_softmax():
    """20,000 seeded top-p 0.85 draws, and as many top-k 3, of one 10,000-column distribution
    whose mass sits in 5 columns of 3 chunks (top-p keeps 4 of them): only kept tokens, each
    within 0.012 of its renormalized probability; logprobs untruncated."""
    from tide.layers.sampler import truncate

    base = torch.full((10_000,), -12.0, device="cuda")
    hot = [3, 4100, 4101, 8300, 9999]
    base[hot] = torch.tensor([2.0, 1.5, 1.0, 0.0, 0.5], device="cuda")
    base = base.to(torch.bfloat16)
    n = 20_000
    logits = base.repeat(n, 1)
    for top_p, top_k in ((0.85, -1), (1.0, 3)):
        params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=7 + i)
                  for i in range(n)]
        info = SamplingBatchInfo(params, [[]] * n, [[1]] * n, [True] * n, [0] * n)
        out = Sampler(0).sample(logits, info)
        probs = truncate(torch.softmax(base.float(), 0).unsqueeze(0), params[:1])[0]
        probs = probs / probs.sum()
        got = torch.bincount(out.next_ids, minlength=10_000).float() / n
        assert torch.all(got[probs == 0] == 0)
        assert (got - probs).abs().max().item() < 0.012, (got[hot], probs[hot])
        ref = torch.log_softmax(base.float(), 0)[out.next_ids]
        torch.testing.assert_close(out.logprobs, ref, rtol=1e-5, atol=1e-4)


def test_truncation_bounds_do_not_depend_on_the_batch():
    """1,024 top-p rows of fp32 logits (32-bit keys: a top-p floor sits on one token) keep the same
    floors and min scores alone, with a top-k row and a min-p row added to their batch (which
    compiles the searches differently), and split into batches of 100 rows."""
    from tide.layers import triton_ops

    g = torch.Generator(device="cuda").manual_seed(9)
    n = 1024
    logits = torch.randn(n + 2, VOCAB, device="cuda", generator=g) * 3
    top_p = [(0.5, 0.9, 0.95, 0.99)[i % 4] for i in range(n)]
    temps = torch.full((n + 2,), 0.9, device="cuda")

    def bounds(rows: list[int], k: list[int], p: list[float], m: list[float]):
        return triton_ops.truncation_bounds(logits, torch.tensor(rows, device="cuda"),
                                            temps[: len(rows)], k, p, m)

    alone = bounds(list(range(n)), [-1] * n, top_p, [0.0] * n)
    mixed = bounds(list(range(n + 2)), [-1] * n + [50, -1], top_p + [1.0, 1.0],
                   [0.0] * (n + 1) + [0.1])
    assert torch.equal(alone[0], mixed[0][:n]) and torch.equal(alone[1], mixed[1][:n])
    for start in range(0, n, 100):
        rows = list(range(start, min(start + 100, n)))
        part = bounds(rows, [-1] * len(rows), top_p[start: start + len(rows)], [0.0] * len(rows))
        assert torch.equal(part[0], alone[0][start: start + len(rows)])


def test_logit_bias_rows_on_a_cuda_engine(tmp_path):
    """`logit_bias` rows beside plain ones on a CUDA engine (graphs, overlap, one-pass sampling
    for the plain rows): banned tokens never come, a +100 token always does (greedy and drawn), and
    the plain rows keep the tokens they get without the biased rows beside them."""
    import tide
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path / "llama", "llama")
    engine = tide.Engine(str(path), dtype="float32", max_total_tokens=8192)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 90)]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    banned = set(plain[0][:4])
    params = [
        {**greedy, "logit_bias": {t: -100 for t in banned}},
        {**greedy, "logit_bias": {7: 100}},
        greedy,
        {**greedy, "temperature": 1.0, "seed": 3, "logit_bias": {9: 100, 11: -100}},
        greedy,
    ]
    outs = [o["output_ids"] for o in engine.generate(
        input_ids=[*prompts, prompts[3]], sampling_params=params)]
    assert not banned & set(outs[0]) and outs[0] != plain[0]
    assert outs[1] == [7] * 24
    assert outs[2] == plain[2] and outs[4] == plain[3]
    assert outs[3] == [9] * 24
    engine.shutdown()


def test_min_new_tokens_rows_on_a_cuda_engine(tmp_path):
    """`min_new_tokens` rows beside plain ones on a CUDA engine (graphs, overlap, one-pass sampling
    for the plain rows and, once their minimum is reached, for the drawn ones): no ending token
    before the minimum, where without it they end within a few tokens; the plain rows keep their
    tokens."""
    import tide
    from conftest import VOCAB, build_checkpoint

    path = build_checkpoint(tmp_path / "llama", "llama")
    engine = tide.Engine(str(path), dtype="float32", max_total_tokens=8192)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 90)]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    ending = list(range(VOCAB // 2))
    held = [{**greedy, "temperature": t, "seed": i, "stop_token_ids": ending, "min_new_tokens": m}
            for i, (t, m) in enumerate([(0, 12), (1.0, 16), (0.7, 20)])]
    outs = engine.generate(input_ids=[prompts[0], prompts[1], prompts[2], prompts[3], prompts[2]],
                           sampling_params=[held[0], held[1], held[2], greedy, greedy])
    for p, out in zip(held, outs):
        ids = out["output_ids"]
        assert len(ids) >= p["min_new_tokens"] and min(ids[:p["min_new_tokens"]]) >= VOCAB // 2
        assert len(ids) == p["max_new_tokens"] or ids[-1] < VOCAB // 2
    assert outs[3]["output_ids"] == plain[3] and outs[4]["output_ids"] == plain[2]
    free = engine.generate(input_ids=prompts[:3], sampling_params=[
        {k: v for k, v in p.items() if k != "min_new_tokens"} for p in held])
    assert min(len(o["output_ids"]) for o in free) < 12
    engine.shutdown()
