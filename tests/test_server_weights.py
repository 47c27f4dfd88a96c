"""`tide serve` handover routes end to end: weight updates (tensor, flattened bucket, disk, IPC, a gloo
trainer group), pause/continue, weight versions, admin auth, metrics — through one real server process.

The server's outputs are compared with an in-process `tide.Engine` that gets the same weights: new
weights are the demo model's own tensors (read with safetensors), perturbed. Every test leaves the
server unpaused; weight-changing tests push the same tensors to the reference engine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_utils import (
    ServerProcess,
    SlowHost,
    assert_error,
    assert_pickle_is_live,
    free_port,
    pickle_exploit_payload,
    retry_slow_host,
    running_server,
    serve_model_path,
)

from tide.weights import flatten_by_dtype, init_custom_process_group, serialize_named_tensors
from tide.weights.wire import MAGIC

ADMIN = "admin-key-789"
PROMPTS = ["The for statement", "A class definition", "Exceptions are"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
PROBE = "model.layers.0.self_attn.q_proj.weight"  # read back with get_weights_by_name


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weight-roots")


@pytest.fixture(scope="module")
def server(model_path, roots, tmp_path_factory):
    with running_server(model_path, "--admin-api-key", ADMIN, "--allowed-weight-roots", str(roots),
                        "--weight-version", "v0", api_key=ADMIN,
                        log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def ref(model_path):
    """The reference: an in-process Engine that receives every weight change the server gets."""
    import tide

    engine = tide.Engine(str(model_path))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(model_path) -> dict[str, torch.Tensor]:
    """The checkpoint's own tensors, in the engine's dtype (fp32 on CPU)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


def perturb(base: dict[str, torch.Tensor], names: list[str], seed: int,
            scale: float = 0.5) -> list[tuple[str, torch.Tensor]]:
    """`names` with noise of `scale` times each tensor's std added (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        t = base[name]
        noise = torch.randn(t.shape, generator=gen) * (t.std() * scale + 1e-3)
        out.append((name, (t + noise).contiguous()))
    return out


def some_names(base: dict[str, torch.Tensor]) -> list[str]:
    keep = ("embed_tokens", "layers.0.", "model.norm")
    return sorted(n for n in base if any(k in n for k in keep))


def server_greedy(server: ServerProcess) -> tuple[list[list[int]], list[str]]:
    out = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
    return [o["output_ids"] for o in out], [o["meta_info"]["weight_version"] for o in out]


def ref_greedy(ref) -> list[list[int]]:
    return [o["output_ids"] for o in ref.generate(prompt=PROMPTS, sampling_params=GREEDY)]


def probe(server: ServerProcess, name: str = PROBE, n: int = 8) -> list[float]:
    resp = server.post("/get_weights_by_name", {"name": name, "truncate_size": n})
    assert resp.status_code == 200, resp.text
    return resp.json()


def info(server: ServerProcess) -> dict:
    return server.get("/get_server_info").json()


def push_tensors(server: ServerProcess, named, **body) -> httpx.Response:
    load_format = body.get("load_format")
    obj = flatten_by_dtype(named) if load_format == "flattened_bucket" else named
    return server.post("/update_weights_from_tensor",
                       {"serialized_named_tensors": serialize_named_tensors(obj), **body})


def assert_refused(resp: httpx.Response, status: int = 400, *needles: str) -> dict:
    """A handover failure: `status`, sglang's fields (success false) and an OpenAI-style error."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert body["success"] is False and body["num_paused_requests"] >= 0
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in body["message"], (needle, body["message"])
    return body


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and isinstance(body["message"], str)
    assert isinstance(body["num_paused_requests"], int)
    return body


class Stream:
    """A `/generate` stream read in the background; `events` grows as they arrive."""

    def __init__(self, http: httpx.AsyncClient, text: str, params: dict) -> None:
        self.events: list[dict] = []
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._run(http, {"text": text, "sampling_params": params,
                                                         "stream": True}))

    async def _run(self, http: httpx.AsyncClient, body: dict) -> dict:
        async with http.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        return self.events[-1]

    @property
    def tokens(self) -> int:
        return len(self.events[-1]["output_ids"]) if self.events else 0

    async def result(self, timeout: float = 60.0) -> dict:
        return await asyncio.wait_for(self.task, timeout)

    async def ran_to_length(self) -> bool:
        """Whether the stream ends with all its tokens: asked when a call meant to land while it
        ran found no request, to tell a stalled host (`SlowHost`) from a failure."""
        return (await self.result())["meta_info"]["finish_reason"]["type"] == "length"


def run_async(server: ServerProcess, coro_fn) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            await coro_fn(http)

    asyncio.run(main())


@pytest.fixture(autouse=True)
def _leaves_server_serving(request):
    yield
    if "server" in request.fixturenames:  # not paused, nothing pending, no KV held
        state = info(request.getfixturevalue("server"))
        assert state["paused"] is None and state["num_pending_weight_updates"] == 0, state
        assert not state["admission_blocked"] and state["invariants_ok"], state


# ---------------------------------------------------------------- tensor updates over HTTP
def test_serialized_tensor_update_matches_engine(server, ref, base):
    before, versions = server_greedy(server)
    assert before == ref_greedy(ref) and versions == ["v0"] * len(PROMPTS)
    named = perturb(base, some_names(base), seed=1)
    body = ok(push_tensors(server, named, weight_version="v1"))
    assert body["num_paused_requests"] == 0
    assert ref.update_weights_from_tensor(named_tensors=named, weight_version="v1")["success"]
    after, versions = server_greedy(server)
    assert after == ref_greedy(ref)
    assert after != before  # the new weights really changed the greedy output
    assert versions == ["v1"] * len(PROMPTS)
    new_probe = dict(named)[PROBE].reshape(-1)[:8].tolist()
    assert probe(server) == new_probe
    assert server.get("/get_model_info").json()["weight_version"] == "v1"
    # OpenAI routes carry sglang's metadata.weight_version
    comp = server.post("/v1/completions", {"model": "tide-demo", "prompt": PROMPTS[0],
                                           "max_tokens": 2}).json()
    assert comp["metadata"] == {"weight_version": "v1"}
    chat = server.post("/v1/chat/completions", {"model": "tide-demo", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["metadata"] == {"weight_version": "v1"}


def test_flattened_bucket_and_list_payload(server, ref, base):
    named = perturb(base, some_names(base), seed=2)
    # sglang sends one payload per rank as a list
    body = {"serialized_named_tensors": [serialize_named_tensors(flatten_by_dtype(named))],
            "load_format": "flattened_bucket", "weight_version": "v2"}
    ok(server.post("/update_weights_from_tensor", body))
    ref.update_weights_from_tensor(named_tensors=flatten_by_dtype(named),
                                   load_format="flattened_bucket", weight_version="v2")
    out, versions = server_greedy(server)
    assert out == ref_greedy(ref) and versions == ["v2"] * len(PROMPTS)


def test_ipc_route_with_cpu_buckets(server, ref, base):
    # On CPU the "IPC" buckets carry their bytes by value; the route and flow are the same.
    named = perturb(base, ["model.norm.weight", PROBE], seed=3)
    ok(server.post("/update_weights_from_ipc", {
        "serialized_buckets": serialize_named_tensors(flatten_by_dtype(named)),
        "weight_version": "v3"}))
    ref.update_weights_from_tensor(named_tensors=named, weight_version="v3")
    out, versions = server_greedy(server)
    assert out == ref_greedy(ref) and versions == ["v3"] * len(PROMPTS)


@pytest.mark.parametrize("case", ["unknown_name", "wrong_shape", "wrong_dtype"])
def test_bad_tensor_update_changes_nothing(server, base, case):
    good = perturb(base, [PROBE, "model.norm.weight"], seed=4)
    t = base["model.layers.1.mlp.up_proj.weight"]
    if case == "unknown_name":
        bad_name, bad = "model.layers.99.mlp.up_proj.weight", t
    elif case == "wrong_shape":
        bad_name, bad = "model.layers.1.mlp.up_proj.weight", t[:-1].contiguous()
    else:
        bad_name, bad = "model.layers.1.mlp.up_proj.weight", t.to(torch.bfloat16)
    before_probe, before_version = probe(server), info(server)["weight_version"]
    before_out, _ = server_greedy(server)
    for fmt in (None, "flattened_bucket"):
        named = good + [(bad_name, bad)]
        body = assert_refused(push_tensors(server, named, load_format=fmt, weight_version="bad"),
                              400, bad_name)
        assert body["error"]["param"] == "serialized_named_tensors"
    assert probe(server) == before_probe
    assert info(server)["weight_version"] == before_version
    assert server_greedy(server) == (before_out, [before_version] * len(PROMPTS))


def test_malformed_payloads_are_refused(server):
    before_probe, version = probe(server), info(server)["weight_version"]
    not_a_tensor = base64.b64encode(MAGIC + msgspec.msgpack.encode(
        {"type": "named_tensors", "tensors": [{"name": "x", "tensor": 3}]})).decode()
    for payload, needle in (("not base64 !!", "base64"), ("aGVsbG8=", "tensor format"),
                            (not_a_tensor, "$.tensors[0].tensor")):
        assert_refused(server.post("/update_weights_from_tensor",
                                   {"serialized_named_tensors": payload}), 400, needle)
    assert_refused(server.post("/update_weights_from_tensor", {
        "serialized_named_tensors": serialize_named_tensors([("a", torch.zeros(1))]),
        "load_format": "flattened_bucket"}), 400, "FlattenedBucket")
    two = serialize_named_tensors([(PROBE, torch.zeros(1))])
    body = assert_refused(server.post("/update_weights_from_tensor",
                                      {"serialized_named_tensors": [two, two]}), 400)
    assert body["error"]["param"] == "serialized_named_tensors"
    for bad in ({}, {"serialized_named_tensors": 5}, {"serialized_named_tensors": "x", "oops": 1},
                {"serialized_named_tensors": "x", "load_format": "direct"}):
        assert_refused(server.post("/update_weights_from_tensor", bad), 400)
    assert_refused(server.post("/update_weights_from_tensor", None,
                               content=b"{not json", headers={"Authorization": f"Bearer {ADMIN}",
                                                             "Content-Type": "application/json"}))
    assert_refused(server.post("/update_weights_from_ipc", {"serialized_buckets": "@@"}), 400)
    assert probe(server) == before_probe and info(server)["weight_version"] == version


def test_crafted_pickle_never_runs_with_the_admin_key(server, tmp_path):
    """The attack from issue 18 with the admin key (no key and the user key: test_server_security)."""
    marker = tmp_path / "ran-admin-key"
    payload = pickle_exploit_payload(marker)
    assert_pickle_is_live(payload, marker)
    before_probe, version = probe(server), info(server)["weight_version"]
    for path, field in (("/update_weights_from_tensor", "serialized_named_tensors"),
                        ("/update_weights_from_ipc", "serialized_buckets")):
        for value in (payload, [payload]):
            body = assert_refused(server.post(path, {field: value}), 400, "pickle")
            assert body["error"]["param"] == field
        resp = server.post(path, None, content=json.dumps({field: payload}),
                           headers={**server.headers, "Content-Type": "text/plain"})
        assert_refused(resp, 415, "application/json")
    time.sleep(0.5)
    assert not marker.exists(), "the pickle payload ran"
    assert probe(server) == before_probe and info(server)["weight_version"] == version


# ---------------------------------------------------------------- disk updates and roots
def _save_checkpoint(base: dict[str, torch.Tensor], named, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {**base, **dict(named)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def test_disk_update_matches_engine(server, ref, base, roots):
    named = perturb(base, some_names(base), seed=5)
    ckpt = _save_checkpoint(base, named, roots / "step-5")
    body = ok(server.post("/update_weights_from_disk",
                          {"model_path": str(ckpt), "weight_version": "disk-5"}))
    assert "updated" in body["message"]
    assert ref.update_weights_from_disk(str(ckpt), weight_version="disk-5")["success"]
    out, versions = server_greedy(server)
    assert out == ref_greedy(ref) and versions == ["disk-5"] * len(PROMPTS)


def test_disk_paths_outside_roots_are_refused(server, base, roots, tmp_path):
    outside = _save_checkpoint(base, perturb(base, [PROBE], seed=6), tmp_path / "outside")
    (roots / "link").symlink_to(outside, target_is_directory=True)
    inside_dir = roots / "shard-link"
    inside_dir.mkdir()
    (inside_dir / "model.safetensors").symlink_to(outside / "model.safetensors")
    before_probe, version = probe(server), info(server)["weight_version"]
    for path in (str(outside), str(roots / "link"), f"{roots}/../{tmp_path.name}/outside",
                 str(inside_dir), "/etc"):
        body = assert_refused(server.post("/update_weights_from_disk",
                                          {"model_path": path, "weight_version": "evil"}),
                              400, "model_path", repr(path))
        assert body["error"]["param"] == "model_path"
    assert_refused(server.post("/update_weights_from_disk", {"model_path": str(roots / "nope")}),
                   400, "model_path")
    incomplete = roots / "incomplete"
    incomplete.mkdir()
    save_file({PROBE: base[PROBE]}, str(incomplete / "model.safetensors"))
    assert_refused(server.post("/update_weights_from_disk", {"model_path": str(incomplete)}),
                   400, "missing")
    assert probe(server) == before_probe and info(server)["weight_version"] == version


# ---------------------------------------------------------------- admin auth
ADMIN_ROUTES = [
    ("/update_weights_from_disk", {"model_path": "/tmp"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "eA=="}),
    ("/update_weights_from_ipc", {"serialized_buckets": "eA=="}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
    ("/destroy_weights_update_group", {"group_name": "g"}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}),
    ("/get_weights_by_name", {"name": PROBE}),
    ("/update_weight_version", {"new_version": "hacked"}),
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
]


@pytest.mark.parametrize("path,body", ADMIN_ROUTES, ids=[p for p, _ in ADMIN_ROUTES])
def test_admin_routes_need_the_admin_key(server, path, body):
    version = info(server)["weight_version"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN}):
        assert_error(server.post(path, body, headers=headers), 401)
    assert_error(server.get("/get_weights_by_name", params={"name": PROBE}, headers={}), 401)
    state = info(server)
    assert state["weight_version"] == version and state["paused"] is None
    out = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                      headers={})  # generation needs no key here (no --api-key)
    assert out.status_code == 200


def test_get_weights_by_name(server):
    values = probe(server, n=5)
    assert len(values) == 5 and all(isinstance(v, float) for v in values)
    got = server.get("/get_weights_by_name", params={"name": PROBE, "truncate_size": 5}).json()
    assert got == values
    body = assert_refused(server.post("/get_weights_by_name", {"name": "model.nope.weight"}), 400,
                          "model.nope.weight")
    assert body["error"]["param"] == "name"
    assert_refused(server.post("/get_weights_by_name", {"name": PROBE, "truncate_size": -1}))


# ---------------------------------------------------------------- pause / continue
def test_pause_in_place_update_continue(server, ref, base):
    named = perturb(base, some_names(base), seed=7)

    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        paused = ok(await http.post("/pause_generation", json={"mode": "in_place"}))
        if paused["num_paused_requests"] == 0 and await stream.ran_to_length():
            ok(await http.post("/continue_generation", json={}))
            raise SlowHost("the stream finished before the pause")
        assert paused["num_paused_requests"] == 1
        late = asyncio.create_task(http.post("/generate", json={
            "text": PROMPTS[1], "sampling_params": GREEDY}))
        await asyncio.sleep(0.3)
        held = stream.tokens
        await asyncio.sleep(0.8)
        assert stream.tokens == held < LONG["max_new_tokens"]  # nothing scheduled while paused
        assert not late.done() and not stream.task.done()
        state = (await http.get("/get_server_info")).json()
        assert state["paused"] == "in_place" and state["kv_held_slots"] > 0
        assert state["num_queued_reqs"] == 1 and state["num_running_reqs"] == 1
        busy = await http.post("/flush_cache")
        assert busy.status_code == 400 and "1 queued and 1 running" in busy.text
        metrics = _metrics(await http.get("/metrics"))
        assert metrics[("tide:generation_paused", (("mode", "in_place"),))] == 1
        # an update while paused in place applies at once; held requests keep their KV
        upd = ok(await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": serialize_named_tensors(named),
            "weight_version": "v-inplace"}))
        assert upd["num_paused_requests"] == 2  # one holding KV, one queued
        assert (await http.get("/get_server_info")).json()["kv_held_slots"] > 0
        ok(await http.post("/continue_generation", json={"torch_empty_cache": True}))
        last = await stream.result()
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
        assert last["meta_info"]["weight_version"] == "v-inplace"
        resp = await asyncio.wait_for(late, 60)
        assert resp.json()["meta_info"]["weight_version"] == "v-inplace"

    retry_slow_host(lambda: run_async(server, scenario))
    ref.update_weights_from_tensor(named_tensors=named, weight_version="v-inplace")
    state = info(server)
    assert state["kv_held_slots"] == 0 and state["invariants_ok"]
    # The held request's prompt KV (old weights) went into the radix cache when it finished; drop
    # it before comparing (see test_in_place_update_leaves_no_stale_prefix).
    assert server.post("/flush_cache").status_code == 200
    out, versions = server_greedy(server)
    assert out == ref_greedy(ref) and versions == ["v-inplace"] * len(PROMPTS)


def test_in_place_update_leaves_no_stale_prefix(server, ref, base):
    named = perturb(base, some_names(base), seed=17)

    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], {**LONG, "max_new_tokens": 40})
        await asyncio.wait_for(stream.started.wait(), 30)
        ok(await http.post("/pause_generation", json={"mode": "in_place"}))
        ok(await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": serialize_named_tensors(named),
            "weight_version": "v-stale"}))
        ok(await http.post("/continue_generation", json={}))
        await stream.result()

    try:
        run_async(server, scenario)
        ref.update_weights_from_tensor(named_tensors=named, weight_version="v-stale")
        assert server_greedy(server)[0] == ref_greedy(ref)
    finally:
        assert server.post("/flush_cache").status_code == 200  # leave no stale KV behind


def test_pause_abort_ends_streams_with_abort(server):
    async def scenario(http: httpx.AsyncClient) -> None:
        streams = [Stream(http, p, LONG) for p in PROMPTS[:2]]
        for s in streams:
            await asyncio.wait_for(s.started.wait(), 30)
        paused = ok(await http.post("/pause_generation", json={"mode": "abort"}))
        if paused["num_paused_requests"] < 2:
            early = [await s.ran_to_length() for s in streams]
            ok(await http.post("/continue_generation", json={}))
            if any(early):
                raise SlowHost("a stream finished before the pause")
        assert paused["num_paused_requests"] == 2
        for s in streams:
            last = await s.result(30)
            assert last["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < last["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
        state = (await http.get("/get_server_info")).json()
        assert state["kv_held_slots"] == 0 and state["paused"] == "abort"
        ok(await http.post("/continue_generation", json={}))
        out = (await http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY})).json()
        assert out["meta_info"]["finish_reason"]["type"] == "length"

    retry_slow_host(lambda: run_async(server, scenario))


def test_pause_retract_frees_kv_then_completes(server):
    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[2], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        paused = ok(await http.post("/pause_generation", json={"mode": "retract"}))
        if paused["num_paused_requests"] == 0 and await stream.ran_to_length():
            ok(await http.post("/continue_generation", json={}))
            raise SlowHost("the stream finished before the pause")
        state = (await http.get("/get_server_info")).json()
        assert state["kv_held_slots"] == 0 and state["num_queued_reqs"] == 1
        ok(await http.post("/continue_generation", json={"torch_empty_cache": False}))
        last = await stream.result()
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]

    retry_slow_host(lambda: run_async(server, scenario))


def test_bad_pause_mode(server):
    assert_refused(server.post("/pause_generation", {"mode": "sideways"}), 400)
    assert info(server)["paused"] is None


# ---------------------------------------------------------------- updates with work in flight
def test_update_waits_for_running_requests(server, ref, base):
    named = perturb(base, ["model.norm.weight"], seed=8)

    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        update = asyncio.create_task(http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": serialize_named_tensors(named),
            "weight_version": "v-drained"}))
        for _ in range(500):  # the HTTP side stays responsive while the update waits
            state = (await http.get("/get_server_info")).json()
            if state["num_pending_weight_updates"] or stream.task.done():
                break
            await asyncio.sleep(0.02)
        if not state["num_pending_weight_updates"] and await stream.ran_to_length():
            ok(await asyncio.wait_for(update, 60))  # applied again by the next attempt
            raise SlowHost("the stream finished before the update arrived")
        assert state["admission_blocked"] and state["num_pending_weight_updates"] == 1
        assert not stream.task.done()
        late = asyncio.create_task(http.post("/generate", json={
            "text": PROMPTS[1], "sampling_params": GREEDY}))
        last = await stream.result()
        body = ok(await asyncio.wait_for(update, 60))
        assert body["num_paused_requests"] == 0
        assert last["meta_info"]["finish_reason"]["type"] == "length"  # not aborted
        assert last["meta_info"]["weight_version"] != "v-drained"  # finished on the old weights
        late_out = (await asyncio.wait_for(late, 60)).json()
        assert late_out["meta_info"]["weight_version"] == "v-drained"  # queued behind the update

    retry_slow_host(lambda: run_async(server, scenario))
    ref.update_weights_from_tensor(named_tensors=named, weight_version="v-drained")
    assert server_greedy(server)[0] == ref_greedy(ref)


def test_update_with_abort_all_requests(server, ref, base):
    named = perturb(base, ["model.norm.weight"], seed=9)

    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        body = ok(await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": serialize_named_tensors(named),
            "abort_all_requests": True, "weight_version": "v-aborted"}))
        assert body["success"]
        if await stream.ran_to_length():  # the same update is applied again by the next attempt
            raise SlowHost("the stream finished before the update arrived")
        last = await stream.result(30)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"

    retry_slow_host(lambda: run_async(server, scenario))
    ref.update_weights_from_tensor(named_tensors=named, weight_version="v-aborted")
    assert server_greedy(server) == (ref_greedy(ref), ["v-aborted"] * len(PROMPTS))


def test_flush_cache_busy_reports_counts(server):
    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        busy = await http.post("/flush_cache")
        if busy.status_code == 200 and await stream.ran_to_length():
            raise SlowHost("the stream finished before the flush")
        assert busy.status_code == 400
        assert "queued" in busy.text and "1 running" in busy.text
        await stream.result()
        assert (await http.post("/flush_cache", json={"timeout": 5})).status_code == 200

    retry_slow_host(lambda: run_async(server, scenario))


# ---------------------------------------------------------------- weight version
def test_update_weight_version(server):
    async def scenario(http: httpx.AsyncClient) -> None:
        stream = Stream(http, PROMPTS[0], LONG)
        await asyncio.wait_for(stream.started.wait(), 30)
        paused = ok(await http.post("/pause_generation", json={"mode": "in_place"}))  # hold it
        if paused["num_paused_requests"] == 0 and await stream.ran_to_length():
            ok(await http.post("/continue_generation", json={}))
            raise SlowHost("the stream finished before the pause")
        keep = ok(await http.post("/update_weight_version",
                                  json={"new_version": "tag-a", "abort_all_requests": False}))
        assert keep["new_version"] == "tag-a"
        state = (await http.get("/get_server_info")).json()
        assert state["num_running_reqs"] == 1 and state["weight_version"] == "tag-a"
        ok(await http.post("/update_weight_version", json={"new_version": "tag-b"}))
        last = await stream.result(30)  # default abort_all_requests=True aborts it
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["weight_version"] == "tag-a"  # finished before the change
        ok(await http.post("/continue_generation", json={}))

    retry_slow_host(lambda: run_async(server, scenario))
    assert server_greedy(server)[1] == ["tag-b"] * len(PROMPTS)
    assert_refused(server.post("/update_weight_version", {"new_version": ""}), 400)
    assert info(server)["weight_version"] == "tag-b"


# ---------------------------------------------------------------- distributed (gloo trainer)
def _http_in_thread(server: ServerProcess, path: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []

    def call() -> None:
        result.append(server.post(path, body, timeout=120))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, result


def test_distributed_update_with_a_gloo_trainer(server, ref, base):
    port = free_port()
    group = "rl-sync"
    thread, result = _http_in_thread(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group, "backend": "gloo"})
    time.sleep(0.3)
    # While the engine waits for the trainer to join, it keeps serving.
    out = server.post("/generate", {"text": "Hi", "sampling_params": GREEDY})
    assert out.status_code == 200 and thread.is_alive()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, group, timeout_s=60)
    thread.join(60)
    assert ok(result[0])
    assert group in info(server)["weight_update_groups"]
    assert_refused(server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group, "backend": "gloo"}), 400, "already exists")
    try:
        for step, fmt in ((1, None), (2, "flattened_bucket")):
            named = perturb(base, some_names(base), seed=10 + step)
            version = f"dist-{step}"
            thread, result = _http_in_thread(server, "/update_weights_from_distributed", {
                "names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                "shapes": [list(t.shape) for _, t in named], "group_name": group,
                "load_format": fmt, "weight_version": version})
            if fmt is None:
                trainer.broadcast_weights(named)
            else:
                trainer.broadcast_flattened(torch.cat([t.reshape(-1) for _, t in named]))
            thread.join(60)
            ok(result[0])
            ref.update_weights_from_tensor(named_tensors=named, weight_version=version)
            assert server_greedy(server) == (ref_greedy(ref), [version] * len(PROMPTS))

        # A bad request still receives every broadcast (the trainer never hangs) and changes nothing.
        before = probe(server)
        bad = perturb(base, [PROBE], seed=20) + [("model.layers.77.mlp.up_proj.weight",
                                                  base["model.layers.1.mlp.up_proj.weight"])]
        thread, result = _http_in_thread(server, "/update_weights_from_distributed", {
            "names": [n for n, _ in bad], "dtypes": ["float32"] * 2,
            "shapes": [list(t.shape) for _, t in bad], "group_name": group})
        trainer.broadcast_weights(bad)
        thread.join(60)
        assert_refused(result[0], 400, "model.layers.77.mlp.up_proj.weight")
        assert probe(server) == before and info(server)["weight_version"] == "dist-2"
        # bodies that cannot be received are refused before anything is sent
        for body, param in (
            ({"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]}, "dtypes"),
            ({"names": ["a"], "dtypes": ["int7"], "shapes": [[1]]}, "dtypes.0"),
        ):
            err = assert_refused(server.post("/update_weights_from_distributed",
                                             {**body, "group_name": group}), 400)
            assert err["error"]["param"] == param
    finally:
        ok(server.post("/destroy_weights_update_group", {"group_name": group}))
        trainer.close()
    assert group not in info(server)["weight_update_groups"]
    assert_refused(server.post("/destroy_weights_update_group", {"group_name": group}), 400, group)
    assert_refused(server.post("/update_weights_from_distributed", {
        "names": [PROBE], "dtypes": ["float32"], "shapes": [list(base[PROBE].shape)],
        "group_name": group}), 400, group)


def test_bad_group_requests(server):
    for body, param in (
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2},
         "rank_offset"),
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
          "backend": "mpi"}, "backend"),
        ({"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2},
         "master_port"),
    ):
        err = assert_refused(server.post("/init_weights_update_group", body), 400)
        assert err["error"]["param"] == param
    assert info(server)["weight_update_groups"] == []


# ---------------------------------------------------------------- metrics
def _metrics(resp: httpx.Response) -> dict:
    values = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


def test_metrics_report_handover_state(server, base):
    before = _metrics(server.get("/metrics"))
    for reason in ("flush_cache", "weight_update", "continue_generation"):
        for name in ("tide:memory_releases_total", "tide:memory_release_stall_seconds_total",
                     "tide:memory_release_freed_bytes_total"):
            assert (name, (("reason", reason),)) in before, (name, reason)
    assert before[("tide:generation_paused", (("mode", "none"),))] == 0
    ok(push_tensors(server, perturb(base, ["model.norm.weight"], seed=30),
                    weight_version="metrics-v"))
    assert_refused(push_tensors(server, [("model.nope", torch.zeros(1))]))
    after = _metrics(server.get("/metrics"))
    assert after[("tide:weight_version_info", (("weight_version", "metrics-v"),))] == 1
    key_ok = ("tide:weight_updates_total", (("source", "tensor"), ("success", "true")))
    key_bad = ("tide:weight_updates_total", (("source", "tensor"), ("success", "false")))
    assert after[key_ok] - before.get(key_ok, 0) == 1
    assert after[key_bad] - before.get(key_bad, 0) == 1
    ledger = info(server)["memory_ledger"]
    assert isinstance(ledger, dict)
    if not torch.cuda.is_available():
        assert after[("tide:memory_releases_total", (("reason", "weight_update"),))] == 0


def test_metrics_render_ledger_totals():
    from tide.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.set_load({"num_running_reqs": 0, "num_queued_reqs": 0, "kv_used_slots": 0,
                "kv_held_slots": 0, "max_total_tokens": 8, "num_cached_tokens": 0,
                "num_prefill_tokens": 0, "num_retractions": 0, "weight_version": "w9",
                "paused": "retract", "num_pending_weight_updates": 0,
                "memory_ledger": {"continue_generation": {"count": 3, "stall_s": 0.25,
                                                          "freed_bytes": 4096}}})
    got = _metrics(httpx.Response(200, content=m.render()))
    cg = (("reason", "continue_generation"),)
    assert got[("tide:memory_releases_total", cg)] == 3
    assert got[("tide:memory_release_stall_seconds_total", cg)] == 0.25
    assert got[("tide:memory_release_freed_bytes_total", cg)] == 4096
    assert got[("tide:memory_releases_total", (("reason", "flush_cache"),))] == 0
    assert got[("tide:weight_version_info", (("weight_version", "w9"),))] == 1
    assert got[("tide:generation_paused", (("mode", "retract"),))] == 1


# ---------------------------------------------------------------- the scheduler loop, in process
def test_update_drains_a_half_prefilled_prompt(model_path, tmp_path, base):
    """A prompt mid-chunked-prefill holds KV: the waiting update must let it finish (without
    admitting anything else) instead of waiting forever."""
    import zmq

    import tide
    from tide.scheduler.process import SchedulerProcess
    from tide.io_struct import (
        BatchTokenIDOut,
        ControlReqOutput,
        SchedulerHeartbeat,
        TokenizedGenerateReqInput,
        UpdateWeightsFromTensorReqInput,
        decode_output,
    )

    engine = tide.Engine(str(model_path), chunked_prefill_size=8)
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    out_addr = f"ipc://{tmp_path}/out"
    sink.bind(out_addr)
    proc = SchedulerProcess(engine.scheduler, f"ipc://{tmp_path}/in", out_addr, os.getpid())
    try:
        params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        proc._dispatch(TokenizedGenerateReqInput(rid="long", input_ids=list(range(10, 50)),
                                                 sampling_params=params))
        proc.run_once()
        assert engine.scheduler.chunked_req is not None  # 8 of 40 prompt tokens done
        proc._dispatch(TokenizedGenerateReqInput(rid="later", input_ids=[5, 6, 7],
                                                 sampling_params=params))
        named = perturb(base, ["model.norm.weight"], seed=40)
        proc._dispatch(UpdateWeightsFromTensorReqInput(
            req_id="upd", serialized_named_tensors=serialize_named_tensors(named),
            weight_version="chunked"))
        for _ in range(40):
            if not engine.handover.pending_updates:
                break
            proc.run_once()
        assert not engine.handover.pending_updates, "the update never got its turn"
        for _ in range(40):
            if not engine.scheduler.has_work():
                break
            proc.run_once()
        order = []
        while sink.poll(200):
            msg = decode_output(sink.recv())
            if isinstance(msg, SchedulerHeartbeat):  # from the heartbeat thread, any time
                continue
            if isinstance(msg, ControlReqOutput):
                assert msg.success, msg.message
                order.append(("reply", msg.req_id))
            else:
                assert isinstance(msg, BatchTokenIDOut)
                order += [("finish", rid, v) for rid, r, v in
                          zip(msg.rids, msg.finished_reasons, msg.weight_versions, strict=True) if r]
        assert order == [("finish", "long", "default"), ("reply", "upd"),
                         ("finish", "later", "chunked")]
    finally:
        proc.close()
        sink.close(linger=0)
        ctx.term()
        engine.shutdown()


# ---------------------------------------------------------------- options and path checks (no server)
def test_weight_roots_option(tmp_path, model_path):
    from tide.config import EngineConfig
    from tide.server.admin_api import is_under
    from tide.server.server_args import ServerArgs

    args = ServerArgs(engine=EngineConfig(model_path=str(model_path)))
    assert args.weight_roots == [os.path.dirname(os.path.realpath(model_path))]
    link = tmp_path / "link"
    link.symlink_to(tmp_path, target_is_directory=True)
    args = ServerArgs(allowed_weight_roots=(str(link), str(tmp_path)))
    assert args.weight_roots == [str(tmp_path.resolve())]  # resolved, deduplicated
    assert args.public_dict()["allowed_weight_roots"] == [str(tmp_path.resolve())]
    with pytest.raises(ValueError, match="allowed_weight_roots"):
        ServerArgs(allowed_weight_roots=(str(tmp_path / "missing"),))
    with pytest.raises(ValueError, match="weight_version"):
        ServerArgs(weight_version="")
    assert is_under("/a/b", ["/a"]) and is_under("/a", ["/a"]) and is_under("/x", ["/"])
    assert not is_under("/ab", ["/a"]) and not is_under("/", ["/a"])
