"""Steady overlapped decode steps of hybrid sliding-window models make no synchronizing CUDA call
(marker `gpu`, run on a GPU host): the two-pool KV cache gives back out-of-window SWA slots every
step (window 8: one slot per step), a follow-up turn gives back its cached prefix's SWA slots, and
requests finish mid-chain, all while the GPU runs a step ahead. The CPU counterpart, which counts
the calls that would sync, is test_swa_nosync.py."""

from __future__ import annotations

import pytest
import tide
import torch
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

from conftest import random_prompts
from test_swa_models import WINDOW, build_swa_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hybrid_checkpoint(request, tmp_path_factory):
    return build_swa_checkpoint(tmp_path_factory.mktemp(f"nosync_{request.param}"), request.param)


def _run(engine, warm: list[int], prompts: list[list[int]], max_new: list[int],
         overlap: bool) -> tuple[list[list[int]], int]:
    """From an empty cache, generate `warm` (its sequence stays cached), then step the requests to
    the end, with `torch.cuda.set_sync_debug_mode("error")` on every steady overlapped step (a step
    is on the device, nobody waits, someone goes on past the tokens in flight). Returns the tokens
    and the number of steps checked."""
    sched = engine.scheduler
    assert engine.flush_cache()
    engine.generate(input_ids=warm, sampling_params={"temperature": 0, "max_new_tokens": 2,
                                                     "ignore_eos": True})
    sched.overlap = overlap
    reqs = [Req(rid=f"r{i}", origin_input_ids=list(p), sampling_params=SamplingParams(
        temperature=0, max_new_tokens=n, ignore_eos=True)) for i, (p, n) in
        enumerate(zip(prompts, max_new))]
    for req in reqs:
        sched.add_request(req)
    checked = 0
    for _ in range(5000):
        if not sched.has_work():
            break
        steady = (overlap and sched.launched is not None and not sched.waiting
                  and any(len(r.output_ids) + 1 < r.sampling_params.max_new_tokens
                          for r in sched.running))
        ahead = sched.stats.num_overlapped_decode
        if steady:
            torch.cuda.set_sync_debug_mode("error")
        try:
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if steady:
            assert sched.stats.num_overlapped_decode == ahead + 1
        checked += steady
        sched.check_invariants()
        sched.allocator.check_consistency()  # reads the device: outside the checked steps
    else:
        pytest.fail("no progress")
    assert all(r.finished_reason["type"] == "length" for r in reqs)
    return [r.output_ids for r in reqs], checked


def test_steady_overlapped_hybrid_decode_steps_do_not_sync(hybrid_checkpoint):
    """Generations of 3 to 20 windows with CUDA graphs; the same tokens as one step at a time."""
    from tide.layers.attention.base import get_attention_backend_class

    cls = get_attention_backend_class("triton")
    if not (cls.supports_sliding_window and cls.supports_logit_cap):
        pytest.skip("the triton backend does not take sliding windows and soft-caps yet")
    engine = tide.Engine(str(hybrid_checkpoint), dtype="bfloat16", attention_backend="triton",
                         max_total_tokens=8192, swa_full_tokens_ratio=0.25,
                         max_running_requests=32, cuda_graph_max_bs=16)
    try:
        sched = engine.scheduler
        assert sched.swa_window == WINDOW and sched.overlap
        assert engine.model_runner.cuda_graph_runner is not None
        shared = random_prompts(7, [20])[0]
        turn = engine.generate(input_ids=shared, sampling_params={
            "temperature": 0, "max_new_tokens": 2, "ignore_eos": True})["output_ids"]
        prompts = [shared + turn + [5, 6], *random_prompts(8, [3, 9, 14, 30, 11, 40, 25])]
        max_new = [20 * WINDOW, 3 * WINDOW + 5, 6 * WINDOW, 4 * WINDOW + 1, 12 * WINDOW - 3,
                   3 * WINDOW, 9 * WINDOW, 15 * WINDOW + 2]
        base, _ = _run(engine, shared, prompts, max_new, overlap=False)
        over, checked = _run(engine, shared, prompts, max_new, overlap=True)
        assert over == base
        assert checked > 15 * WINDOW
    finally:
        engine.shutdown()
