"""Greedy parity with HF `transformers` (the reference for the model math) on tiny random checkpoints.

llama: llama3 rope scaling; qwen2: q/k/v bias; qwen3: q/k RMSNorm and tied embeddings. tide runs all
prompts as one batch; HF runs each prompt alone (no padding), so batching, paged KV and the
extend/decode split are all checked against the unbatched reference.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy_scores, random_prompts

ARCHS = ["llama", "qwen2", "qwen3"]
# Mixed lengths 3..60, plus one that runs past llama3's original_max_position_embeddings (128).
LENGTHS = [3, 5, 9, 14, 22, 31, 40, 47, 55, 60, 110]
MAX_NEW = 32
TOP_N = 5
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROB_TOL = 1e-4


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    return hf_greedy_scores(model, prompt, MAX_NEW)


@pytest.fixture(scope="module", params=ARCHS)
def parity_case(request, engine_for, hf_model_for):
    arch = request.param
    prompts = random_prompts(100 + ARCHS.index(arch), LENGTHS)
    engine = engine_for(arch)
    outs = engine.generate(
        input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=TOP_N
    )
    hf = [_hf_greedy(hf_model_for(arch), p) for p in prompts]
    return arch, prompts, outs, hf


def test_checkpoints_exercise_the_intended_features(checkpoints):
    llama = json.loads((checkpoints["llama"] / "config.json").read_text())
    rope = llama.get("rope_parameters") or llama.get("rope_scaling")
    assert rope["rope_type"] == "llama3"
    qwen3 = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    assert qwen3["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(checkpoints["qwen2"] / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()
    with safe_open(str(checkpoints["qwen3"] / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_norm.weight" in f.keys()


def test_greedy_tokens_match_hf(parity_case):
    arch, prompts, outs, hf = parity_case
    assert len(outs) == len(prompts) >= 8
    for i, (out, (hf_tokens, _)) in enumerate(zip(outs, hf)):
        assert len(hf_tokens) == MAX_NEW
        assert out["output_ids"] == hf_tokens, (
            f"{arch}: prompt {i} (len {len(prompts[i])}) diverges from HF at step "
            f"{next(j for j, (a, b) in enumerate(zip(out['output_ids'], hf_tokens)) if a != b)}"
        )
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert meta["prompt_tokens"] == len(prompts[i])
        assert meta["completion_tokens"] == MAX_NEW


def test_logprobs_match_hf(parity_case):
    arch, prompts, outs, hf = parity_case
    for i, (out, (hf_tokens, hf_logp)) in enumerate(zip(outs, hf)):
        pairs = out["meta_info"]["output_token_logprobs"]
        assert len(pairs) == MAX_NEW
        assert [t for _, t in pairs] == out["output_ids"]
        ours = torch.tensor([lp for lp, _ in pairs], dtype=torch.float32)
        ref = hf_logp[torch.arange(MAX_NEW), torch.tensor(hf_tokens)]
        err = (ours - ref).abs().max().item()
        assert err <= LOGPROB_TOL, f"{arch}: prompt {i} logprob error {err:.2e}"


def test_top_logprobs(parity_case):
    arch, prompts, outs, hf = parity_case
    for i, (out, (_, hf_logp)) in enumerate(zip(outs, hf)):
        meta = out["meta_info"]
        tops = meta["output_top_logprobs"]
        assert len(tops) == MAX_NEW
        for step, (top, (lp, tok)) in enumerate(zip(tops, meta["output_token_logprobs"])):
            assert len(top) == TOP_N
            values = [v for v, _ in top]
            assert values == sorted(values, reverse=True), f"{arch} prompt {i} step {step}"
            assert top[0][1] == tok == out["output_ids"][step]
            assert abs(top[0][0] - lp) <= 1e-6
            ref_vals, ref_ids = hf_logp[step].topk(TOP_N)
            assert [t for _, t in top] == ref_ids.tolist()
            assert torch.allclose(torch.tensor(values), ref_vals, atol=LOGPROB_TOL, rtol=0)


def test_logprob_flag_off_omits_logprobs(llama_engine):
    out = llama_engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=4))
    assert "output_token_logprobs" not in out["meta_info"]
    assert "output_top_logprobs" not in out["meta_info"]
    assert len(out["output_ids"]) == 4
