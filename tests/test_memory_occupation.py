"""release/resume_memory_occupation on CPU: the portable path (storages freed and re-allocated)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import tide
from conftest import hf_greedy_logprobs, named_weights, sgd_steps
from tide.scheduler.request import Req
from tide.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [300, 2, 9]]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
TAG_SETS = [["kv_cache"], ["weights"], ["cuda_graph"], ["kv_cache", "weights"], None]


def _engine(path, backup: bool) -> tide.Engine:
    return tide.Engine(str(path), enable_memory_saver=True, enable_cpu_backup=backup,
                       max_total_tokens=4096)


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _kv_bytes(engine) -> int:
    """The KV buffers and the request-to-token table (released together under `kv_cache`)."""
    pool = engine.model_runner.token_to_kv_pool
    table = engine.model_runner.req_to_token_pool.req_to_token
    return sum(t.untyped_storage().nbytes() for t in [table, *pool.k_buffer, *pool.v_buffer])


def _weight_bytes(engine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model_runner.model.parameters())


@pytest.fixture(scope="module")
def backed_up(checkpoints):
    engine = _engine(checkpoints["llama"], backup=True)
    return engine, _greedy(engine)


@pytest.mark.parametrize("tags", TAG_SETS, ids=lambda t: "all" if t is None else "+".join(t))
def test_release_resume_with_cpu_backup_gives_same_output(backed_up, tags):
    engine, reference = backed_up
    kv, weights = _kv_bytes(engine), _weight_bytes(engine)
    rotary = engine.model_runner.model.model.rotary_emb.cos_cache.clone()
    res = engine.release_memory_occupation(tags)
    assert res["success"], res
    released = tags or ["kv_cache", "weights", "cuda_graph"]
    assert _kv_bytes(engine) == (0 if "kv_cache" in released else kv)
    assert _weight_bytes(engine) == (0 if "weights" in released else weights)
    # buffers that are not weights (the rotary table) survive a weights release
    assert torch.equal(engine.model_runner.model.model.rotary_emb.cos_cache, rotary)
    assert engine.worker.memory_occupation.released_bytes()["kv_cache"] == (kv if "kv_cache" in released else 0)
    if "kv_cache" in released or "weights" in released:
        with pytest.raises(ValueError, match="resume_memory_occupation"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert engine.resume_memory_occupation(tags)["success"]
    assert _kv_bytes(engine) == kv and _weight_bytes(engine) == weights
    assert _greedy(engine) == reference
    engine.scheduler.check_invariants()


def test_release_kv_cache_flushes_the_radix_cache(backed_up):
    engine, _ = backed_up
    _greedy(engine)
    assert engine.scheduler.tree_cache.total_size() > 0
    assert engine.release_memory_occupation(["kv_cache"])["success"]
    assert engine.scheduler.tree_cache.total_size() == 0
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0


def test_kv_resume_clears_the_request_table(backed_up):
    """The request table comes back all zeros, its dummy row (every position -> KV slot 0) included."""
    engine, _ = backed_up
    reference = _greedy(engine)
    pool = engine.model_runner.req_to_token_pool
    pool.req_to_token.fill_(7)
    assert engine.release_memory_occupation(["kv_cache"])["success"]
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    assert not pool.req_to_token.any()
    assert _greedy(engine) == reference
    engine.scheduler.check_invariants()


def test_staged_resume_with_weight_update_and_no_backup_matches_hf(checkpoints):
    """release all -> resume weights -> push trained weights -> resume kv_cache -> HF's output."""
    path = checkpoints["qwen3"]
    engine = _engine(path, backup=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    sgd_steps(hf, steps=2, lr=0.5, seed=3)
    hf.eval()
    assert engine.release_memory_occupation()["success"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    with pytest.raises(ValueError, match=r"\['kv_cache'\] is released"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    named = named_weights(hf)
    half = len(named) // 2
    assert engine.update_weights_from_tensor(named_tensors=named[:half])["success"]
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    engine.resume_memory_occupation()  # cuda_graph (nothing on CPU)
    with pytest.raises(ValueError, match="without a CPU backup"):  # not every parameter refilled yet
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    res = engine.update_weights_from_tensor(named_tensors=named[half:], weight_version="trained")
    assert res["success"], res
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy_logprobs(hf, prompt, GREEDY["max_new_tokens"])
        assert out["output_ids"] == tokens
        ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) <= 1e-4
        assert out["meta_info"]["weight_version"] == "trained"


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model_runner.model.named_parameters()}


def _same_weights(engine, snapshot: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, snapshot[n]) for n, p in engine.model_runner.model.named_parameters())


def test_cpu_backup_buffer_is_allocated_once_and_refreshed(checkpoints):
    """One host buffer backs the weights up on every release: allocated by the first, the same
    memory on every later one. After a weight update between cycles, release -> resume brings back
    the updated weights, not the first backup."""
    path = checkpoints["qwen3"]
    engine = _engine(path, backup=True)
    backup = engine.worker.memory_occupation.backup
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    before = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    assert backup.host_bytes == 0 and backup.allocations == 0  # nothing before the first release
    assert engine.release_memory_occupation(["weights"])["success"]
    host_ptr = backup.buffer.tensor.data_ptr()
    assert backup.allocations == 1 and backup.host_bytes >= _weight_bytes_of(hf)
    assert engine.resume_memory_occupation(["weights"])["success"]
    sgd_steps(hf, steps=2, lr=0.5, seed=4)
    hf.eval()
    assert engine.update_weights_from_tensor(named_tensors=named_weights(hf))["success"]
    updated = _weights(engine)
    for _ in range(3):
        assert engine.release_memory_occupation(["weights"])["success"]
        assert _weight_bytes(engine) == 0
        assert engine.resume_memory_occupation(["weights"])["success"]
        assert _same_weights(engine, updated)
    assert backup.allocations == 1 and backup.buffer.tensor.data_ptr() == host_ptr
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    tokens, _ = hf_greedy_logprobs(hf, PROMPTS[0], GREEDY["max_new_tokens"])
    assert out["output_ids"] == tokens
    assert tokens != before  # the update changed the output, so a stale backup would show
    engine.shutdown()
    assert backup.host_bytes == 0  # shutdown gives the host memory back


def _weight_bytes_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_update_while_weights_are_released_is_refused_and_the_backup_comes_back(checkpoints):
    """An update pushed while the weights are released is refused (naming the cause) for every
    path, and resume brings back exactly the weights of the release: no stale or partial write."""
    path = checkpoints["qwen3"]
    engine = _engine(path, backup=True)
    reference = _greedy(engine)
    snapshot = _weights(engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sgd_steps(hf, steps=1, lr=0.5, seed=5)
    assert engine.release_memory_occupation(["weights"])["success"]
    res = engine.update_weights_from_tensor(named_tensors=named_weights(hf))
    assert not res["success"] and "weights are released" in res["message"]
    res = engine.update_weights_from_disk(str(path))
    assert not res["success"] and "weights are released" in res["message"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    assert _same_weights(engine, snapshot)
    assert _greedy(engine) == reference
    engine.shutdown()


def test_a_backup_is_restored_once_and_never_over_newer_weights(checkpoints):
    """The backup is consumed by its resume: resuming again (not released) or restoring by hand
    leaves weights written after the resume alone."""
    path = checkpoints["qwen3"]
    engine = _engine(path, backup=True)
    occupation = engine.worker.memory_occupation
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sgd_steps(hf, steps=1, lr=0.5, seed=6)
    assert engine.release_memory_occupation(["weights"])["success"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    assert not occupation.backup.valid
    assert engine.update_weights_from_tensor(named_tensors=named_weights(hf))["success"]
    updated = _weights(engine)
    assert engine.resume_memory_occupation(["weights"])["success"]  # not released: nothing to do
    assert occupation.backup.restore() is False
    assert _same_weights(engine, updated)
    engine.shutdown()


def test_drop_cpu_backup_frees_the_host_buffer_and_the_next_release_takes_a_new_one(checkpoints):
    path = checkpoints["qwen3"]
    engine = _engine(path, backup=True)
    backup = engine.worker.memory_occupation.backup
    reference = _greedy(engine)
    assert engine.drop_cpu_backup()["success"]  # nothing held yet: frees 0 bytes
    assert engine.release_memory_occupation(["weights"])["success"]
    held = backup.host_bytes
    res = engine.drop_cpu_backup()
    assert not res["success"] and "only copy" in res["message"]
    assert backup.host_bytes == held and backup.valid  # refused: the backup is intact
    assert engine.resume_memory_occupation(["weights"])["success"]
    res = engine.drop_cpu_backup()
    assert res["success"] and f"{held / 2**20:.1f} MiB" in res["message"]
    assert backup.host_bytes == 0 and backup.buffer is None
    assert engine.release_memory_occupation()["success"]
    assert backup.allocations == 2 and backup.host_bytes == held
    assert engine.resume_memory_occupation()["success"]
    assert _greedy(engine) == reference
    engine.shutdown()


def test_release_while_requests_run_is_refused_and_changes_nothing(backed_up):
    engine, reference = backed_up
    kv, weights = _kv_bytes(engine), _weight_bytes(engine)
    req = Req(rid="busy", origin_input_ids=PROMPTS[1], sampling_params=SamplingParams(**GREEDY))
    with engine._cond:
        engine.scheduler.add_request(req)
        engine.scheduler.step()  # now it holds KV
    res = engine.release_memory_occupation()
    assert not res["success"] and "busy" in res["message"]
    assert _kv_bytes(engine) == kv and _weight_bytes(engine) == weights
    assert engine.worker.memory_occupation.released_bytes() == {"kv_cache": 0, "weights": 0, "cuda_graph": 0}
    # paused in place, the request still holds KV: kv_cache may not go, weights may
    engine.pause_generation("in_place")
    res = engine.release_memory_occupation(["kv_cache"])
    assert not res["success"] and "hold KV" in res["message"]
    assert _kv_bytes(engine) == kv
    engine.continue_generation(torch_empty_cache=False)
    with engine._cond:
        while not req.finished:
            engine.scheduler.step()
    assert req.output_ids == reference[1]


def test_memory_saver_must_be_enabled_and_tags_known(checkpoints, backed_up):
    engine, _ = backed_up
    res = engine.release_memory_occupation(["kv_cache", "activations"])
    assert not res["success"] and "tags" in res["message"] and "activations" in res["message"]
    plain = tide.Engine(str(checkpoints["llama"]), max_total_tokens=1024)
    for call in (plain.release_memory_occupation, plain.resume_memory_occupation):
        res = call()
        assert not res["success"] and "enable_memory_saver" in res["message"]


def test_handover_cycle_is_on_the_memory_timeline(backed_up, tmp_path):
    import json

    from tide.cli import main

    engine, _ = backed_up
    engine.pause_generation("retract")
    named = [(n, p.detach().clone()) for n, p in engine.model_runner.model.named_parameters()
             if "norm" in n]
    assert engine.update_weights_from_tensor(named_tensors=named, weight_version="t1")["success"]
    assert engine.release_memory_occupation(["kv_cache"])["success"]
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    engine.continue_generation(torch_empty_cache=False)
    path = tmp_path / "ledger.json"
    engine.dump_memory_timeline(str(path))
    marks = [e["kind"] for e in json.loads(path.read_text())["events"] if e["type"] == "mark"]
    tail = marks[-5:]
    assert tail == ["pause", "weight_update", "release", "resume", "continue"], marks
    png = tmp_path / "timeline.png"
    assert main(["memory-plot", str(path), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_engine_keeps_its_own_memory_ledger(checkpoints, backed_up, tmp_path):
    """Two engines in one process: marks and timelines of one never show in the other's."""
    first, _ = backed_up
    second = _engine(checkpoints["llama"], backup=False)
    assert first.memory_ledger is not second.memory_ledger
    before = first.memory_ledger.mark_counts()
    assert second.pause_generation("retract")["success"]
    assert second.continue_generation(torch_empty_cache=False)["success"]
    assert first.memory_ledger.mark_counts() == before
    assert [m.kind for m in second.memory_ledger.marks] == ["engine_ready", "pause", "continue"]
    path = tmp_path / "second.json"
    second.dump_memory_timeline(str(path))
    kinds = [e["kind"] for e in json.loads(path.read_text())["events"] if e["type"] == "mark"]
    assert kinds == ["engine_ready", "pause", "continue"]
    second.shutdown()
