"""Two-pool KV cache with CUDA-graph decode (marker `gpu`, run on a GPU host).

Hybrid sliding-window models replay captured decode graphs only once the Triton backend takes the
window and the soft-cap (`supports_sliding_window` / `supports_logit_cap`); until then these tests
skip with that reason.
"""

from __future__ import annotations

import gc

import pytest
import tide
import torch
from tide.memory import empty_device_cache

from conftest import random_prompts
from test_swa_models import build_swa_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def _require_triton_windows() -> None:
    from tide.layers.attention.base import get_attention_backend_class

    cls = get_attention_backend_class("triton")
    if not (cls.supports_sliding_window and cls.supports_logit_cap):
        pytest.skip("the triton backend does not take sliding windows and soft-caps yet")


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hybrid_checkpoint(request, tmp_path_factory):
    return request.param, build_swa_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _engine(path, graphs: bool, **kw):
    # The pools' size is fixed by max_total_tokens; mem_fraction_static only has to leave it room
    # when the GPU is not empty (another process, or this one's CUDA context and caches).
    return tide.Engine(str(path), dtype="bfloat16", attention_backend="triton",
                       disable_cuda_graph=not graphs, max_total_tokens=8192,
                       mem_fraction_static=0.97, swa_full_tokens_ratio=0.25,
                       max_running_requests=32, cuda_graph_max_bs=16, **kw)


def _free_bytes() -> int:
    gc.collect()
    empty_device_cache(reason="test_measure", ledger=None)
    return torch.cuda.mem_get_info()[0]


def _plant_nan_in_dummy_slots(engine) -> None:
    pool = engine.model_runner.token_to_kv_pool
    for layer in range(len(pool.k_buffer)):
        pool.get_key_buffer(layer)[0] = float("nan")
        pool.get_value_buffer(layer)[0] = float("nan")


def test_graph_decode_equals_eager_for_hybrid_models(hybrid_checkpoint):
    """Identical greedy tokens with and without CUDA graphs; a small batch replayed after a large
    one (with NaN in the dummy slot of both pools) too: padded rows write only the dummy slots,
    and nothing of the large batch's SWA slots is left in the small one's buffers."""
    _require_triton_windows()
    _, path = hybrid_checkpoint
    large = random_prompts(1, [5, 9, 17, 30, 44, 8, 12, 21, 3, 27, 15, 33])  # bucket 12
    small = random_prompts(2, [11, 26, 7])  # bucket 4: one padded row
    outs = {}
    for graphs in (False, True):
        engine = _engine(path, graphs)
        runner = engine.model_runner
        assert (runner.cuda_graph_runner is not None) == graphs
        if graphs:
            assert runner.cuda_graph_runner.buffers.out_cache_loc_swa.dtype == torch.int32
        first = [o["output_ids"] for o in engine.generate(input_ids=large, sampling_params=GREEDY)]
        _plant_nan_in_dummy_slots(engine)
        second = [o["output_ids"] for o in engine.generate(input_ids=small, sampling_params=GREEDY)]
        engine.scheduler.check_invariants()
        outs[graphs] = (first, second)
        engine.shutdown()
        del engine, runner
    assert outs[True] == outs[False]


def test_replay_translates_once_per_step_on_device(hybrid_checkpoint):
    """Each graph-replayed decode step translates the new tokens' full slots to SWA slots exactly
    once (one device gather before the replay); no layer translates during the replay."""
    _require_triton_windows()
    _, path = hybrid_checkpoint
    engine = _engine(path, graphs=True)
    runner = engine.model_runner
    pool = runner.token_to_kv_pool
    per_step: list[int] = []
    replays: list[int] = []
    real_decode = runner.forward_decode
    real_replay = runner.cuda_graph_runner.replay

    def decode(*args, **kwargs):
        before = pool.num_translations
        out = real_decode(*args, **kwargs)
        per_step.append(pool.num_translations - before)
        return out

    def replay(fb, real_bs):
        replays.append(real_bs)
        return real_replay(fb, real_bs)

    runner.forward_decode = decode
    runner.cuda_graph_runner.replay = replay
    engine.generate(input_ids=random_prompts(3, [20, 35, 9]), sampling_params=GREEDY)
    assert replays and len(replays) == len(per_step)
    assert set(per_step) == {1}
    engine.shutdown()


def test_two_pools_fit_more_long_requests_than_one(hybrid_checkpoint):
    """Same memory budget: the two-pool layout holds more full-context tokens than one pool. Each
    engine's budget is 1 GiB of what is free when it starts (not a fraction of the whole GPU,
    which other tests or processes may hold part of), and shutdown gives it all back."""
    arch, path = hybrid_checkpoint
    tokens = {}
    for ratio in (0.125, 1.0):
        free, total = _free_bytes(), torch.cuda.mem_get_info()[1]
        if free < 4 << 30:
            pytest.skip(f"needs 4 GiB free on the GPU, {free / 2**30:.1f} GiB are")
        with tide.Engine(str(path), dtype="bfloat16", swa_full_tokens_ratio=ratio,
                         mem_fraction_static=1.0 - (free - (1 << 30)) / total,
                         disable_cuda_graph=True) as engine:
            tokens[ratio] = engine.model_runner.max_total_tokens
            assert _free_bytes() < free - (1 << 30) * 0.9  # the pools took the budget
        del engine
        # Shutdown gave the pools back (what may stay: library workspaces, loaded kernels).
        assert _free_bytes() > free - (256 << 20)
    # gemma2: half the layers slide, gemma3: two of three -> at least 1.6x / 2.3x the tokens.
    assert tokens[0.125] >= (1.6 if arch == "gemma2" else 2.3) * tokens[1.0] * 0.95


def test_overlap_schedule_equals_one_step_at_a_time_for_hybrid_models(hybrid_checkpoint):
    """Five windows of new tokens with CUDA graphs: out-of-window SWA slots are given back while the
    next decode step runs on the device (a slot freed then is reused only by a later forward on the
    same stream). Same tokens and logprobs with the overlap schedule as without, and both pools
    whole afterwards."""
    _require_triton_windows()
    _, path = hybrid_checkpoint
    prompts = random_prompts(3, [5, 9, 17, 30, 44, 8, 12, 21])
    seeded = dict(GREEDY, temperature=1.0, seed=7)
    outs = {}
    for disable in (True, False):
        engine = _engine(path, True, disable_overlap_schedule=disable)
        sched = engine.scheduler
        greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=prompts, sampling_params=seeded, return_logprob=True)
        outs[disable] = ([o["output_ids"] for o in greedy], [o["output_ids"] for o in sampled],
                         [o["meta_info"]["output_token_logprobs"] for o in sampled])
        assert (sched.stats.num_overlapped_decode > 0) is (not disable)
        sched.check_invariants()
        assert engine.flush_cache()
        for name, pool in sched.kv_pools().items():
            assert pool["free"] == pool["capacity"], name
        engine.shutdown()
    assert outs[False] == outs[True]
