"""`tide serve` memory routes end to end: release/resume_memory_occupation (sglang paths and bodies),
the memory timeline dump, and the memory gauges of /metrics — through one real server process started
with --enable-memory-saver --enable-cpu-backup (and one without, for the opt-in error)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import (
    ServerProcess,
    SlowHost,
    assert_error,
    retry_slow_host,
    running_server,
    serve_model_path,
)

ADMIN = "admin-key-mem"
PROMPTS = ["The for statement", "A class definition", "Exceptions are"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
TAGS = ("kv_cache", "weights", "cuda_graph")
MEMORY_ROUTES = [("POST", "/release_memory_occupation", {"tags": None}),
                 ("POST", "/resume_memory_occupation", {"tags": None}),
                 ("GET", "/dump_memory_timeline", None)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running_server(model_path, "--admin-api-key", ADMIN, "--enable-memory-saver",
                        "--enable-cpu-backup", "--max-total-tokens", "4096", api_key=ADMIN,
                        log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    """Greedy outputs of the freshly started server, before any release."""
    return greedy(server)


@pytest.fixture(autouse=True)
def _leaves_memory_resumed(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        assert released(srv) == {tag: 0 for tag in TAGS}
        info = srv.get("/get_server_info").json()
        assert info["paused"] is None and info["invariants_ok"], info


def greedy(server: ServerProcess) -> list[list[int]]:
    resp = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    return [o["output_ids"] for o in resp.json()]


def metrics(server: ServerProcess) -> dict:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


def released(server: ServerProcess) -> dict[str, float]:
    m = metrics(server)
    return {tag: m[("tide:memory_released_bytes", (("tag", tag),))] for tag in TAGS}


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and isinstance(body["message"], str)
    assert set(body["released_bytes"]) == set(TAGS)
    return body


def refused(resp: httpx.Response, param: str | None, *needles: str) -> dict:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    body = resp.json()
    got = body["error"]["param"]
    assert body["success"] is False, body
    assert got == param or (param is not None and str(got).startswith(param + ".")), body
    for needle in needles:
        assert needle in body["message"], (needle, body["message"])
    return body


def timeline(server: ServerProcess) -> dict:
    resp = server.get("/dump_memory_timeline")
    assert resp.status_code == 200, resp.text
    return resp.json()


# ---------------------------------------------------------------- auth and bad bodies
@pytest.mark.parametrize("method,path,body", MEMORY_ROUTES, ids=[p for _, p, _ in MEMORY_ROUTES])
def test_memory_routes_need_the_admin_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN}):
        if method == "POST":
            resp = server.post(path, body, headers=headers)
        else:
            resp = server.get(path, headers=headers)
        assert_error(resp, 401)
    # generation needs no key (no --api-key): the server still serves, nothing was released
    out = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                      headers={})
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("path", ["/release_memory_occupation", "/resume_memory_occupation"])
@pytest.mark.parametrize("body,needle", [
    ({"tags": ["kv_cache", "gpu_dreams"]}, "gpu_dreams"),
    ({"tags": []}, "non-empty"),
    ({"tags": "kv_cache"}, "tags"),
    ({"tags": [1]}, "tags"),
])
def test_bad_tags_are_a_400_naming_tags(server, reference, path, body, needle):
    refused(server.post(path, body), "tags", needle)
    refused(server.post(path, {"tags": None, "oops": 1}), "oops")
    assert greedy(server) == reference


def test_release_while_a_request_runs_is_refused_and_changes_nothing(server, reference):
    async def scenario(http: httpx.AsyncClient) -> None:
        async def stream() -> list[dict]:
            events = []
            body = {"text": PROMPTS[0], "sampling_params": LONG, "stream": True}
            async with http.stream("POST", "/generate", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()
            return events

        started = asyncio.Event()
        task = asyncio.create_task(stream())
        await asyncio.wait_for(started.wait(), 30)
        for tags in (None, ["kv_cache"], ["weights"], ["cuda_graph"]):
            resp = await http.post("/release_memory_occupation", json={"tags": tags})
            if resp.status_code == 200:
                events = await asyncio.wait_for(task, 120)
                if events[-1]["meta_info"]["finish_reason"]["type"] == "length":
                    ok(await http.post("/resume_memory_occupation", json={"tags": tags}))
                    raise SlowHost("the stream finished before a release")
            body = refused(resp, None, "busy", "pause_generation")
            assert body["error"]["code"] == "memory_occupation_failed"
        assert not task.done()  # the request kept running throughout
        events = await asyncio.wait_for(task, 120)
        meta = events[-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == LONG["max_new_tokens"]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            await scenario(http)

    retry_slow_host(lambda: asyncio.run(main()))
    assert released(server) == {tag: 0 for tag in TAGS}
    assert greedy(server) == reference


# ---------------------------------------------------------------- release -> resume
def test_release_resume_all_then_same_greedy_output(server, reference):
    body = ok(server.post("/release_memory_occupation", {"tags": None}))
    assert body["released_bytes"]["kv_cache"] > 0 and body["released_bytes"]["weights"] > 0
    gauges = released(server)
    assert gauges["kv_cache"] == body["released_bytes"]["kv_cache"]
    assert gauges["weights"] == body["released_bytes"]["weights"]
    # while released, a generation is refused with a clear message (not run on freed memory)
    out = server.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "resume_memory_occupation" in out["meta_info"]["finish_reason"]["message"]
    # reading a released weight is a 400 saying so (it took the scheduler process down)
    read = server.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3})
    assert read.status_code == 400 and "released" in read.text, read.text
    assert server.get("/health").status_code == 200
    # released while idle (no pause) is a handover too: a probe must not restart the server
    assert server.get("/health_generate").status_code == 200
    # releasing again is harmless; resume with no body means every tag
    ok(server.post("/release_memory_occupation", {"tags": ["kv_cache"]}))
    body = ok(server.post("/resume_memory_occupation"))
    assert body["released_bytes"] == {tag: 0 for tag in TAGS}
    assert greedy(server) == reference


def test_staged_resume_weights_then_kv_cache(server, reference):
    ok(server.post("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}))
    body = ok(server.post("/resume_memory_occupation", {"tags": ["weights"]}))
    assert body["released_bytes"]["weights"] == 0 and body["released_bytes"]["kv_cache"] > 0
    assert released(server)["kv_cache"] == body["released_bytes"]["kv_cache"]
    ok(server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}))
    assert greedy(server) == reference


def test_paused_with_retracted_request_release_resume_continue(server):
    async def scenario(http: httpx.AsyncClient) -> None:
        events: list[dict] = []
        started = asyncio.Event()

        async def stream() -> None:
            body = {"text": PROMPTS[2], "sampling_params": LONG, "stream": True}
            async with http.stream("POST", "/generate", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(started.wait(), 30)
        assert (await http.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        resp = await http.post("/release_memory_occupation", json={"tags": None})
        assert resp.status_code == 200, resp.text
        assert resp.json()["released_bytes"]["kv_cache"] > 0
        resp = await http.post("/resume_memory_occupation", json={"tags": None})
        assert resp.status_code == 200, resp.text
        assert (await http.post("/continue_generation", json={})).status_code == 200
        await asyncio.wait_for(task, 120)
        meta = events[-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == LONG["max_new_tokens"]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            await scenario(http)

    asyncio.run(main())


# ---------------------------------------------------------------- metrics and timeline
def test_metrics_report_device_memory(server):
    m = metrics(server)
    reserved = m[("tide:memory_reserved_bytes", ())]
    allocated = m[("tide:memory_allocated_bytes", ())]
    assert m[("tide:memory_fragmentation_bytes", ())] == max(0.0, reserved - allocated)
    assert allocated > 0  # on CPU the scheduler process's RSS; on CUDA the allocator's bytes
    assert released(server) == {tag: 0 for tag in TAGS}
    info = server.get("/get_server_info").json()["memory"]
    assert set(info) >= {"reserved_bytes", "allocated_bytes", "fragmentation_bytes", "source",
                         "released_bytes"}


def test_dump_memory_timeline_and_plot_it(server, tmp_path):
    ok(server.post("/release_memory_occupation", {"tags": ["kv_cache"]}))
    ok(server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}))
    data = timeline(server)
    assert data["format"] == "tide.memory_timeline/1"
    assert data["pid"] == server.get("/get_server_info").json()["scheduler_pid"]
    assert data["memory_source"] in ("cuda", "cpu_rss") and data["memory_source"] in data["notes"]
    marks = [e for e in data["events"] if e["type"] == "mark"]
    kinds = [m["kind"] for m in marks]
    assert kinds[:2] == ["engine_ready", "scheduler_ready"] and marks[0]["allocated"] > 0
    times = [e["time"] for e in data["events"]]
    assert times == sorted(times)
    pytest.importorskip("matplotlib")
    from tide.cli import main

    src = tmp_path / "ledger.json"
    src.write_text(json.dumps(data))
    assert main(["memory-plot", str(src), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_release_and_resume_are_marked_on_the_timeline(server):
    before = len(timeline(server)["events"])
    ok(server.post("/release_memory_occupation", {"tags": ["kv_cache"]}))
    ok(server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}))
    kinds = [e["kind"] for e in timeline(server)["events"][before:] if e["type"] == "mark"]
    assert "release" in kinds and "resume" in kinds, kinds
    assert kinds.index("release") < len(kinds) - 1 - kinds[::-1].index("resume")


def test_without_memory_saver_the_routes_say_how_to_enable_it(model_path, tmp_path):
    srv = ServerProcess(model_path, "--max-total-tokens", "1024", log_dir=tmp_path)
    try:
        srv.wait_ready()
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            refused(srv.post(path, {"tags": None}), None, "enable_memory_saver")
        out = srv.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY})
        assert out.json()["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        srv.stop()
