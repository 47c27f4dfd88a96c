"""Sampling: seeded reproducibility, greedy equivalences, truncation and penalties (unit level against
hand-computed values, engine level against an HF-forward reference)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tide
from conftest import random_prompts
from tide.layers.sampler import Sampler, SamplingBatchInfo, edit_logits, truncate
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.scheduler.schedule_batch import sampling_info

MAX_NEW = 32
PROMPT = random_prompts(31, [12])[0]
OTHERS = random_prompts(32, [5, 20, 33, 9])


def _req(origin=(1,), output=(), **params) -> Req:
    return Req(
        rid="u",
        origin_input_ids=list(origin),
        sampling_params=SamplingParams(**params),
        output_ids=list(output),
    )


def _info(reqs: list[Req]) -> SamplingBatchInfo:
    """The sampler's arguments for `reqs`, spelled out (never the argmax-only shortcut)."""
    return SamplingBatchInfo(
        params=[r.sampling_params for r in reqs],
        output_ids=[r.output_ids for r in reqs],
        prompt_ids=[r.origin_input_ids for r in reqs],
        return_logprob=[r.return_logprob for r in reqs],
        top_logprobs_num=[r.top_logprobs_num for r in reqs],
    )


def _sample(engine, prompt=PROMPT, **params):
    params = {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **params}
    return engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]


def _hf_step_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] fp32 logits that predicted each output token (one full HF forward)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 :]


# ---- seeded sampling (engine level)


def test_seeded_sampling_is_reproducible(llama_engine):
    a = _sample(llama_engine, seed=1234)
    b = _sample(llama_engine, seed=1234)
    assert len(a) == MAX_NEW
    assert a == b


def test_seeded_sampling_independent_of_batch(llama_engine, llama_path):
    alone = _sample(llama_engine, seed=1234)
    mixed_params = [
        {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True},  # unseeded
        {"temperature": 0.7, "max_new_tokens": 10, "ignore_eos": True, "seed": 99},
        {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": 1234, "top_k": 50},
        {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": 1234},
    ]
    prompts = OTHERS + [PROMPT]
    outs = llama_engine.generate(input_ids=prompts, sampling_params=mixed_params)
    assert outs[-1]["output_ids"] == alone
    # Same under chunked prefill and under KV pressure (retraction re-prefills the request).
    for opts in ({"chunked_prefill_size": 8}, {"max_total_tokens": 72}):
        engine = tide.Engine(str(llama_path), **opts)
        outs = engine.generate(input_ids=prompts, sampling_params=mixed_params)
        assert outs[-1]["output_ids"] == alone, opts
        if "max_total_tokens" in opts:
            assert engine.scheduler.stats.num_retractions > 0


def test_different_seeds_differ(llama_engine):
    runs = {tuple(_sample(llama_engine, seed=s)) for s in (1, 2, 3)}
    assert len(runs) == 3


def test_engine_seed_makes_unseeded_sampling_reproducible(llama_path):
    a = tide.Engine(str(llama_path), seed=7)
    b = tide.Engine(str(llama_path), seed=7)
    first = _sample(a)
    assert first == _sample(b)
    assert _sample(a) != first, "unseeded requests should keep drawing fresh noise"


def test_replicas_draw_different_unseeded_samples(llama_path):
    """Replicas of one config (`dp_rank` 0 and 1, as `--dp-size` and RayEngine set it) draw
    different tokens for the same unseeded request at the same point of their runs: GRPO samples
    of a prompt spread over replicas are not copies. A seeded request is the same on both."""
    from tide.cluster.dp_controller import plan_replicas
    from tide.config import EngineConfig

    plans = plan_replicas(EngineConfig(model_path=str(llama_path), seed=7, device="cpu"), 2)
    assert [p.config.dp_rank for p in plans] == [0, 1]
    engines = [tide.Engine(**dataclasses.asdict(p.config)) for p in plans]
    try:
        unseeded = [_sample(e) for e in engines]
        assert unseeded[0] != unseeded[1]
        assert _sample(engines[0], seed=3) == _sample(engines[1], seed=3)
    finally:
        for e in engines:
            e.shutdown()


def test_n_copies_with_seed_are_distinct_samples(llama_engine):
    """n>1 asks for n samples of one prompt; a seed should make them reproducible, not identical."""
    params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": 5, "n": 4}
    outs = llama_engine.generate(input_ids=PROMPT, sampling_params=params)
    again = llama_engine.generate(input_ids=PROMPT, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    distinct = {tuple(o["output_ids"]) for o in outs}
    assert len(distinct) > 1, (
        "all n=4 seeded samples are identical: every copy shares one seed, so each draws the same "
        "noise at every position"
    )


# ---- greedy equivalences


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_k": 1, "temperature": 0.3},
        {"min_p": 1.0},
        {"top_p": 1e-6},
    ],
    ids=["top_k1", "top_k1_t0.3", "min_p1", "top_p_tiny"],
)
def test_truncation_to_one_token_equals_greedy(llama_engine, params):
    greedy = _sample(llama_engine, temperature=0)
    assert _sample(llama_engine, **params) == greedy
    assert _sample(llama_engine, seed=3, **params) == greedy


# ---- engine-level truncation and temperature against the HF distribution


def test_sampled_logprobs_match_hf_at_temperature(llama_engine, hf_model_for):
    temp = 0.7
    out = llama_engine.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": temp, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": 8},
        return_logprob=True,
    )
    ids = out["output_ids"]
    ref = torch.log_softmax(_hf_step_logits(hf_model_for("llama"), PROMPT, ids) / temp, dim=-1)
    ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
    expected = ref[torch.arange(len(ids)), torch.tensor(ids)]
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "params", [{"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.2}], ids=["top_k3", "top_p0.3", "min_p0.2"]
)
def test_sampled_tokens_respect_truncation(llama_engine, hf_model_for, params):
    model = hf_model_for("llama")
    seen_non_argmax = False
    for seed in range(4):
        out = llama_engine.generate(
            input_ids=PROMPT,
            sampling_params={"temperature": 1.5, "max_new_tokens": 16, "ignore_eos": True, "seed": seed, **params},
        )
        ids = out["output_ids"]
        probs = torch.softmax(_hf_step_logits(model, PROMPT, ids) / 1.5, dim=-1)
        for step, tok in enumerate(ids):
            p = probs[step]
            sorted_p, order = p.sort(descending=True)
            rank = (order == tok).nonzero().item()
            seen_non_argmax |= rank > 0
            if "top_k" in params:
                assert rank < params["top_k"]
            if "top_p" in params:
                assert (sorted_p[:rank].sum() <= params["top_p"] + 1e-4), (step, rank)
            if "min_p" in params:
                assert p[tok] >= params["min_p"] * sorted_p[0] - 1e-5
    assert seen_non_argmax, "truncated sampling never left the argmax: truncation is too strict"


# ---- penalties against a reference loop over HF logits


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.2},
        {"frequency_penalty": 0.7, "presence_penalty": -0.5, "repetition_penalty": 1.2},
    ],
    ids=["rep1.3", "rep0.8", "freq", "pres", "all"],
)
def test_greedy_penalties_match_reference(llama_engine, hf_model_for, penalties):
    model = hf_model_for("llama")
    n_new = 16
    # A prompt with repeats so the repetition penalty has prompt tokens to act on.
    prompt = PROMPT + PROMPT[:6]
    out = llama_engine.generate(
        input_ids=prompt,
        sampling_params={"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True, **penalties},
        return_logprob=True,
    )
    freq = penalties.get("frequency_penalty", 0.0)
    pres = penalties.get("presence_penalty", 0.0)
    rep = penalties.get("repetition_penalty", 1.0)
    seq = list(prompt)
    ref_ids, ref_lps = [], []
    for _ in range(n_new):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1].float().clone()
        counts = torch.bincount(torch.tensor(ref_ids, dtype=torch.int64), minlength=logits.numel())
        logits -= freq * counts + pres * (counts > 0).float()
        seen = torch.tensor(sorted(set(seq)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        tok = int(logits.argmax())
        ref_lps.append(torch.log_softmax(logits, -1)[tok].item())
        ref_ids.append(tok)
        seq.append(tok)
    assert out["output_ids"] == ref_ids
    ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4
    # The penalty must matter on this prompt (else the test proves nothing).
    plain = llama_engine.generate(
        input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}
    )
    assert plain["output_ids"] != ref_ids


def test_hf_repetition_penalty_parity(llama_engine, hf_model_for):
    model = hf_model_for("llama")
    prompt = PROMPT + PROMPT[:6]
    out = llama_engine.generate(
        input_ids=prompt,
        sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "repetition_penalty": 1.3},
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
            repetition_penalty=1.3, pad_token_id=0,
        )
    assert out["output_ids"] == hf[0, len(prompt):].tolist()


def test_hf_logit_bias_parity(llama_engine, hf_model_for):
    """`logit_bias` gives HF's `sequence_bias` tokens (one-token sequences: a bias added to that
    token's logit), greedy and with the biased logprobs; banning the greedy tokens changes them."""
    model = hf_model_for("llama")
    plain = llama_engine.generate(input_ids=PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})["output_ids"]
    bias = {t: -100.0 for t in plain[:4]} | {7: 3.5, 300: 2.0}
    out = llama_engine.generate(input_ids=PROMPT, return_logprob=True, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True,
        "logit_bias": {str(t): b for t, b in bias.items()}})
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=12, pad_token_id=0,
                            sequence_bias={(t,): b for t, b in bias.items()})
    got = out["output_ids"]
    assert got == hf[0, len(PROMPT):].tolist()
    assert not set(got) & set(plain[:4])
    logits = _hf_step_logits(model, PROMPT, got)
    for t, b in bias.items():
        logits[:, t] += b
    ref = torch.log_softmax(logits, dim=-1)[torch.arange(len(got)), torch.tensor(got)]
    lps = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(ref.tolist(), abs=1e-4)


def test_logit_bias_edits_before_penalties_and_checks_its_values():
    req = _req(origin=[1], output=[2], logit_bias={"2": 1.5, 5: -100}, repetition_penalty=2.0)
    assert req.sampling_params.logit_bias == {2: 1.5, 5: -100.0}
    out = edit_logits(torch.tensor([LOGITS]), _info([req]))[0]
    expected = list(LOGITS)
    expected[1] = expected[1] * 2.0
    expected[2] = (expected[2] + 1.5) / 2.0  # biased first, then penalised
    expected[5] -= 100.0
    assert out.tolist() == pytest.approx(expected)
    import numpy as np

    assert SamplingParams(logit_bias={np.int64(3): np.float32(1.5)}).logit_bias == {3: 1.5}
    for bad in ({"x": 1.0}, {-1: 1.0}, {"1e3": 1.0}, {1: 101.0}, {1: float("nan")}, {1: "2"},
                {True: 1.0}, [1, 2], {i: 1.0 for i in range(1025)}, {"05": 1.0, 5: -1.0},
                {1: 10**400}):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="^logit_bias holds token 600"):
        SamplingParams(logit_bias={600: 1.0}).check_vocab(512)


# ---- unit: truncate


PROBS = [0.05, 0.3, 0.1, 0.4, 0.15]  # sorted: 0.4 (id 3), 0.3 (id 1), 0.15 (id 4), 0.1 (id 2), 0.05 (id 0)


def _kept(row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v > 0}


@pytest.mark.parametrize(
    "params,kept",
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 1}, {3}),
        ({"top_k": 2}, {3, 1}),
        ({"top_k": 4}, {3, 1, 4, 2}),
        ({"top_k": 10}, {0, 1, 2, 3, 4}),
        ({"top_p": 0.35}, {3}),  # excl. cumsum: 0, .4, .7, .85, .95
        ({"top_p": 0.5}, {3, 1}),
        ({"top_p": 0.8}, {3, 1, 4}),
        ({"top_p": 0.9}, {3, 1, 4, 2}),
        ({"top_p": 1e-9}, {3}),  # the top token always survives
        ({"min_p": 0.5}, {3, 1}),  # threshold 0.2
        ({"min_p": 0.3}, {3, 1, 4}),  # threshold 0.12
        ({"min_p": 1.0}, {3}),
        ({"top_k": 3, "top_p": 0.5}, {3, 1}),
        ({"top_k": 2, "min_p": 0.1}, {3, 1}),
        ({"top_p": 0.9, "min_p": 0.3}, {3, 1, 4}),
    ],
)
def test_truncate_masks(params, kept):
    probs = torch.tensor([PROBS])
    out = truncate(probs.clone(), [SamplingParams(**params)])
    assert _kept(out[0]) == kept
    # Kept entries keep their values (no renormalisation: the draw is scale-free).
    for i in kept:
        assert out[0, i].item() == pytest.approx(PROBS[i])


def test_truncate_per_row_parameters():
    probs = torch.tensor([PROBS, PROBS[::-1], PROBS])
    params = [SamplingParams(top_k=2), SamplingParams(min_p=0.5), SamplingParams()]
    out = truncate(probs.clone(), params)
    assert _kept(out[0]) == {3, 1}
    assert _kept(out[1]) == {1, 3}  # reversed row: 0.4 at id 1, 0.3 at id 3
    assert torch.equal(out[2], probs[2])


def test_truncate_keeps_every_token_at_top_p_one():
    """A row with top_p = 1 in a batch where another row truncates keeps its whole tail, even where
    the mass before a token rounds above 1 (fp32 sums of a softmax can)."""
    probs = torch.tensor([[0.7, 0.4, 0.01, 0.001], [0.7, 0.4, 0.01, 0.001]])
    out = truncate(probs.clone(), [SamplingParams(), SamplingParams(top_p=0.5)])
    assert torch.equal(out[0], probs[0])
    assert _kept(out[1]) == {0}


# ---- unit: penalties


LOGITS = [1.0, -2.0, 3.0, -0.5, 0.25, 2.0]


def test_frequency_penalty_exact():
    req = _req(origin=[1, 4], output=[2, 3, 3, 3], frequency_penalty=0.5)
    out = edit_logits(torch.tensor([LOGITS]), _info([req]))[0]
    expected = list(LOGITS)
    expected[2] -= 0.5 * 1
    expected[3] -= 0.5 * 3
    assert out.tolist() == pytest.approx(expected)  # prompt tokens 1 and 4 untouched


def test_presence_penalty_exact():
    req = _req(origin=[1, 4], output=[2, 3, 3, 3], presence_penalty=0.75)
    out = edit_logits(torch.tensor([LOGITS]), _info([req]))[0]
    expected = list(LOGITS)
    expected[2] -= 0.75
    expected[3] -= 0.75
    assert out.tolist() == pytest.approx(expected)


def test_repetition_penalty_exact():
    req = _req(origin=[1, 2, 2], output=[3, 4], repetition_penalty=2.0)
    out = edit_logits(torch.tensor([LOGITS]), _info([req]))[0]
    expected = list(LOGITS)
    for t in (1, 2, 3, 4):  # prompt and output tokens, each once even if repeated
        expected[t] = expected[t] / 2.0 if expected[t] > 0 else expected[t] * 2.0
    assert out.tolist() == pytest.approx(expected)


def test_combined_penalties_and_untouched_rows():
    logits = torch.tensor([LOGITS, LOGITS])
    before = logits.clone()
    pen = _req(origin=[0], output=[2, 2], frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5)
    plain = _req(origin=[0], output=[2, 2])
    out = edit_logits(logits, _info([pen, plain]))
    assert torch.equal(logits, before), "edit_logits must not modify its input"
    assert torch.equal(out[1], before[1])
    expected = list(LOGITS)
    expected[2] = (3.0 - 2 * 1.0 - 0.5) / 1.5  # frequency/presence first, then repetition
    expected[0] = 1.0 / 1.5
    assert out[0].tolist() == pytest.approx(expected)


def test_penalties_with_no_output_yet():
    req = _req(origin=[5], output=[], frequency_penalty=1.0, presence_penalty=1.0)
    out = edit_logits(torch.tensor([LOGITS]), _info([req]))[0]
    assert out.tolist() == pytest.approx(LOGITS)


# ---- unit: Sampler


def test_sampler_greedy_rows_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    reqs = [
        _req(temperature=0.0),
        _req(temperature=0.5, top_k=1),
        _req(temperature=2.0, seed=4),
    ]
    for r in reqs:
        r.return_logprob = True
    reqs[0].top_logprobs_num = 3
    out = Sampler(seed=0)(logits.clone(), _info(reqs))
    assert out.next_ids[0] == int(logits[0].argmax())
    assert out.next_ids[1] == int(logits[1].argmax())
    temps = [1.0, 0.5, 2.0]  # temperature 0 reports logprobs at temperature 1
    for i, t in enumerate(temps):
        expected = torch.log_softmax(logits[i] / t, -1)[out.next_ids[i]].item()
        assert out.logprobs[i] == pytest.approx(expected, abs=1e-5)
    assert len(out.top_logprobs[0]) == 3 and out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    vals, ids = torch.log_softmax(logits[0], -1).topk(3)
    assert [t for _, t in out.top_logprobs[0]] == ids.tolist()
    # Seeded rows: same draw whatever else is in the batch.
    again = Sampler(seed=123)(logits[2:].clone(), _info([reqs[2]]))
    assert again.next_ids[0] == out.next_ids[2]


def test_sampler_streams_split_unseeded_draws_and_keep_seeded_ones():
    """Data-parallel replicas of one engine config differ only in `dp_rank`, the sampler's stream.
    Stream 0 is the seed's own stream (what a single engine always drew). Two streams draw
    different unseeded tokens from the same logits, so GRPO samples of a prompt sent to two
    replicas are not copies. Seeded rows draw the same tokens in every stream."""
    logits = torch.zeros(64, 1000)  # uniform: each token is the noise's alone
    unseeded = _info([_req(temperature=1.0) for _ in range(64)])
    single = Sampler(seed=5)(logits.clone(), unseeded).next_ids
    assert Sampler(seed=5, stream=0)(logits.clone(), unseeded).next_ids == single
    other = Sampler(seed=5, stream=1)(logits.clone(), unseeded).next_ids
    assert sum(a == b for a, b in zip(single, other)) < 6  # ~0.06 expected by chance
    assert Sampler(seed=5, stream=1)(logits.clone(), unseeded).next_ids == other
    seeded = _info([_req(temperature=1.0, seed=i) for i in range(64)])
    assert (Sampler(seed=5)(logits.clone(), seeded).next_ids
            == Sampler(seed=5, stream=3)(logits.clone(), seeded).next_ids)


def test_sampling_info_takes_the_argmax_shortcut_only_when_every_row_allows_it():
    greedy = _req(temperature=0.0)
    info = sampling_info([greedy, _req(temperature=0.0, top_k=1)])
    assert info.argmax_only and info.size == 0  # the shared shortcut: nothing else is read
    logprob = _req(temperature=0.0)
    logprob.return_logprob = True
    for other in (logprob, _req(temperature=0.0, repetition_penalty=1.2), _req(temperature=0.7),
                  _req(temperature=0.0, logit_bias={2: -100})):
        info = sampling_info([greedy, other])
        assert not info.argmax_only and info.size == 2
        assert info.params[1] is other.sampling_params and info.output_ids[1] is other.output_ids
    # The shortcut uses the argmax a CUDA-graph replay already computed, when given.
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    out = Sampler(seed=0)(logits, sampling_info([greedy, greedy]), torch.tensor([1, 0]))
    assert out.next_ids == [1, 0] and out.logprobs is None


def test_sampler_draw_follows_distribution():
    """Over many seeded draws from a fixed 4-way distribution the frequencies match it."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(4)
    sampler = Sampler(seed=0)
    n = 2000
    rows = logits.repeat(n, 1)
    reqs = [_req(temperature=1.0) for _ in range(n)]
    for tok in sampler(rows, _info(reqs)).next_ids:
        counts[tok] += 1
    freq = counts / n
    # 4 sigma of a binomial at n=2000 is < 0.045.
    assert torch.allclose(freq, probs, atol=0.045), freq.tolist()
    assert math.isclose(freq.sum().item(), 1.0)


def test_n_copies_with_largest_seed(llama_engine):
    """seed = 2**63 - 1 is valid; asking for n > 1 samples with it must not be rejected."""
    params = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 2**63 - 1}
    single = llama_engine.generate(input_ids=PROMPT, sampling_params=params)
    assert len(single["output_ids"]) == 4
    outs = llama_engine.generate(input_ids=PROMPT, sampling_params={**params, "n": 2})
    assert len(outs) == 2
    assert not llama_engine.scheduler.has_work()
