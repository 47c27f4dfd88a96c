"""Input logprobs on a CUDA GPU (marker `gpu`): the Triton extend kernel, pieces of the output head,
CUDA-graph decode and the overlap schedule beside a scored prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_checkpoint, random_prompts

import tide

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("lp") / "llama", "llama")


def _hf_logp(path, ids: list[int], temperature: float) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1).cpu()


def test_input_logprobs_on_cuda_match_hf_and_replay_outputs(llama_dir, monkeypatch):
    from tide.executor import model_runner

    monkeypatch.setattr(model_runner, "SCORE_PIECE_LOGITS", 5 * VOCAB)  # pieces of 5 rows
    prompts = random_prompts(21, [7, 40, 90, 13])
    params = {"max_new_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    with tide.Engine(str(llama_dir), device="cuda", dtype="float32",
                     chunked_prefill_size=32, max_prefill_tokens=32) as engine:
        assert engine.scheduler.overlap  # decode steps overlap around the scored prefills
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               logprob_start_len=[0, 10, 0, 12], top_logprobs_num=2)
        replay = engine.generate(
            input_ids=[p + o["output_ids"] for p, o in zip(prompts, outs)], return_logprob=True,
            logprob_start_len=[len(p) for p in prompts],
            sampling_params={"max_new_tokens": 0, "temperature": 0.8})
    for ids, start, out in zip(prompts, [0, 10, 0, 12], outs):
        logp = _hf_logp(llama_dir, ids, 0.8)
        entries = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t in entries] == ids[start:]
        for k, (value, token) in enumerate(entries):
            p = start + k
            if p == 0:
                assert value is None
            else:
                assert value == pytest.approx(logp[p - 1, token].item(), abs=1e-3)
        assert len(out["meta_info"]["input_top_logprobs"]) == len(entries)
    for out, again in zip(outs, replay):
        want = out["meta_info"]["output_token_logprobs"]
        got = again["meta_info"]["input_token_logprobs"]
        assert [t for _, t in got] == [t for _, t in want]
        assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_input_logprobs_under_tensor_parallel_on_cuda(llama_dir):
    """Two ranks over NCCL: the output head's pieces gather the vocabulary on both ranks in step;
    the entries equal one GPU's."""
    prompts = random_prompts(22, [50, 9])
    kwargs = dict(input_ids=prompts, return_logprob=True, top_logprobs_num=3,
                  logprob_start_len=[0, 4], sampling_params={"max_new_tokens": 3, "temperature": 0})
    options = dict(device="cuda", dtype="float32", chunked_prefill_size=16, max_prefill_tokens=16)
    with tide.Engine(str(llama_dir), **options) as one:
        want = one.generate(**kwargs)
    with tide.Engine(str(llama_dir), tp_size=2, **options) as two:
        got = two.generate(**kwargs)
    for g, w in zip(got, want, strict=True):
        ge, we = g["meta_info"]["input_token_logprobs"], w["meta_info"]["input_token_logprobs"]
        assert [t for _, t in ge] == [t for _, t in we]
        assert [v is None for v, _ in ge] == [v is None for v, _ in we]
        assert [v for v, _ in ge if v is not None] == pytest.approx(
            [v for v, _ in we if v is not None], abs=1e-4)
        assert g["output_ids"] == w["output_ids"]


def test_deterministic_input_logprobs_do_not_depend_on_the_batch(llama_dir):
    """With `enable_deterministic_inference` (bf16), a prompt's input logprobs are the same bits
    alone, beside other prompts, and in other chunkings of the prefill."""
    from test_input_logprobs import check_scoring_is_batch_invariant

    check_scoring_is_batch_invariant(llama_dir, device="cuda", dtype="bfloat16")
