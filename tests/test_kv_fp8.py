"""An fp8 (e4m3) KV cache (`kv_cache_dtype="fp8_e4m3"`), on CPU with the torch-native backend.

The cache stores K/V rounded to float8_e4m3fn (saturating at +-448) and attention widens them back
to the model dtype. Checked: the option's validation; layer 0's cached keys and values are exactly
the fp8 rounding of a default engine's (layer 0 sees the same inputs in both); half the bytes per
token; outputs close to the default engine's for a plain and a two-pool hybrid model, through
decode, a cached prefix and chunked prefill."""

from __future__ import annotations

import pytest
import torch

import tide
from conftest import random_prompts
from tide.config import EngineConfig
from tide.memory.pools import FP8_E4M3_MAX, to_kv_dtype
from test_swa_models import build_swa_checkpoint

FP8 = torch.float8_e4m3fn
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def test_kv_cache_dtype_is_validated(llama_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_path=str(llama_path), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype.*enable_deterministic_inference"):
        EngineConfig(model_path=str(llama_path), kv_cache_dtype="fp8_e4m3",
                     enable_deterministic_inference=True)


def test_to_kv_dtype_saturates_and_rounds_like_float8():
    x = torch.tensor([1000.0, -1e6, 0.3, 447.0, float("nan")])
    got = to_kv_dtype(x, FP8).float()
    assert got[:2].tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX]
    assert got[2].item() == torch.tensor(0.3).to(FP8).float().item()
    assert got[3].item() == 448.0  # 447 rounds to the nearest e4m3 value
    assert got[4].isnan()
    same = torch.randn(4, dtype=torch.bfloat16)
    assert to_kv_dtype(same, torch.bfloat16) is same


@pytest.fixture(scope="module")
def engines(llama_path):
    base = tide.Engine(str(llama_path), max_total_tokens=2048, disable_radix_cache=True)
    fp8 = tide.Engine(str(llama_path), max_total_tokens=2048, disable_radix_cache=True,
                      kv_cache_dtype="fp8_e4m3")
    yield base, fp8
    base.shutdown()
    fp8.shutdown()


def _pool(engine):
    return engine.model_runner.token_to_kv_pool


def test_layer0_cache_holds_the_fp8_rounding_of_the_default_cache(engines):
    """Fresh engines hand out slots 1.. in order, so the prompt's K/V sit in the same slots."""
    base, fp8 = engines
    prompt = random_prompts(3, [20])[0]
    one = {"temperature": 0, "max_new_tokens": 1}
    base.generate(input_ids=prompt, sampling_params=one)
    fp8.generate(input_ids=prompt, sampling_params=one)
    slots = slice(1, 1 + len(prompt))
    for get in ("get_key_buffer", "get_value_buffer"):
        ref = getattr(_pool(base), get)(0)[slots]
        got = getattr(_pool(fp8), get)(0)[slots]
        assert got.dtype == FP8
        assert ref.abs().max() > 0
        assert torch.equal(got.view(torch.uint8), ref.to(FP8).view(torch.uint8)), get


def test_fp8_cache_takes_half_the_bytes_and_reports_its_dtype(engines):
    base, fp8 = engines
    nbytes = [sum(b.nbytes for b in _pool(e).k_buffer + _pool(e).v_buffer) for e in engines]
    assert nbytes[1] * base.model_runner.dtype.itemsize == nbytes[0]
    layout = fp8.get_server_info()["kv_cache_layout"]
    assert layout["kv_cache_dtype"] == "float8_e4m3fn"
    assert base.get_server_info()["kv_cache_layout"]["kv_cache_dtype"] == "float32"


def _logprob_gap(a: list[dict], b: list[dict]) -> tuple[float, int]:
    """Largest |logprob difference| over the tokens both runs chose while their sequences agree
    (a tiny random model's logits are nearly flat, so fp8 rounding may flip a later greedy pick),
    and how many tokens were compared."""
    gap, compared = 0.0, 0
    for x, y in zip(a, b):
        for (lx, tx, *_), (ly, ty, *_) in zip(x["meta_info"]["output_token_logprobs"],
                                              y["meta_info"]["output_token_logprobs"]):
            if tx != ty:
                break  # the sequences part here; later tokens are not comparable
            gap = max(gap, abs(lx - ly))
            compared += 1
    return gap, compared


def test_fp8_outputs_stay_close_to_the_default_cache(engines):
    base, fp8 = engines
    prompts = random_prompts(11, [5, 17, 40, 64])
    ref = base.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    got = fp8.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    gap, compared = _logprob_gap(ref, got)
    assert compared >= 16, compared
    assert 0 < gap < 0.1, gap  # the rounding shows, and stays small


def test_fp8_prefix_cache_and_chunks_give_the_one_shot_tokens(llama_path):
    """A cached prefix and chunked prefill read the same fp8 values a one-shot prefill wrote."""
    prompt = random_prompts(5, [50])[0]
    outs = []
    for opts in ({"disable_radix_cache": True}, {"chunked_prefill_size": 16}):
        with tide.Engine(str(llama_path), kv_cache_dtype="fp8_e4m3", max_total_tokens=2048,
                         **opts) as engine:
            first = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            # A prefix hit when the radix cache is on.
            again = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            outs += [first, again]
    assert outs[3]["meta_info"]["cached_tokens"] > 0 and outs[1]["meta_info"]["cached_tokens"] == 0
    tokens = [o["output_ids"] for o in outs]
    assert all(t == tokens[0] for t in tokens), tokens
    lps = [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    for other in lps[1:]:
        assert max(abs(x - y) for x, y in zip(lps[0], other)) < 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_hybrid_two_pool_model_with_fp8_cache(arch, tmp_path):
    path = build_swa_checkpoint(tmp_path / arch, arch)
    prompts = random_prompts(7, [5, 9, 12, 20, 33, 40], high=512)
    outs = []
    for dtype in ("auto", "fp8_e4m3"):
        with tide.Engine(str(path), kv_cache_dtype=dtype, max_total_tokens=2048,
                         swa_full_tokens_ratio=0.5) as engine:
            pool = engine.model_runner.token_to_kv_pool
            assert type(pool).__name__ == "SWAKVPool"
            assert all(b.dtype == (FP8 if dtype != "auto" else torch.float32)
                       for b in pool.k_buffer + pool.v_buffer)
            outs.append(engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True))
    gap, compared = _logprob_gap(*outs)
    assert compared >= 12 and 0 < gap < 0.1, (gap, compared)
