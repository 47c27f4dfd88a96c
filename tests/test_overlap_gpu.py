"""GPU checks of the throughput schedule (marker `gpu`): the overlap schedule gives the tokens of the
one-step-at-a-time schedule with CUDA graphs, its steady decode steps make no synchronizing CUDA call
(the sampled tokens arrive through an event on a pinned copy), and mixed batches run to the end."""

from __future__ import annotations

import pytest
import torch

import tide
from conftest import build_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 90, 130, 7, 64, 33)]
MAX_NEW = [48, 9, 30, 1, 40, 17, 25, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("overlap"), "llama", hidden_size=512,
                            intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=2048)


def _engine(path, **kw):
    return tide.Engine(str(path), dtype="bfloat16", max_total_tokens=65536, max_running_requests=64,
                       **kw)


def _params(**extra):
    return [{"max_new_tokens": n, "ignore_eos": True, **extra} for n in MAX_NEW]


def test_overlap_equals_one_step_at_a_time(checkpoint):
    outs = {}
    for disable in (True, False):
        engine = _engine(checkpoint, disable_overlap_schedule=disable)
        assert engine.scheduler.overlap is (not disable)
        greedy = engine.generate(input_ids=PROMPTS, sampling_params=_params(temperature=0))
        seeded = engine.generate(input_ids=PROMPTS, sampling_params=_params(temperature=1.0, seed=11),
                                 return_logprob=True, top_logprobs_num=2)
        outs[disable] = ([o["output_ids"] for o in greedy], [o["output_ids"] for o in seeded],
                         [o["meta_info"]["output_token_logprobs"] for o in seeded])
        overlapped = engine.scheduler.stats.num_overlapped_decode
        assert (overlapped > 0) is (not disable)
        assert [len(o) for o in outs[disable][0]] == MAX_NEW
        engine.shutdown()
        del engine
    assert outs[False] == outs[True]


def _run_steady_steps_without_sync(checkpoint, params) -> None:
    """Every prompt with `params(i)` for 40 tokens; each step taken once decode is launched ahead
    and nothing waits must make no synchronizing CUDA call."""
    from tide.scheduler.request import Req

    engine = _engine(checkpoint)
    sched = engine.scheduler
    reqs = [Req(rid=str(i), origin_input_ids=p, sampling_params=params(i))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        sched.add_request(r)
    checked = 0
    while sched.has_work():
        steady = sched.launched is not None and not sched.waiting
        if steady:
            torch.cuda.set_sync_debug_mode("error")
        try:
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked += steady
    assert checked > 20
    assert all(len(r.output_ids) == 40 for r in reqs)
    engine.shutdown()


def test_steady_overlapped_decode_steps_do_not_sync(checkpoint):
    from tide.sampling_params import SamplingParams

    _run_steady_steps_without_sync(checkpoint, lambda i: SamplingParams(
        temperature=0, max_new_tokens=40, ignore_eos=True))


def test_steady_overlapped_sampling_steps_do_not_sync(checkpoint):
    """As above with what RL rollouts sample with: temperature, top-p/top-k, seeds, a greedy row
    among them; none of the sampler's small parameter tensors may reach the device by a blocking
    copy (torch's list-to-CUDA copy waits for the stream)."""
    from tide.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        if i == 0:
            return SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
        return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i if i % 2 else None,
                              max_new_tokens=40, ignore_eos=True)

    _run_steady_steps_without_sync(checkpoint, params)


def test_mixed_chunk_runs_every_request_to_its_length(checkpoint):
    engine = _engine(checkpoint, enable_mixed_chunk=True, chunked_prefill_size=64)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=_params(temperature=0))
    assert [o["meta_info"]["completion_tokens"] for o in outs] == MAX_NEW
    assert engine.scheduler.stats.num_mixed_decode > 0
    engine.scheduler.check_invariants()
    assert engine.flush_cache()
    engine.shutdown()
