"""`tide.cluster.ray.RayEngine` on a local Ray cluster started in this process (CPU, two replicas).

Batches spread over both replicas and match one in-process `tide.Engine`; pause, tensor updates and
continue reach both; one gloo trainer group of world size 1 + 2 replicas broadcasts new weights to
both (outputs change exactly as the reference's, `weight_version` moves on both); a replica killed
mid-batch fails only its own items, with a message naming it, while the other finishes its own and
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from server_utils import free_port

ray = pytest.importorskip("ray")

from tide.cluster.ray import RayEngine  # noqa: E402
from tide.config import DEMO_MODEL_PATH  # noqa: E402
from tide.weights import init_custom_process_group  # noqa: E402

PROMPTS = ["The for statement", "A class definition", "Exceptions are", "Hello there"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(cluster):
    """The replicas docs/parallel.md starts: its Python block, run as written (it prints the
    outputs of a two-prompt batch)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "parallel.md").read_text()
    section = text[text.index("### On a Ray cluster"):]
    block = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert "RayEngine(num_replicas=2)" in block
    namespace: dict = {"__name__": "parallel_example"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "docs/parallel.md", "exec"), namespace)
    engine = namespace["engine"]
    assert isinstance(engine, RayEngine) and engine.router.num_replicas == 2
    assert printed.getvalue().count("'finish_reason': {'type': 'length'") == 2, printed.getvalue()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ref():
    import tide

    engine = tide.Engine(DEMO_MODEL_PATH)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(DEMO_MODEL_PATH).glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


def perturbed(base, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, base[n] + torch.randn(base[n].shape, generator=gen) * base[n].std() * 0.5)
            for n in NAMES]


def greedy(engine) -> tuple[list[list[int]], list[str]]:
    out = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
    return [o["output_ids"] for o in out], [o["meta_info"]["weight_version"] for o in out]


def served(replicas) -> list[int]:
    return [r["requests_served"] for r in replicas.router.describe()]


def test_batches_spread_over_replicas_and_match_one_engine(replicas, ref):
    before = served(replicas)
    assert greedy(replicas) == greedy(ref)
    assert [a - b for a, b in zip(served(replicas), before)] == [2, 2]
    info = replicas.get_server_info()
    assert info["num_replicas"] == 2 and len({r["pid"] for r in info["replicas"]}) == 2
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1]  # a sampling stream each
    with pytest.raises(ValueError, match="dp_rank"):
        RayEngine(num_replicas=1, dp_rank=1)
    # one item gives one dict; n copies come back in order, all from one replica
    one = replicas.generate(prompt="Hello", sampling_params={**GREEDY, "n": 2})
    assert isinstance(one, list) and len(one) == 2 and one[0]["output_ids"] == one[1]["output_ids"]
    single = replicas.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    assert isinstance(single, dict) and len(single["output_ids"]) == 8
    with pytest.raises(ValueError, match="max_new_tokens"):
        replicas.generate(prompt=PROMPTS[:2], sampling_params={"max_new_tokens": -1})
    # Input logprobs pass through, per item (scoring only: max_new_tokens = 0).
    scored = replicas.generate(prompt=PROMPTS, return_logprob=True,
                               logprob_start_len=[0, 1, 0, 2],
                               sampling_params={"max_new_tokens": 0})
    want = ref.generate(prompt=PROMPTS, return_logprob=True, logprob_start_len=[0, 1, 0, 2],
                        sampling_params={"max_new_tokens": 0})
    for got, exp in zip(scored, want, strict=True):
        assert got["output_ids"] == []
        g, e = got["meta_info"]["input_token_logprobs"], exp["meta_info"]["input_token_logprobs"]
        assert [t for _, t in g] == [t for _, t in e]
        assert [v is None for v, _ in g] == [v is None for v, _ in e]
        assert [v for v, _ in g if v is not None] == pytest.approx(
            [v for v, _ in e if v is not None], abs=1e-5)
    assert all(r["outstanding_requests"] == 0 for r in replicas.router.describe())
    # async_generate: concurrent calls, each one prompt, give generate's outputs.

    async def concurrent() -> list:
        return await asyncio.gather(*[replicas.async_generate(prompt=p, sampling_params=GREEDY)
                                      for p in PROMPTS])

    outs = asyncio.run(concurrent())
    # sglang's unused arguments, as for Engine.generate
    one = replicas.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, image_data=None,
                            stream=False)
    assert one["output_ids"] == single["output_ids"]
    with pytest.raises(ValueError, match="^lora_path is not supported"):
        replicas.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="adapter")
    want_ids = [o["output_ids"] for o in ref.generate(prompt=PROMPTS, sampling_params=GREEDY)]
    assert [o["output_ids"] for o in outs] == want_ids
    assert all(r["outstanding_requests"] == 0 for r in replicas.router.describe())


def test_pause_tensor_update_continue_reach_both(replicas, ref, base):
    reply = replicas.pause_generation("in_place")
    assert reply["success"], reply
    named = perturbed(base, seed=1)
    reply = replicas.update_weights_from_tensor(named_tensors=named, weight_version="v1")
    assert reply["success"], reply
    assert replicas.weight_versions() == ["v1", "v1"] and replicas.weight_version == "v1"
    info = replicas.get_server_info()  # as the replicas report it now, not from start-up
    assert info["weight_version"] == "v1"
    assert [r["weight_version"] for r in info["replicas"]] == ["v1", "v1"]
    assert replicas.continue_generation()["success"]
    assert ref.update_weights_from_tensor(named_tensors=named, weight_version="v1")["success"]
    ids, versions = greedy(replicas)
    assert ids == greedy(ref)[0] and versions == ["v1"] * len(PROMPTS)
    # a refused update changes nothing anywhere, and says so
    bad = [("model.layers.9.mlp.up_proj.weight", base[NAMES[1]])]
    reply = replicas.update_weights_from_tensor(named_tensors=bad, weight_version="bad")
    assert not reply["success"] and "model.layers.9.mlp.up_proj.weight" in reply["message"]
    assert replicas.weight_versions() == ["v1", "v1"]
    # flush and memory release reach every replica too (these replicas have no memory saver)
    assert replicas.flush_cache() is True
    reply = replicas.release_memory_occupation()
    assert not reply["success"] and "enable_memory_saver" in reply["message"], reply
    assert greedy(replicas)[1] == ["v1"] * len(PROMPTS)  # nothing was released: still serving


def test_trainer_group_broadcast_reaches_both_replicas(replicas, ref, base):
    port, group = free_port(), "ray-sync"
    with pytest.raises(ValueError, match="world_size 2"):
        replicas.init_weights_update_group("127.0.0.1", port, 1, 2, group, "gloo")
    result: list[dict] = []
    join = threading.Thread(target=lambda: result.append(replicas.init_weights_update_group(
        "127.0.0.1", port, 1, 3, group, "gloo", timeout=60)), daemon=True)
    join.start()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 3, group, timeout_s=60)
    join.join(60)
    assert result and result[0]["success"], result
    before, _ = greedy(replicas)
    named = perturbed(base, seed=2)
    assert replicas.pause_generation("in_place")["success"]
    result.clear()
    recv = threading.Thread(target=lambda: result.append(replicas.update_weights_from_distributed(
        [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named],
        group_name=group, weight_version="v2")), daemon=True)
    recv.start()
    trainer.broadcast_weights(named)
    recv.join(60)
    assert result and result[0]["success"], result
    assert replicas.continue_generation()["success"]
    assert replicas.weight_versions() == ["v2", "v2"]
    assert ref.update_weights_from_tensor(named_tensors=named, weight_version="v2")["success"]
    ids, versions = greedy(replicas)
    assert ids == greedy(ref)[0] and ids != before and versions == ["v2"] * len(PROMPTS)
    assert replicas.destroy_weights_update_group(group)["success"]


def test_a_killed_replica_fails_only_its_items(replicas):
    long = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}
    victim = replicas.actors[1]
    for _ in range(5):  # a stalled host can see the batch end before a poll finds it running
        result: list = []
        batch = threading.Thread(target=lambda out=result: out.append(
            replicas.generate(prompt=PROMPTS[:2], sampling_params=long)), daemon=True)
        batch.start()
        deadline = time.monotonic() + 60
        while batch.is_alive() and ray.get(victim.load.remote())["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        if batch.is_alive():  # its item is running
            break
        assert result, "the batch failed"
    else:
        raise AssertionError("the batch ended five times before replica 1 ran its item")
    ray.kill(victim)
    batch.join(120)
    killed, survived = sorted(result[0], key=lambda o: o["meta_info"]["finish_reason"]["type"])
    assert survived["meta_info"]["finish_reason"]["type"] == "length"
    assert len(survived["output_ids"]) == 480
    reason = killed["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "replica 1" in reason["message"], reason
    assert killed["output_ids"] == []
    health = replicas.health()
    assert [r["alive"] for r in health] == [True, False] and "replica 1" in health[1]["dead_reason"]
    # the survivor serves everything now, and the handover API goes on with it
    out = replicas.generate(prompt=PROMPTS, sampling_params=GREEDY)
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length"] * len(PROMPTS)
    reply = replicas.pause_generation("abort")
    assert reply["success"] and [r["index"] for r in reply["dead_replicas"]] == [1]
    assert replicas.continue_generation()["success"]
    assert replicas.weight_versions()[1] is None
    # a new trainer group spans the trainer and the survivor: world size 1 + 1 live replica
    port, group = free_port(), "after-death"
    result: list[dict] = []
    join = threading.Thread(target=lambda: result.append(replicas.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group, "gloo", timeout=60)), daemon=True)
    join.start()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, group, timeout_s=60)
    join.join(60)
    assert result and result[0]["success"], result
    probe = "model.norm.weight"
    new = torch.tensor(replicas.get_weights_by_name(probe, truncate_size=10**6)) * 2
    result.clear()
    recv = threading.Thread(target=lambda: result.append(replicas.update_weights_from_distributed(
        [probe], ["float32"], [list(new.shape)], group_name=group, weight_version="v3")),
        daemon=True)
    recv.start()
    trainer.broadcast_weights([(probe, new)])
    recv.join(60)
    assert result and result[0]["success"], result
    assert replicas.weight_version == "v3"
    assert torch.equal(torch.tensor(replicas.get_weights_by_name(probe, 10**6)), new)
