"""Liveness and isolation of `tide serve`.

- A scheduler that stops (a real SIGSTOP) turns `/health` 503 within the health bound, new requests
  are refused, in-flight ones end with reason abort past the abort bound (and are unregistered);
  after SIGCONT everything serves again. A long declared operation (a distributed weight update
  waiting for the trainer) keeps `/health` at 200.
- Rids are scoped to the caller's key: another user can neither abort nor block a request by rid;
  the admin key reaches every request.
- `init_weights_update_group` refuses bad addresses, ports and names with a 400 naming the field;
  failed joins are bounded by their timeout and leave no thread behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors import safe_open
from server_utils import (
    ServerProcess,
    SlowHost,
    assert_error,
    free_port,
    retry_slow_host,
    running_server,
    serve_model_path,
)

from tide.scheduler.process import MAX_CONCURRENT_JOINS
from tide.server.auth import key_identity
from tide.io_struct import SchedulerHeartbeat
from tide.server.liveness import SchedulerLiveness
from tide.server.server_args import ServerArgs
from tide.weights import init_custom_process_group

USER_A, USER_B, USER_C = "user-a-key-1111", "user-b-key-2222", "user-c-key-3333"
ADMIN = "admin-key-9999"
HEALTH_S = 2.0  # --scheduler-health-timeout
ABORT_S = 5.0  # --scheduler-abort-timeout


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running_server(model_path, "--api-key", f"{USER_A},{USER_B}", "--api-key", USER_C,
                        "--admin-api-key", ADMIN,
                        "--scheduler-health-timeout", str(HEALTH_S),
                        "--scheduler-abort-timeout", str(ABORT_S),
                        api_key=USER_A, log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


def _info(server: ServerProcess) -> dict:
    resp = server.get("/get_server_info", headers=_bearer(ADMIN))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _wait_for(predicate, timeout: float, step: float = 0.1) -> float:
    """Seconds until `predicate()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


class _Stream:
    """A `/generate` stream read in a thread: `started` once the first event arrived; `last` is
    the last event, `done` whether `[DONE]` came."""

    def __init__(self, server: ServerProcess, key: str, body: dict) -> None:
        self.started = threading.Event()
        self.last: dict = {}
        self.done = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(server, key, body), daemon=True)
        self._thread.start()

    def _run(self, server: ServerProcess, key: str, body: dict) -> None:
        try:
            with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True},
                              headers=_bearer(key), timeout=120) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.last = json.loads(line[6:])
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.error = e
        finally:
            self.started.set()

    def join(self, timeout: float) -> dict:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream still open"
        if self.error is not None:
            raise self.error
        return self.last


# ---------------------------------------------------------------- unit: the judgement
def test_liveness_judges_silence_progress_and_declared_operations():
    now = [100.0]
    live = SchedulerLiveness(clock=lambda: now[0])
    live.on_heartbeat(SchedulerHeartbeat(loop_count=1))
    now[0] += 5
    assert live.stalled_for() == 5  # silent
    live.on_heartbeat(SchedulerHeartbeat(loop_count=1))  # beating, but the loop has not turned
    assert live.stalled_for() == 5
    live.on_heartbeat(SchedulerHeartbeat(loop_count=2))
    assert live.stalled_for() == 0
    now[0] += 7
    live.on_heartbeat(SchedulerHeartbeat(loop_count=2, operation="update_weights_from_disk",
                                         operation_seconds=7.0))
    assert live.stalled_for() == 0  # a declared operation is progress enough while it beats
    assert live.describe()["operation"] == "update_weights_from_disk"
    now[0] += 3
    assert live.stalled_for() == 3  # ...but not silence
    live.on_output()
    assert live.stalled_for() == 0


def test_server_args_keys_and_liveness_bounds():
    assert ServerArgs(api_key="a, b,a").api_keys == ("a", "b")
    assert ServerArgs().api_keys == ()
    for kwargs, field in (({"api_key": "a,,b"}, "api_key"),
                          ({"api_key": "a,b", "admin_api_key": "b"}, "admin_api_key"),
                          ({"scheduler_health_timeout": 0.0}, "scheduler_health_timeout"),
                          ({"scheduler_health_timeout": 10.0, "scheduler_abort_timeout": 5.0},
                           "scheduler_abort_timeout")):
        with pytest.raises(ValueError, match=field):
            ServerArgs(**kwargs)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_process_group_join_is_validated_bounded_and_leaves_nothing():
    for kwargs, field in (({"master_address": "10.0.0.1\n"}, "master_address"),
                          ({"master_address": "h:1"}, "master_address"),
                          ({"master_port": 70000}, "master_port"),
                          ({"world_size": 1}, "world_size"),
                          ({"group_name": "a/b"}, "group_name")):
        args = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 1, "rank": 1,
                "world_size": 2, **kwargs}
        with pytest.raises(ValueError, match=field):
            init_custom_process_group(**args)
    before = _threads()
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="could not join group 'g' .* within 0.5 s"):
            init_custom_process_group("gloo", "127.0.0.1", free_port(), 1, 2, "g",
                                      join_timeout_s=0.5)
        assert time.monotonic() - start < 5
    assert _threads() == before


def test_process_group_join_keeps_its_deadline_with_no_trainer():
    # torch's store client alone retried its connect past the deadline (about twice the timeout).
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="nothing accepted a connection"):
        init_custom_process_group("gloo", "127.0.0.1", free_port(), 1, 2, "g", join_timeout_s=2.0)
    assert 1.9 < time.monotonic() - start < 3.0


# ---------------------------------------------------------------- rid scoping
def test_rids_are_scoped_to_the_callers_key(server):
    retry_slow_host(lambda: _rids_are_scoped(server))


def _ran_to_length(stream: _Stream) -> bool:
    """Whether A's stream ended with all its tokens: asked when a call meant to land while it ran
    found nothing, to tell a stalled host (`SlowHost`) from a failure."""
    return stream.join(30)["meta_info"]["finish_reason"]["type"] == "length"


def _rids_are_scoped(server: ServerProcess) -> None:
    long_body = {"text": "Hello", "rid": "shared",
                 "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    a = _Stream(server, USER_A, long_body)
    assert a.started.wait(60) and a.last, a.error
    # Another user's "shared" is an independent request: accepted, runs, completes.
    out = server.post("/generate", {"text": "Hi", "rid": "shared",
                                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
                      headers=_bearer(USER_B))
    assert out.status_code == 200, out.text
    assert out.json()["meta_info"]["id"] == "shared"
    assert out.json()["meta_info"]["completion_tokens"] == 3
    # ...and the OpenAI routes scope the same way
    chat = server.post("/v1/chat/completions", {
        "model": server.get("/v1/models").json()["data"][0]["id"], "rid": "shared",
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=_bearer(USER_C))
    assert chat.status_code == 200, chat.text
    # B cannot abort A's request: exactly the reply a rid that names nothing gets.
    nothing = server.post("/abort_request", {"rid": "no-such-rid"}, headers=_bearer(USER_B))
    theirs = server.post("/abort_request", {"rid": "shared"}, headers=_bearer(USER_B))
    assert theirs.status_code == nothing.status_code == 200
    assert theirs.json() == nothing.json() == {"success": True, "num_aborted": 0}
    # A's own duplicate is refused; A's request is still running.
    dup = server.post("/generate", {"text": "x", "rid": "shared"}, headers=_bearer(USER_A))
    if dup.status_code == 200 and _ran_to_length(a):
        raise SlowHost("A's request finished before its duplicate came")
    assert assert_error(dup, 400, "rid")["code"] == "duplicate_rid"
    # A aborts its own request by rid (so it was still running when the duplicate came).
    mine = server.post("/abort_request", {"rid": "shared"}, headers=_bearer(USER_A))
    if mine.json().get("num_aborted") == 0 and _ran_to_length(a):
        raise SlowHost("A's request finished before its abort came")
    assert mine.json() == {"success": True, "num_aborted": 1}
    last = a.join(30)
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400


def test_admin_abort_by_rid_reaches_every_user(server):
    retry_slow_host(lambda: _admin_abort_by_rid(server))


def _admin_abort_by_rid(server: ServerProcess) -> None:
    a = _Stream(server, USER_A, {"text": "Hello", "rid": "victim",
                                 "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
    assert a.started.wait(60) and a.last, a.error
    resp = server.post("/abort_request", {"rid": "victim"}, headers=_bearer(ADMIN))
    if resp.json().get("num_aborted") == 0 and _ran_to_length(a):
        raise SlowHost("the request finished before its abort came")
    assert resp.json() == {"success": True, "num_aborted": 1}
    assert a.join(30)["meta_info"]["finish_reason"]["type"] == "abort"


def test_server_made_rids_are_random_and_keys_never_logged(server):
    ids = [server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                       headers=_bearer(USER_B)).json()["meta_info"]["id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
    log = server.log()
    assert f"({key_identity(USER_B)})" in log  # requests are logged with the key's hash...
    for key in (USER_A, USER_B, USER_C, ADMIN):
        assert key not in log  # ...never with the key


# ---------------------------------------------------------------- trainer groups
@pytest.mark.parametrize("field,value", [
    ("master_address", "127.0.0.1\n"),
    ("master_address", "127.0.0.1:29500"),
    ("master_address", "[::1]"),
    ("master_address", "host name"),
    ("master_address", "a\x00b"),
    ("master_address", "h" * 300),
    ("master_port", 0),
    ("master_port", 65536),
    ("world_size", 1),
    ("world_size", 10**9),
    ("rank_offset", 0),
    ("group_name", "../etc"),
    ("group_name", "g" * 129),
    ("timeout", 0),
    ("timeout", 601),
])
def test_bad_group_join_is_400_naming_the_field(server, field, value):
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "timeout": 1, field: value}
    start = time.monotonic()
    resp = server.post("/init_weights_update_group", body, headers=_bearer(ADMIN))
    assert time.monotonic() - start < 5
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
    assert resp.json()["success"] is False


def test_failed_joins_are_bounded_and_leave_no_thread(server):
    port = free_port()  # nothing listens there
    before = _info(server)["num_threads"]
    join_s = 1.0

    def join(i: int) -> tuple[float, httpx.Response]:
        start = time.monotonic()
        resp = server.post("/init_weights_update_group", {
            "master_address": "::1" if i % 3 == 0 else "127.0.0.1", "master_port": port,
            "rank_offset": 1, "world_size": 2, "group_name": f"closed-{i}", "backend": "gloo",
            "timeout": join_s}, headers=_bearer(ADMIN))
        return time.monotonic() - start, resp

    # As many at once as the cap allows (a join's slot is free before its reply goes out).
    with ThreadPoolExecutor(MAX_CONCURRENT_JOINS) as pool:
        results = list(pool.map(join, range(30)))
    for elapsed, resp in results:
        assert resp.status_code == 400, resp.text
        assert "could not join" in resp.json()["message"], resp.json()
        assert elapsed < join_s + 5, elapsed
    info = _info(server)
    assert info["weight_update_groups"] == [] and info["num_weight_update_joins"] == 0
    _wait_for(lambda: _info(server)["num_threads"] <= before, 10)


def test_concurrent_joins_are_capped(server):
    port = free_port()

    def join(i: int) -> httpx.Response:
        return server.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": f"cap-{i}", "backend": "gloo", "timeout": 5}, headers=_bearer(ADMIN))

    with ThreadPoolExecutor(MAX_CONCURRENT_JOINS + 2) as pool:
        messages = [r.json()["message"] for r in pool.map(join, range(MAX_CONCURRENT_JOINS + 2))]
    assert sum("could not join" in m for m in messages) == MAX_CONCURRENT_JOINS, messages
    assert sum("joins are in progress" in m for m in messages) == 2, messages


# ---------------------------------------------------------------- liveness
def _probe_weight(model_path) -> tuple[str, "object"]:
    name = "model.norm.weight"
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():
                return name, f.get_tensor(name).float()  # the CPU model runs in float32
    raise AssertionError(f"{name} not in the checkpoint")


def test_long_declared_operation_keeps_health(server, model_path):
    """A distributed update blocks the loop until the trainer broadcasts; while it waits (longer
    than the health bound), /health stays 200."""
    port, group = free_port(), "liveness-sync"
    result: list = []
    joiner = threading.Thread(target=lambda: result.append(server.post(
        "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                       "rank_offset": 1, "world_size": 2, "group_name": group,
                                       "backend": "gloo", "timeout": 30},
        headers=_bearer(ADMIN))), daemon=True)
    joiner.start()
    trainer = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, group, timeout_s=60)
    joiner.join(60)
    assert result[0].status_code == 200, result[0].text
    name, tensor = _probe_weight(model_path)
    update: list = []
    updater = threading.Thread(target=lambda: update.append(server.post(
        "/update_weights_from_distributed", {"names": [name], "dtypes": ["float32"],
                                             "shapes": [list(tensor.shape)], "group_name": group},
        headers=_bearer(ADMIN), timeout=120)), daemon=True)
    try:
        updater.start()
        deadline = time.monotonic() + 2.5 * HEALTH_S
        while time.monotonic() < deadline:  # the loop is blocked waiting for the broadcast
            assert server.get("/health").status_code == 200
            time.sleep(0.2)
        assert updater.is_alive()
        trainer.broadcast_weights([(name, tensor.clone())])  # the same values: the model does not change
        updater.join(60)
        assert update[0].status_code == 200, update[0].text
    finally:
        server.post("/destroy_weights_update_group", {"group_name": group}, headers=_bearer(ADMIN))
        trainer.close()


def test_stopped_scheduler_fails_health_and_requests_then_recovers(server):
    sched_pid = _info(server)["scheduler_pid"]
    assert server.get("/health").status_code == 200
    stream = _Stream(server, USER_A, {"text": "Hello", "rid": "in-flight",
                                      "sampling_params": {"max_new_tokens": 400,
                                                          "ignore_eos": True}})
    assert stream.started.wait(60) and stream.last, stream.error
    os.kill(sched_pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        took = _wait_for(lambda: server.get("/health").status_code == 503, HEALTH_S + 3)
        assert took > HEALTH_S * 0.5
        assert server.get("/health_generate", timeout=5).status_code == 503
        refused = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                              timeout=5)
        assert assert_error(refused, 503)["code"] == "engine_unresponsive"
        info = server.get("/get_server_info", timeout=5).json()  # answers from the HTTP side
        assert info["scheduler_responsive"] is False and info["scheduler_pid"] == sched_pid
        # The in-flight stream ends with a clear abort once the abort bound has passed.
        last = stream.join(ABORT_S + 10)
        assert time.monotonic() - stopped >= ABORT_S - 0.5
        reason = last["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "stopped responding" in reason["message"], reason
        assert stream.done
        assert server.get("/get_server_info", timeout=5).json()["num_http_requests_in_flight"] == 0
    finally:
        os.kill(sched_pid, signal.SIGCONT)
    _wait_for(lambda: server.get("/health").status_code == 200, 5)
    # Serving again: the aborted request's rid is free, and its KV was given back.
    out = server.post("/generate", {"text": "Hi", "rid": "in-flight",
                                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
    _wait_for(lambda: (lambda i: i["num_running_reqs"] == 0 and i["kv_held_slots"] == 0
                       and i["scheduler_responsive"])(_info(server)), 10)
    assert server.get("/health_generate").status_code == 200

