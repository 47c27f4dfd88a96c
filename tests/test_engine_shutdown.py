"""Engine shutdown gives the model's, the pools' and the graphs' memory back, even while references
to the engine or its parts are still held (CPU; the same code frees device memory on CUDA)."""

from __future__ import annotations

import gc
import weakref

import pytest
import tide
import torch

from conftest import random_prompts
from test_swa_models import build_swa_checkpoint

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _kv_tensors(runner) -> list[torch.Tensor]:
    pool, tables = runner.token_to_kv_pool, runner.req_to_token_pool
    swa = [tables.req_to_token_swa] if tables.req_to_token_swa is not None else []
    return [*pool.k_buffer, *pool.v_buffer, tables.req_to_token, *swa]


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory):
    return build_swa_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_shutdown_frees_weights_and_pools_held_by_live_references(arch, checkpoints, gemma2_path):
    path = gemma2_path if arch == "gemma2" else checkpoints["llama"]
    engine = tide.Engine(str(path), max_total_tokens=4096, max_running_requests=8)
    runner = engine.model_runner  # kept, as a test or a fixture would
    model = runner.model
    params = list(model.parameters())
    buffers = list(model.buffers())
    assert (type(runner.token_to_kv_pool).__name__ == "SWAKVPool") is (arch == "gemma2")
    first = engine.generate(input_ids=random_prompts(0, [9, 20]), sampling_params=GREEDY)
    assert all(len(o["output_ids"]) == 6 for o in first)
    assert _storage_bytes(params) > 0 and _storage_bytes(_kv_tensors(runner)) > 0

    engine.shutdown()
    assert runner.closed
    assert _storage_bytes(params) == 0
    assert _storage_bytes(buffers) == 0  # rotary caches, Gemma's normalizer
    assert _storage_bytes(_kv_tensors(runner)) == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=[3, 4, 5], sampling_params=GREEDY)
    # Every other operation says so too (an update used to fail on the freed storage instead).
    name, param = next(iter(model.named_parameters()))
    for call in (lambda: engine.update_weights_from_tensor(named_tensors=[(name, param)]),
                 lambda: engine.get_weights_by_name(name), lambda: engine.pause_generation(),
                 lambda: engine.release_memory_occupation()):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    engine.shutdown()  # a second call does nothing
    # The scheduler's accounting still holds: every slot is free or cached, none locked.
    engine.scheduler.check_invariants()
    assert engine.scheduler.tree_cache.protected_size() == 0


def test_context_manager_target_holds_no_memory_after_the_block(checkpoints):
    with tide.Engine(str(checkpoints["llama"]), max_total_tokens=2048) as engine:
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert _storage_bytes(engine.model_runner.model.parameters()) == 0
    assert _storage_bytes(_kv_tensors(engine.model_runner)) == 0


def test_dropped_engine_is_collected(checkpoints):
    """Nothing global (a cache, a registry, the ledger) keeps an engine's model alive once the
    engine is shut down and dropped."""
    engine = tide.Engine(str(checkpoints["llama"]), max_total_tokens=2048)
    engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    model = weakref.ref(engine.model_runner.model)
    param = weakref.ref(next(engine.model_runner.model.parameters()))
    pool = weakref.ref(engine.model_runner.token_to_kv_pool)
    engine.shutdown()
    del engine
    gc.collect()
    assert model() is None and param() is None and pool() is None
