"""`tide serve --dp-size 3` end to end on CPU: three scheduler replicas behind one server.

Requests spread over the replicas and match an in-process `tide.Engine`; pause, tensor updates, a
gloo trainer group (world size 1 + 3 replicas) and continue act on every replica; a replica frozen
mid-stream (SIGSTOP) is killed after `--scheduler-abort-timeout` and one killed mid-stream (SIGKILL)
fails only its own request, each with a message naming it, while the others keep serving and
`/get_server_info` and `/metrics` report them dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from tide.config import EngineConfig
from tide.weights import init_custom_process_group, serialize_named_tensors

from server_utils import ServerProcess, free_port, running_server, serve_model_path

PROMPTS = ["The for statement", "A class definition", "Exceptions are", "Hello there"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running_server(model_path, "--dp-size", "3", "--device", "cpu", "--weight-version", "v0",
                        "--scheduler-health-timeout", "4", "--scheduler-abort-timeout", "6",
                        log_dir=tmp_path_factory.mktemp("dp-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def ref(model_path):
    import tide

    engine = tide.Engine(str(model_path))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(model_path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


def perturbed(base, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, base[n] + torch.randn(base[n].shape, generator=gen) * base[n].std() * 0.5)
            for n in NAMES]


def info(server: ServerProcess) -> dict:
    resp = server.get("/get_server_info")
    assert resp.status_code == 200, resp.text
    return resp.json()


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True, body
    return body


def server_greedy(server: ServerProcess) -> tuple[list[list[int]], list[str]]:
    out = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
    return [o["output_ids"] for o in out], [o["meta_info"]["weight_version"] for o in out]


def ref_greedy(ref) -> list[list[int]]:
    return [o["output_ids"] for o in ref.generate(prompt=PROMPTS, sampling_params=GREEDY)]


def replica_versions(server: ServerProcess) -> list[str]:
    return [r["weight_version"] for r in info(server)["replicas"]]


def test_requests_spread_over_replicas_and_match_one_engine(server, ref):
    before = [r["requests_served"] for r in info(server)["replicas"]]
    ids, versions = server_greedy(server)
    assert ids == ref_greedy(ref) and versions == ["v0"] * len(PROMPTS)
    state = info(server)
    assert state["dp_size"] == 3 and state["num_replicas_alive"] == 3
    served = [r["requests_served"] - b for r, b in zip(state["replicas"], before)]
    assert sorted(served) == [1, 1, 2], served  # four prompts at once: spread over all three
    assert all(r["alive"] and r["pid"] for r in state["replicas"])
    assert len({r["pid"] for r in state["replicas"]}) == 3
    # counters add up over the replicas
    assert state["max_total_tokens"] == sum(r["max_total_tokens"] for r in state["replicas"])
    # Input logprobs come back through the controller from whichever replica scored each prompt.
    scored = server.post("/generate", {"text": PROMPTS, "return_logprob": True,
                                       "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 0}}).json()
    want = ref.generate(prompt=PROMPTS, return_logprob=True, logprob_start_len=0,
                        sampling_params={"max_new_tokens": 0})
    for got, exp in zip(scored, want, strict=True):
        g, e = got["meta_info"]["input_token_logprobs"], exp["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in g] == [t for _, t in e] and g[0][0] is None
        assert [v for v, _, _ in g[1:]] == pytest.approx([v for v, _ in e[1:]], abs=1e-5)


def test_pause_tensor_update_continue_reach_both_replicas(server, ref, base):
    body = ok(server.post("/pause_generation", {"mode": "in_place"}))
    assert body["num_paused_requests"] == 0
    assert [r["paused"] for r in info(server)["replicas"]] == ["in_place"] * 3
    named = perturbed(base, seed=1)
    ok(server.post("/update_weights_from_tensor", {
        "serialized_named_tensors": serialize_named_tensors(named), "weight_version": "v1"}))
    assert replica_versions(server) == ["v1"] * 3
    ok(server.post("/continue_generation", {}))
    assert [r["paused"] for r in info(server)["replicas"]] == [None] * 3
    assert ref.update_weights_from_tensor(named_tensors=named, weight_version="v1")["success"]
    before = [r["requests_served"] for r in info(server)["replicas"]]
    ids, versions = server_greedy(server)
    assert ids == ref_greedy(ref) and versions == ["v1"] * len(PROMPTS)
    after = [r["requests_served"] for r in info(server)["replicas"]]
    assert sum(a > b for a, b in zip(after, before)) == 3  # every replica served new weights
    assert server.get("/get_model_info").json()["weight_version"] == "v1"
    # a refused update (unknown tensor) changes nothing on any replica
    bad = [("model.layers.9.mlp.up_proj.weight", base[NAMES[1]])]
    resp = server.post("/update_weights_from_tensor", {
        "serialized_named_tensors": serialize_named_tensors(bad), "weight_version": "bad"})
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert replica_versions(server) == ["v1"] * 3
    # memory release is fanned out too (these replicas have no memory saver: each refuses)
    resp = server.post("/release_memory_occupation", {})
    assert resp.status_code == 400 and "enable_memory_saver" in resp.json()["message"]


def test_one_trainer_group_broadcast_reaches_every_replica(server, ref, base):
    port, group = free_port(), "dp-sync"
    # world size 1 + 3 replicas: the trainer is rank 0, the replicas ranks 1, 2 and 3
    result: list[httpx.Response] = []
    join = threading.Thread(target=lambda: result.append(server.post(
        "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                       "rank_offset": 1, "world_size": 4, "group_name": group,
                                       "backend": "gloo"}, timeout=120)), daemon=True)
    join.start()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 4, group, timeout_s=60)
    join.join(60)
    ok(result[0])
    assert group in info(server)["weight_update_groups"]
    named = perturbed(base, seed=2)
    result.clear()
    recv = threading.Thread(target=lambda: result.append(server.post(
        "/update_weights_from_distributed", {
            "names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
            "shapes": [list(t.shape) for _, t in named], "group_name": group,
            "weight_version": "v2"}, timeout=120)), daemon=True)
    recv.start()
    trainer.broadcast_weights(named)
    recv.join(60)
    ok(result[0])
    assert replica_versions(server) == ["v2"] * 3
    assert ref.update_weights_from_tensor(named_tensors=named, weight_version="v2")["success"]
    ids, versions = server_greedy(server)
    assert ids == ref_greedy(ref) and versions == ["v2"] * len(PROMPTS)
    ok(server.post("/destroy_weights_update_group", {"group_name": group}))
    assert group not in info(server)["weight_update_groups"]
    # a group too small for every replica is refused before anyone joins
    resp = server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 3, "group_name": "too-small", "backend": "gloo"})
    assert resp.status_code == 400 and "at least 4" in resp.json()["message"]


LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}


async def _streams_on(http: httpx.AsyncClient, replicas: list[int]) -> tuple[list, dict]:
    """One long stream per live replica, once each is running on its replica; (tasks, info).
    The earlier tests' requests are counted out first: a count the router has not yet taken back
    would send two streams to one replica. A stream lasts about a second and a half on a CPU, so a
    stalled host can see them finish before any poll finds them running: they are then started
    again (a stream that failed raises here)."""
    outstanding: list[int] = []
    for _ in range(5):
        for _ in range(200):
            state = (await http.get("/get_server_info")).json()
            if all(r["outstanding_requests"] == 0 for r in state["replicas"] if r["alive"]):
                break
            await asyncio.sleep(0.05)
        tasks = [asyncio.create_task(_stream(http, PROMPTS[i], LONG)) for i in range(len(replicas))]
        for _ in range(200):
            await asyncio.sleep(0.05)
            state = (await http.get("/get_server_info")).json()
            if any(t.done() for t in tasks):
                break
            outstanding = [r["outstanding_requests"] for r in state["replicas"]]
            if all(outstanding[i] == 1 for i in replicas):
                return tasks, state
        await asyncio.gather(*tasks)
    raise AssertionError(f"the streams are not one per replica {replicas}: {outstanding}")


def _by_finish(outputs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in outputs:
        out.setdefault(o["meta_info"]["finish_reason"]["type"], []).append(o)
    return out


def test_a_frozen_replica_is_killed_and_fails_only_its_request(server):
    async def scenario() -> tuple[list[dict], int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            tasks, state = await _streams_on(http, [0, 1, 2])
            victim = state["replicas"][2]["pid"]
            os.kill(victim, signal.SIGSTOP)  # frozen: no heartbeat, no tokens
            return list(await asyncio.gather(*tasks)), victim

    outputs, victim = asyncio.run(scenario())
    finished = _by_finish(outputs)
    assert len(finished["length"]) == 2 and len(finished["abort"]) == 1, outputs
    message = finished["abort"][0]["meta_info"]["finish_reason"]["message"]
    assert f"replica 2 (scheduler pid {victim}) stopped responding" in message, message
    state = info(server)
    assert [r["alive"] for r in state["replicas"]] == [True, True, False]
    assert "was killed" in state["replicas"][2]["dead_reason"]
    assert server.get("/health").status_code == 200


def test_a_killed_replica_fails_only_its_requests(server):
    async def scenario() -> tuple[list[dict], int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            tasks, state = await _streams_on(http, [0, 1])
            victim = state["replicas"][1]["pid"]
            os.kill(victim, signal.SIGKILL)
            return list(await asyncio.gather(*tasks)), victim

    outputs, victim = asyncio.run(scenario())
    finished = _by_finish(outputs)
    assert len(finished["length"]) == 1 and len(finished["abort"]) == 1, outputs
    message = finished["abort"][0]["meta_info"]["finish_reason"]["message"]
    assert f"replica 1 (scheduler pid {victim}) exited" in message, message
    assert len(finished["length"][0]["output_ids"]) == 480
    # reported, and the last replica keeps serving
    assert server.get("/health").status_code == 200
    state = info(server)
    assert state["num_replicas_alive"] == 1
    assert [r["alive"] for r in state["replicas"]] == [True, False, False]
    assert "exited" in state["replicas"][1]["dead_reason"]
    metrics = {(s.name, s.labels.get("replica")): s.value
               for fam in text_string_to_metric_families(server.get("/metrics").text)
               for s in fam.samples if s.name.startswith("tide:dp_")}
    assert metrics[("tide:dp_replicas_alive", None)] == 1.0
    assert [metrics[("tide:dp_replica_up", str(i))] for i in range(3)] == [1.0, 0.0, 0.0]
    out = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length"] * len(PROMPTS)
    # handover calls go on with the survivor (the dead replicas are listed, not called)
    body = ok(server.post("/pause_generation", {"mode": "abort"}))
    assert [r["index"] for r in body["dead_replicas"]] == [1, 2]
    ok(server.post("/continue_generation", {}))
    assert server.post("/flush_cache").status_code == 200
    # a new trainer group spans the trainer and the survivor: world size 1 + 1 live replica
    port, group = free_port(), "after-deaths"
    result: list[httpx.Response] = []
    join = threading.Thread(target=lambda: result.append(server.post(
        "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                       "rank_offset": 1, "world_size": 2, "group_name": group,
                                       "backend": "gloo"}, timeout=120)), daemon=True)
    join.start()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, group, timeout_s=60)
    join.join(60)
    ok(result[0])
    probe = "model.norm.weight"
    new = torch.tensor(server.post("/get_weights_by_name", {"name": probe,
                                                             "truncate_size": 10**6}).json()) * 2
    result.clear()
    recv = threading.Thread(target=lambda: result.append(server.post(
        "/update_weights_from_distributed", {"names": [probe], "dtypes": ["float32"],
                                             "shapes": [list(new.shape)], "group_name": group,
                                             "weight_version": "v3"}, timeout=120)), daemon=True)
    recv.start()
    trainer.broadcast_weights([(probe, new)])
    recv.join(60)
    ok(result[0])
    assert server.get("/get_model_info").json()["weight_version"] == "v3"
    time.sleep(0.1)
    assert server.proc.poll() is None


async def _stream(http: httpx.AsyncClient, text: str, params: dict) -> dict:
    last: dict = {}
    async with http.stream("POST", "/generate", json={"text": text, "sampling_params": params,
                                                      "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last


@pytest.mark.skipif("tp_size" not in EngineConfig.__dataclass_fields__,
                    reason="needs tensor parallel (EngineConfig.tp_size)")
def test_replicas_times_tp_ranks_form_one_trainer_group(model_path, base, tmp_path):
    """--dp-size 2 --tp-size 2 on CPU: the trainer group has world size 1 + 2 x 2; replica k joins
    at rank 1 + 2k (its TP ranks after it), and one broadcast reaches all four ranks."""
    with running_server(model_path, "--dp-size", "2", "--tp-size", "2", "--device", "cpu",
                        log_dir=tmp_path) as srv:
        before, _ = server_greedy(srv)
        port, group = free_port(), "dp-tp"
        result: list[httpx.Response] = []
        join = threading.Thread(target=lambda: result.append(srv.post(
            "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                           "rank_offset": 1, "world_size": 5, "group_name": group,
                                           "backend": "gloo"}, timeout=120)), daemon=True)
        join.start()
        trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 5, group, timeout_s=60)
        join.join(60)
        message = ok(result[0])["message"]
        assert "rank 1 of 5" in message and "rank 3 of 5" in message, message
        named = perturbed(base, seed=3)
        result.clear()
        recv = threading.Thread(target=lambda: result.append(srv.post(
            "/update_weights_from_distributed", {
                "names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                "shapes": [list(t.shape) for _, t in named], "group_name": group,
                "weight_version": "dp-tp"}, timeout=120)), daemon=True)
        recv.start()
        trainer.broadcast_weights(named)
        recv.join(60)
        ok(result[0])
        after, versions = server_greedy(srv)
        assert versions == ["dp-tp"] * len(PROMPTS) and after != before
        # both replicas hold the same new weights: one prompt twice at once runs on each, alike
        served = [r["requests_served"] for r in info(srv)["replicas"]]
        twice = srv.post("/generate", {"text": [PROMPTS[0]] * 2, "sampling_params": GREEDY}).json()
        assert twice[0]["output_ids"] == twice[1]["output_ids"] == after[0]
        assert [r["requests_served"] - s for r, s in zip(info(srv)["replicas"], served)] == [1, 1]
        # /metrics adds up over the replicas: the pool's capacity is the summed KV total (it was
        # one replica's), and there is one series per TP rank (rank r summed over the replicas).
        samples = [(s.name, s.labels, s.value)
                   for fam in text_string_to_metric_families(srv.get("/metrics").text)
                   for s in fam.samples]
        total = next(v for n, _, v in samples if n == "tide:kv_total_slots")
        capacity = next(v for n, lb, v in samples if n == "tide:kv_pool_slots"
                        and lb["pool"] == "full" and lb["state"] == "capacity")
        assert capacity == total == info(srv)["max_total_tokens"]
        ranks = info(srv)["ranks"]
        allocated = {lb["rank"]: v for n, lb, v in samples
                     if n == "tide:rank_memory_allocated_bytes"}
        assert set(allocated) == {"0", "1"} and [r["rank"] for r in ranks] == [0, 1]


def test_a_frozen_replica_neither_delays_other_aborts_nor_outlives_the_server(model_path, tmp_path):
    """Replica 1 stopped (SIGSTOP): aborting a request of replica 0 answers at once (it waited for
    every replica, the frozen one too, until the 30 s control timeout); SIGTERM then stops the
    server with no process left behind (the stopped replica took no signal and was orphaned)."""
    srv = ServerProcess(model_path, "--dp-size", "2", "--device", "cpu", log_dir=tmp_path)
    try:
        srv.wait_ready()
        frozen = info(srv)["replicas"][1]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        start = time.monotonic()
        body = ok(srv.post("/abort_request", {"rid": "nobody-has-this"}))
        assert body["num_aborted"] == 0 and time.monotonic() - start < 15  # was the 30 s timeout
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(40)
        assert srv.group_pids() == []
    finally:
        srv.stop()
