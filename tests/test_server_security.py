"""Untrusted requests against real `tide serve` processes: a crafted pickle never runs, JSON routes
take only `application/json`, browsers on other origins are refused, and the bind policy.

Two servers: the default `tide serve` (demo model, no keys), and one with only `--api-key` set (its
user key then reaches the admin routes). The second one is also the token-ids-only server
(`--skip-tokenizer-init` on a checkpoint without tokenizer files), which saves a server start in CI.
The admin-key case of the pickle test is in tests/test_server_weights.py, whose server has one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import (
    assert_error,
    assert_pickle_is_live,
    pickle_exploit_payload,
    running_server,
    serve_model_path,
)

from tide.cli import build_parser, main
from tide.config import EngineConfig
from tide.server.security import cross_origin_problem, host_problem, is_loopback_host
from tide.server.server_args import ServerArgs
from tide.weights import flatten_by_dtype, serialize_named_tensors

USER_KEY = "user-key-123"
ROUTES = {"/update_weights_from_tensor": "serialized_named_tensors",
          "/update_weights_from_ipc": "serialized_buckets"}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """The default `tide serve`: demo model, no keys."""
    model = serve_model_path(tmp_path_factory.mktemp("model"))
    with running_server(model, log_dir=tmp_path_factory.mktemp("open-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def user_key_server(no_tokenizer_checkpoint, tmp_path_factory):
    """Only `--api-key` set, serving token ids only (`--skip-tokenizer-init`)."""
    with running_server(no_tokenizer_checkpoint, "--api-key", USER_KEY, "--skip-tokenizer-init",
                        "--allowed-hosts", "Tide.Example.", "::1:0:5",
                        api_key=USER_KEY, log_dir=tmp_path_factory.mktemp("user-log")) as srv:
        yield srv


def _send(srv, path: str, body: dict, content_type: str | None = "application/json",
          key: str | None = None, **headers: str) -> httpx.Response:
    if content_type is not None:
        headers["Content-Type"] = content_type
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(srv.url + path, content=json.dumps(body), headers=headers, timeout=60)


def _attack(srv, marker: Path, key: str | None) -> None:
    """Every way of sending the exploit: both routes, one payload or a list, JSON or the content
    types a web page can send without a preflight. None of it may run."""
    payload = pickle_exploit_payload(marker)
    for path, field in ROUTES.items():
        for value in (payload, [payload]):
            resp = _send(srv, path, {field: value}, key=key)
            assert resp.status_code == 400, resp.text
            assert "pickle" in resp.json()["message"], resp.text
            assert resp.json()["error"]["param"] == field
            for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                resp = _send(srv, path, {field: value}, content_type, key=key)
                assert resp.status_code == 415, resp.text
                err = resp.json()["error"]  # sglang's admin fields come along: success false
                assert err["param"] == "Content-Type" and "application/json" in err["message"]
                assert resp.json()["success"] is False
            resp = _send(srv, path, {field: value}, "text/plain", key=key,
                         Origin="https://attacker.example")
            assert resp.status_code == 403, resp.text
    time.sleep(0.5)  # the scheduler has answered every request; give a stray command time anyway
    assert not marker.exists(), "the pickle payload ran"


def _assert_update_still_works(srv, key: str | None) -> None:
    """The routes themselves work: the model's own norm weight, sent back, is accepted."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    values = srv.post("/get_weights_by_name", {"name": NORM, "truncate_size": 100000},
                      headers=headers).json()
    named = [(NORM, torch.tensor(values, dtype=torch.float32))]
    for path, obj in (("/update_weights_from_tensor", named),
                      ("/update_weights_from_ipc", flatten_by_dtype(named))):
        resp = srv.post(path, {ROUTES[path]: serialize_named_tensors(obj)}, headers=headers)
        assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert srv.post("/get_weights_by_name", {"name": NORM, "truncate_size": 100000},
                    headers=headers).json() == values


# ---------------------------------------------------------------- crafted pickle payloads
def test_pickle_payload_never_runs_without_keys(open_server, tmp_path):
    marker = tmp_path / "ran-anonymous"
    assert_pickle_is_live(pickle_exploit_payload(marker), marker)
    _attack(open_server, marker, key=None)
    assert open_server.get("/health").status_code == 200
    _assert_update_still_works(open_server, key=None)


def test_pickle_payload_never_runs_with_the_user_key(user_key_server, tmp_path):
    marker = tmp_path / "ran-user-key"
    payload = pickle_exploit_payload(marker)
    for path, field in ROUTES.items():
        assert _send(user_key_server, path, {field: payload}).status_code == 401
    _attack(user_key_server, marker, key=USER_KEY)
    assert user_key_server.get("/health").status_code == 200


# ---------------------------------------------------------------- content type and origin
def test_json_routes_need_the_json_content_type(open_server):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    for content_type in ("text/plain", "text/plain; charset=utf-8", "multipart/form-data",
                         "application/x-www-form-urlencoded", "application/jsonx", None):
        err = assert_error(_send(open_server, "/generate", body, content_type), 415,
                           "Content-Type")
        assert err["code"] == "unsupported_media_type" and "Content-Type" in err["message"]
    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON"):
        assert _send(open_server, "/generate", body, content_type).status_code == 200
    # Routes whose body is optional take an empty body without a type; a body still needs one.
    assert httpx.post(open_server.url + "/continue_generation").status_code == 200
    assert httpx.post(open_server.url + "/flush_cache").status_code == 200
    resp = httpx.post(open_server.url + "/pause_generation", content=b'{"mode": "abort"}')
    assert resp.status_code == 415 and resp.json()["error"]["param"] == "Content-Type"
    info = open_server.get("/get_server_info").json()
    assert info["num_http_requests_in_flight"] == 0


def test_browsers_on_other_origins_are_refused(open_server):
    url = open_server.url
    same = {"Origin": url}
    assert httpx.post(url + "/continue_generation", headers=same).status_code == 200
    foreign = [{"Origin": "https://attacker.example"}, {"Origin": "null"},
               {"Origin": "http://127.0.0.1:1"}, {"Sec-Fetch-Site": "cross-site"},
               {"Sec-Fetch-Site": "same-site"}]
    for headers in foreign:
        # An empty POST needs no content type, so only the origin check stops it pausing.
        resp = httpx.post(url + "/pause_generation", headers=headers)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "cross_origin_refused"
        assert httpx.get(url + "/flush_cache", headers=headers).status_code == 403
    # Nothing was paused: a generation completes.
    out = open_server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 2


def test_dns_rebinding_pages_are_refused_on_a_loopback_server(open_server):
    """A page on a name re-pointed at 127.0.0.1 is same-origin to the browser (Origin equals Host);
    its Host names no loopback address, so a server bound to loopback refuses it."""
    url, port = open_server.url, open_server.port
    rebound = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}",
               "Sec-Fetch-Site": "same-origin"}
    resp = httpx.post(url + "/pause_generation", headers=rebound)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "cross_origin_refused"
    assert "DNS-rebinding" in resp.json()["error"]["message"]
    assert httpx.get(url + "/health", headers={"Host": "attacker.example"}).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.7", "LOCALHOST"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize("host,refused", [
    (None, False), ("127.0.0.1:30000", False), ("localhost", False), ("[::1]:30000", False),
    ("[::1]", False), ("127.1.2.3:8", False), ("localhost.:30000", False),
    ("api.localhost:30000", False), ("127.1", False), ("127.1:30000", False),
    ("10.1", True), ("1.2.3.4.5", True), ("attacker.example:30000", True),
    ("10.0.0.5", True), ("[2001:db8::1]:80", True), ("localhost.attacker.example", True), ("", True),
    ("[::1]evil.example", True), ("[::1]:80x", True),
])
def test_host_rules(host, refused):
    from starlette.datastructures import Headers

    headers = {} if host is None else {"host": host}
    assert (host_problem(Headers(headers)) is not None) == refused


def test_allowed_hosts_add_names_a_loopback_server_answers(user_key_server):
    """`--allowed-hosts` (a proxy that forwards the client's Host): the names given, in any case
    and with any port, are answered; other names are still refused."""
    srv = user_key_server
    key = {"Authorization": f"Bearer {USER_KEY}"}
    for host in ("tide.example", f"TIDE.example.:{srv.port}", "[::1:0:5]:80", "[0:0:0:0:0:1:0:5]"):
        assert httpx.get(srv.url + "/health", headers={**key, "Host": host}).status_code == 200, host
    for host in ("api.tide.example", "example", "[::1:0:6]"):
        assert httpx.get(srv.url + "/health", headers={**key, "Host": host}).status_code == 403, host
    for bad in ("http://x.example", "x.example:80", "a b", "-x.example", "", "x" * 300):
        with pytest.raises(ValueError, match="allowed_hosts"):
            ServerArgs(allowed_hosts=(bad,))
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerArgs(allowed_hosts="x.example")
    assert ServerArgs(allowed_hosts=("A.Example.", "a.example")).allowed_hosts == ("a.example",)
    assert ServerArgs(allowed_hosts=("my_service",)).allowed_hosts == ("my_service",)
    assert ServerArgs(allowed_hosts=None).allowed_hosts == ()  # type: ignore[arg-type]


def test_no_key_server_warns_that_admin_routes_are_open(open_server):
    assert "admin routes included" in open_server.log()
    assert "open to local users" in open_server.log()


@pytest.mark.parametrize("headers,refused", [
    ({}, False),
    ({"origin": "http://127.0.0.1:30000", "host": "127.0.0.1:30000"}, False),
    ({"origin": "http://localhost", "host": "localhost:80"}, False),
    ({"origin": "https://a.example:443", "host": "a.example"}, False),
    ({"sec-fetch-site": "same-origin"}, False),
    ({"sec-fetch-site": "none"}, False),
    ({"origin": "http://127.0.0.1:30001", "host": "127.0.0.1:30000"}, True),
    ({"origin": "http://evil.example", "host": "127.0.0.1:30000"}, True),
    ({"origin": "null", "host": "127.0.0.1:30000"}, True),
    ({"origin": "garbage", "host": "127.0.0.1:30000"}, True),
    ({"sec-fetch-site": "cross-site"}, True),
])
def test_cross_origin_rules(headers, refused):
    from starlette.datastructures import Headers

    assert (cross_origin_problem(Headers(headers)) is not None) == refused


# ---------------------------------------------------------------- bind policy
@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("127.8.9.10", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("192.168.1.5", False), ("10.0.0.1", False), ("example.com", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


def test_bind_policy_in_server_args():
    engine = EngineConfig()
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        with pytest.raises(ValueError, match="--admin-api-key") as info:
            ServerArgs(engine=engine, host=host)
        assert "--allow-unauthenticated-admin" in str(info.value)
        with pytest.raises(ValueError, match="anyone with the API key"):
            ServerArgs(engine=engine, host=host, api_key="k")
        ServerArgs(engine=engine, host=host, admin_api_key="a")
        args = ServerArgs(engine=engine, host=host, allow_unauthenticated_admin=True)
        assert "everyone who can reach" in args.open_admin_warning()
    local = ServerArgs(engine=engine, host="127.0.0.1")
    assert "local users" in local.open_admin_warning()
    assert ServerArgs(engine=engine, api_key="k").open_admin_warning() is None
    assert ServerArgs(engine=engine, admin_api_key="a").open_admin_warning() is None


def test_serve_refuses_a_public_host_before_loading(monkeypatch, capsys):
    import tide.server

    def never(_args):
        raise AssertionError("launch_server was called")

    monkeypatch.setattr(tide.server, "launch_server", never)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--host", "0.0.0.0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not a loopback address" in err and "--admin-api-key" in err
    # With the explicit opt-in (or an admin key) the same command goes on to launch.
    launched = []
    monkeypatch.setattr(tide.server, "launch_server", lambda args: launched.append(args) or 0)
    assert main(["serve", "--host", "0.0.0.0", "--allow-unauthenticated-admin"]) == 0
    assert main(["serve", "--host", "0.0.0.0", "--admin-api-key", "a"]) == 0
    assert [a.host for a in launched] == ["0.0.0.0", "0.0.0.0"]
    assert launched[0].allow_unauthenticated_admin and not launched[1].allow_unauthenticated_admin
    assert build_parser().parse_args(["serve"]).allow_unauthenticated_admin is False


# ---------------------------------------------------------------- token ids only
def test_skip_tokenizer_init_server_takes_and_returns_ids(user_key_server, no_tokenizer_checkpoint):
    import tide

    srv = user_key_server
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = srv.post("/generate", {"input_ids": prompts, "sampling_params": greedy})
    assert out.status_code == 200, out.text
    engine = tide.Engine(str(no_tokenizer_checkpoint), skip_tokenizer_init=True)
    try:
        want = engine.generate(input_ids=prompts, sampling_params=greedy)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in out.json()] == [w["output_ids"] for w in want]
    assert all("text" not in o and len(o["output_ids"]) == 6 for o in out.json())
    # Streaming: ids, no text.
    with httpx.stream("POST", srv.url + "/generate", headers={
            **srv.headers, "Content-Type": "application/json"}, content=json.dumps(
            {"input_ids": prompts[0], "sampling_params": greedy, "stream": True})) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert events and all("text" not in e for e in events)
    assert events[-1]["output_ids"] == want[0]["output_ids"]
    # OpenAI completions with a token-id prompt: ids in, empty text out.
    comp = srv.post("/v1/completions", {"model": str(no_tokenizer_checkpoint), "prompt": prompts[0],
                                        "max_tokens": 3, "temperature": 0})
    assert comp.status_code == 200, comp.text
    assert comp.json()["choices"][0]["text"] == ""
    assert comp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "hello"}, "text"),
    ("/generate", {"text": ["a", "b"]}, "text"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"stop": "x"}},
     "sampling_params.stop"),
    ("/generate", {"input_ids": [[5, 6], [7]], "sampling_params": [{}, {"stop": ["x"]}]},
     "sampling_params.1.stop"),
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6], "stop": "x"}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_skip_tokenizer_init_server_refuses_text(user_key_server, no_tokenizer_checkpoint, path, body,
                                                 param):
    if path.startswith("/v1"):
        body = {"model": str(no_tokenizer_checkpoint), **body}
    err = assert_error(user_key_server.post(path, body), 400, param)
    assert err["code"] == "tokenizer_missing" and "skip-tokenizer-init" in err["message"]
