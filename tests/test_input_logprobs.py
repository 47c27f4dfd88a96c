"""Input (prompt) logprobs: `logprob_start_len` with `return_logprob` (sglang's names).

HF transformers' full-sequence forward is the reference: the entry of prompt position p is
log_softmax(logits at p - 1)[token p], position 0 has none (None). Chunked prefill, cached prefixes,
max_new_tokens=0 (scoring only), temperature, top logprobs and tensor parallelism all give the same
entries.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

import tide


def _hf_logp(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def _check_against_hf(entries, top_entries, logp: torch.Tensor, ids: list[int], start: int,
                      top: int) -> None:
    assert len(entries) == len(ids) - start
    for k, (value, token) in enumerate(entries):
        p = start + k
        assert token == ids[p]
        if p == 0:
            assert value is None
            continue
        assert value == pytest.approx(logp[p - 1, ids[p]].item(), abs=2e-4), p
    if top:
        assert len(top_entries) == len(entries)
        for k, row in enumerate(top_entries):
            p = start + k
            if p == 0:
                assert row is None
                continue
            vals, tokens = logp[p - 1].topk(top)
            assert [t for _, t in row] == tokens.tolist(), p
            assert [v for v, _ in row] == pytest.approx(vals.tolist(), abs=2e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_input_logprobs_match_hf_across_chunks(arch, checkpoints, hf_model_for):
    hf = hf_model_for(arch)
    prompts = random_prompts(11, [5, 23, 40, 2])
    starts = [0, 3, 39, 1]
    # Chunks of 16 tokens: the scored rows of the 23- and 40-token prompts span several steps.
    with tide.Engine(str(checkpoints[arch]), chunked_prefill_size=16, max_prefill_tokens=16) as e:
        outs = e.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=3,
                          logprob_start_len=starts,
                          sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        for ids, start, out in zip(prompts, starts, outs):
            meta = out["meta_info"]
            _check_against_hf(meta["input_token_logprobs"], meta["input_top_logprobs"],
                              _hf_logp(hf, ids), ids, start, 3)
            assert len(out["output_ids"]) == 2 and len(meta["output_token_logprobs"]) == 2


def test_cached_prefix_is_recomputed_for_the_scored_positions(checkpoints, hf_model_for):
    hf = hf_model_for("llama")
    ids = random_prompts(12, [30])[0]
    logp = _hf_logp(hf, ids)
    with tide.Engine(str(checkpoints["llama"])) as e:
        greedy = {"max_new_tokens": 1, "temperature": 0}
        e.generate(input_ids=ids, sampling_params=greedy)  # the prompt is now cached
        out = e.generate(input_ids=ids, sampling_params=greedy, return_logprob=True,
                         logprob_start_len=10)
        meta = out["meta_info"]
        assert meta["cached_tokens"] == 9  # positions 9.. are computed: row 9 predicts token 10
        _check_against_hf(meta["input_token_logprobs"], None, logp, ids, 10, 0)
        # Without input logprobs the whole cached prefix is used.
        again = e.generate(input_ids=ids, sampling_params=greedy, return_logprob=True)
        assert again["meta_info"]["cached_tokens"] == 29
        assert "input_token_logprobs" not in again["meta_info"]


def test_scoring_only_and_replaying_an_output(llama_engine):
    prompt = random_prompts(13, [12])[0]
    sampled = {"max_new_tokens": 6, "temperature": 0.7, "seed": 5, "ignore_eos": True}
    out = llama_engine.generate(input_ids=prompt, sampling_params=sampled, return_logprob=True)
    full = prompt + out["output_ids"]
    # max_new_tokens = 0 scores the sequence and generates nothing; the same temperature gives the
    # logprobs the output was sampled with.
    scored = llama_engine.generate(
        input_ids=full, return_logprob=True, logprob_start_len=len(prompt),
        sampling_params={"max_new_tokens": 0, "temperature": 0.7})
    assert scored["output_ids"] == []
    assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert scored["meta_info"]["completion_tokens"] == 0
    got = scored["meta_info"]["input_token_logprobs"]
    want = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in got] == [t for _, t in want]
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-5)
    # max_new_tokens = 0 without input logprobs still finishes at once, with no forward.
    assert llama_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})[
        "output_ids"] == []


def test_mixed_batch_and_n(llama_engine, hf_model_for):
    hf = hf_model_for("llama")
    stats = llama_engine.scheduler.stats
    deferrals = stats.num_prefix_deferrals
    prompts = random_prompts(14, [9, 17, 6])
    outs = llama_engine.generate(
        input_ids=prompts, return_logprob=[True, False, True], logprob_start_len=[0, 0, 6],
        sampling_params={"max_new_tokens": 3, "temperature": 0, "n": 2})
    assert len(outs) == 6
    for k in (0, 1):
        meta = outs[k]["meta_info"]
        _check_against_hf(meta["input_token_logprobs"], None, _hf_logp(hf, prompts[0]),
                          prompts[0], 0, 0)
    assert all("input_token_logprobs" not in o["meta_info"] for o in outs[2:4])
    # A start at the prompt's length asks for nothing.
    assert all("input_token_logprobs" not in o["meta_info"] for o in outs[4:])
    # Copies of a prompt scored from position 0 cannot use each other's cached prefix, so none
    # waits for it.
    assert stats.num_prefix_deferrals == deferrals


@pytest.mark.parametrize("value", [-2, "1", 1.0, True, None])
def test_bad_logprob_start_len_is_named(llama_engine, value):
    with pytest.raises(ValueError, match="logprob_start_len"):
        llama_engine.generate(input_ids=[3, 4, 5], return_logprob=True, logprob_start_len=value)


def test_input_logprobs_under_tensor_parallel(checkpoints, hf_model_for):
    hf = hf_model_for("llama")
    ids = random_prompts(15, [26])[0]
    with tide.Engine(str(checkpoints["llama"]), tp_size=2, chunked_prefill_size=8,
                     max_prefill_tokens=8) as e:
        out = e.generate(input_ids=ids, return_logprob=True, top_logprobs_num=2,
                         logprob_start_len=0, sampling_params={"max_new_tokens": 1})
    meta = out["meta_info"]
    _check_against_hf(meta["input_token_logprobs"], meta["input_top_logprobs"], _hf_logp(hf, ids),
                      ids, 0, 2)


def test_retraction_mid_prompt_and_mixed_chunks_keep_the_entries(checkpoints, hf_model_for):
    """A scored prompt retracted between two of its chunks resumes where its entries stop (its
    cached part is reused up to there); decode riders of mixed chunks do not disturb the rows."""
    from tide.sampling_params import SamplingParams
    from tide.scheduler.request import Req

    hf = hf_model_for("llama")
    ids = random_prompts(16, [45])[0]
    logp = _hf_logp(hf, ids)
    with tide.Engine(str(checkpoints["llama"]), chunked_prefill_size=16, max_prefill_tokens=16,
                     enable_mixed_chunk=True) as e:
        sched = e.scheduler
        runner = Req("runner", random_prompts(17, [4])[0],
                     SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
        sched.add_request(runner)
        sched.step()  # the runner decodes while the scored prompt prefills (mixed chunks)
        scored = Req("scored", list(ids), SamplingParams(max_new_tokens=2, temperature=0,
                                                         ignore_eos=True),
                     return_logprob=True, top_logprobs_num=2, logprob_start_len=5)
        sched.add_request(scored)
        sched.step()
        assert sched.chunked_req is scored and 0 < len(scored.input_token_logprobs) < 40
        assert sched.retract_all() == 2
        # Its prompt is recomputed (maybe with new weights, after a pause that retracts and an
        # update): every entry is scored again.
        assert scored.input_token_logprobs == [] and scored.input_top_logprobs == []
        while not (scored.finished and runner.finished):
            sched.step()
    _check_against_hf(scored.input_token_logprobs, scored.input_top_logprobs, logp, ids, 5, 2)
    assert scored.num_retractions == 1 and len(scored.output_ids) == 2


def test_scored_rows_go_through_the_head_in_pieces(checkpoints, hf_model_for, monkeypatch):
    from conftest import VOCAB

    from tide.executor import model_runner

    monkeypatch.setattr(model_runner, "SCORE_PIECE_LOGITS", 7 * VOCAB)  # pieces of 7 rows
    hf = hf_model_for("qwen3")
    ids = random_prompts(18, [33])[0]
    with tide.Engine(str(checkpoints["qwen3"])) as e:
        out = e.generate(input_ids=ids, return_logprob=True, top_logprobs_num=4,
                         logprob_start_len=0, sampling_params={"max_new_tokens": 1})
    meta = out["meta_info"]
    _check_against_hf(meta["input_token_logprobs"], meta["input_top_logprobs"], _hf_logp(hf, ids),
                      ids, 0, 4)


def test_a_request_aborted_mid_prompt_reports_no_input_logprobs(llama_path):
    from tide.engine_io import make_output
    from tide.sampling_params import SamplingParams
    from tide.scheduler.request import Req

    with tide.Engine(str(llama_path), chunked_prefill_size=8, max_prefill_tokens=8) as e:
        req = Req("cut", random_prompts(19, [30])[0], SamplingParams(max_new_tokens=2),
                  return_logprob=True, logprob_start_len=0)
        e.scheduler.add_request(req)
        e.scheduler.step()
        assert 0 < len(req.input_token_logprobs) < 30
        e.scheduler.abort("cut")
        assert req.finished
        meta = make_output(req, None, 0.0)["meta_info"]
    assert "input_token_logprobs" not in meta and meta["output_token_logprobs"] == []


def check_scoring_is_batch_invariant(path, **options) -> None:
    """With `enable_deterministic_inference` (and `options`), a prompt's input logprobs are the
    same bits alone, beside other prompts, and in 32-token chunks of the prefill."""
    target = random_prompts(23, [70])[0]
    others = random_prompts(24, [15, 130, 41])
    kwargs = dict(return_logprob=True, top_logprobs_num=2, sampling_params={"max_new_tokens": 0})
    with tide.Engine(str(path), enable_deterministic_inference=True, **options) as engine:
        alone = engine.generate(input_ids=target, logprob_start_len=0, **kwargs)
        batch = engine.generate(input_ids=others[:2] + [target] + others[2:],
                                logprob_start_len=[0, 3, 0, 7], **kwargs)[2]
    with tide.Engine(str(path), enable_deterministic_inference=True, chunked_prefill_size=32,
                     max_prefill_tokens=32, **options) as engine:
        chunked = engine.generate(input_ids=target, logprob_start_len=0, **kwargs)
    want = alone["meta_info"]
    for got in (batch["meta_info"], chunked["meta_info"]):
        assert got["input_token_logprobs"] == want["input_token_logprobs"]
        assert got["input_top_logprobs"] == want["input_top_logprobs"]


def test_deterministic_input_logprobs_do_not_depend_on_the_batch(llama_path):
    """tests/test_input_logprobs_gpu.py checks the same in bf16 on CUDA."""
    check_scoring_is_batch_invariant(llama_path)
