"""`tide serve` auth (--api-key / --admin-api-key) and process lifecycle (signals, no orphans)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, assert_error, running_server, serve_model_path

API_KEY = "user-key-123"
ADMIN_KEY = "admin-key-456"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server_tmp(tmp_path_factory):
    """The server's TMPDIR: where its zmq ipc:// directory lives."""
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory, server_tmp):
    with running_server(model_path, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                        "--served-model-name", "m", api_key=API_KEY,
                        log_dir=tmp_path_factory.mktemp("server-log"),
                        env={"TMPDIR": str(server_tmp)}) as srv:
        yield srv


def _ipc_dirs(tmp) -> list[str]:
    return sorted(p.name for p in tmp.glob("tide-ipc-*"))


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- auth (acceptance 6)
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/get_model_info", "/metrics",
                                  "/get_server_info"])
def test_routes_need_the_api_key(server, path):
    err = assert_error(server.get(path, headers={}), 401, None)
    assert err["code"] == "missing_api_key"
    err = assert_error(server.get(path, headers=_bearer("wrong")), 401, None)
    assert err["code"] == "invalid_api_key"
    assert server.get(path, headers=_bearer(API_KEY)).status_code == 200
    assert server.get(path, headers=_bearer(ADMIN_KEY)).status_code == 200  # admin key works too


def test_generation_routes_need_the_api_key(server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    assert_error(server.post("/generate", body, headers={}), 401)
    assert_error(server.post("/generate", body, headers=_bearer("nope")), 401)
    assert server.post("/generate", body, headers=_bearer(API_KEY)).status_code == 200

    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    out = good.completions.create(model="m", prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2)


def test_admin_routes_need_the_admin_key(server):
    server.post("/generate", {"text": "Fill the cache", "sampling_params": {"max_new_tokens": 2}})
    cached = server.get("/get_server_info").json()["kv_cached_slots"]
    assert cached > 0
    for key in (None, "wrong", API_KEY):
        assert_error(server.post("/flush_cache", headers=_bearer(key)), 401)
        assert_error(server.get("/flush_cache", headers=_bearer(key)), 401)
        assert_error(server.post("/abort_request", {"abort_all": True}, headers=_bearer(key)),
                     401)
    # a refused key changed nothing
    assert server.get("/get_server_info").json()["kv_cached_slots"] == cached
    assert server.post("/flush_cache", headers=_bearer(ADMIN_KEY)).status_code == 200
    assert server.get("/get_server_info").json()["kv_cached_slots"] == 0
    resp = server.post("/abort_request", {"abort_all": True}, headers=_bearer(ADMIN_KEY))
    assert resp.status_code == 200
    # aborting one's own request by rid needs only the API key
    assert server.post("/abort_request", {"rid": "x"}, headers=_bearer(API_KEY)).status_code == 200


def test_wrong_key_does_not_abort(server):
    async def run() -> tuple[int, dict]:
        body = {"text": "Hello", "stream": True,
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
        last: dict = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers=_bearer(API_KEY)) as http:
            async with http.stream("POST", "/generate", json=body) as resp:
                status = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if not last:
                            r = await http.post("/abort_request", json={"abort_all": True})
                            status = r.status_code
                        last = json.loads(line[6:])
        return status, last

    status, last = asyncio.run(run())
    assert status == 401
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == 60


# ---------------------------------------------------------------- shutdown (runs last here)
def test_sigterm_aborts_in_flight_and_leaves_no_processes(server, server_tmp):
    sched_pid = server.get("/get_server_info").json()["scheduler_pid"]
    assert _alive(sched_pid)
    assert len(_ipc_dirs(server_tmp)) == 1
    results: dict = {}

    async def stream_then_signal() -> None:
        body = {"text": "Hello", "stream": True,
                "sampling_params": {"max_new_tokens": 480, "ignore_eos": True, "n": 8}}
        last: dict[int, dict] = {}
        done = False
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers=_bearer(API_KEY)) as http:
            async with http.stream("POST", "/generate", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        if not last:
                            server.proc.send_signal(signal.SIGTERM)
                        event = json.loads(line[6:])
                        last[event["index"]] = event
        results["last"], results["done"] = last, done

    asyncio.run(stream_then_signal())
    assert results["done"]
    reasons = {i: e["meta_info"]["finish_reason"] for i, e in results["last"].items()}
    assert len(reasons) == 8
    assert all(r["type"] == "abort" for r in reasons.values()), reasons
    assert server.proc.wait(20) == 0, server.log()
    assert _wait_gone(sched_pid), "scheduler process outlived the server"
    assert server.group_pids() == []
    assert "aborting" in server.log()
    assert _ipc_dirs(server_tmp) == []


def test_scheduler_dies_with_a_killed_server(model_path, tmp_path):
    """kill -9 of the HTTP process: the scheduler exits and removes the ipc:// directory."""
    srv = ServerProcess(model_path, log_dir=tmp_path, env={"TMPDIR": str(tmp_path)})
    try:
        srv.wait_ready()
        sched_pid = srv.get("/get_server_info").json()["scheduler_pid"]
        assert _alive(sched_pid)
        assert len(_ipc_dirs(tmp_path)) == 1
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        assert _wait_gone(sched_pid), f"orphaned scheduler process:\n{srv.log()}"
        assert _ipc_dirs(tmp_path) == [], f"the scheduler left its ipc:// directory behind:\n{srv.log()}"
    finally:
        srv.stop()


def _hang_in_teardown(ipc_dir: str, started) -> None:
    from tide.scheduler.process import handle_exit_signals

    handle_exit_signals(ipc_dir)
    started.set()
    try:
        time.sleep(60)
    finally:
        time.sleep(60)  # a teardown that never ends (a stuck native call)


def test_sigterm_removes_the_ipc_dir_before_teardown(tmp_path):
    """The scheduler's SIGTERM handler removes the socket directory first: a teardown that then hangs
    or crashes cannot leave it behind."""
    import multiprocessing as mp

    ipc_dir = tmp_path / "tide-ipc-test"
    ipc_dir.mkdir()
    (ipc_dir / "scheduler_input").write_bytes(b"")
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_hang_in_teardown, args=(str(ipc_dir), started), daemon=True)
    proc.start()
    try:
        assert started.wait(60)
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while ipc_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ipc_dir.exists()
        assert proc.is_alive()  # still in its hung teardown: the removal did not wait for it
    finally:
        proc.kill()
        proc.join(10)


def test_server_exits_when_scheduler_dies(model_path, tmp_path):
    srv = ServerProcess(model_path, log_dir=tmp_path)
    try:
        srv.wait_ready()
        sched_pid = srv.get("/get_server_info").json()["scheduler_pid"]
        os.kill(sched_pid, signal.SIGKILL)
        assert srv.proc.wait(20) != 0
        assert "scheduler process died" in srv.log()
    finally:
        srv.stop()


def test_bad_model_path_fails_fast(tmp_path):
    srv = ServerProcess(tmp_path / "missing", log_dir=tmp_path)
    try:
        assert srv.proc.wait(60) == 2
        assert "model_path" in srv.log()
    finally:
        srv.stop()


def _rank_children(pid: int) -> list[int]:
    """Live tensor-parallel rank processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"tide.scheduler.tp_worker" in cmd:
            out.append(int(entry))
    return out


def test_a_dead_tensor_parallel_rank_stops_the_scheduler(model_path, tmp_path):
    """With tp_size 2, killing rank 1 breaks the engine for good: the request in the way is
    aborted naming the rank, and the scheduler exits (the server with it, so a supervisor
    restarts it) instead of failing every later request at once."""
    srv = ServerProcess(model_path, "--tp-size", "2", "--device", "cpu", log_dir=tmp_path)
    try:
        srv.wait_ready()
        sched_pid = srv.get("/get_server_info").json()["scheduler_pid"]
        ranks = _rank_children(sched_pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        out = srv.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        if out.status_code == 200:
            reason = out.json()["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "rank" in reason["message"], reason
        assert srv.proc.wait(60) != 0
        assert "broken for good" in srv.log()
    finally:
        srv.stop()


def test_tensor_parallel_ranks_die_with_rank_0_even_when_stopped(model_path, tmp_path):
    """A rank process is SIGKILLed when its rank 0 dies, even while stopped (it would take no
    other signal, and hold its device for ever)."""
    srv = ServerProcess(model_path, "--tp-size", "2", "--device", "cpu", log_dir=tmp_path)
    try:
        srv.wait_ready()
        sched_pid = srv.get("/get_server_info").json()["scheduler_pid"]
        (rank,) = _rank_children(sched_pid)
        os.kill(rank, signal.SIGSTOP)
        os.kill(sched_pid, signal.SIGKILL)
        assert _wait_gone(rank), "a stopped rank outlived its rank 0"
    finally:
        srv.stop()
