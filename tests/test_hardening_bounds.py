"""Bounded cost and isolation: no request can take the server down or hurt other requests.

One real `tide serve` for the module (small limits so the bounds are cheap to reach): every input
that used to be a 500, leak a request, freeze the event loop or hold a connection is now a 4xx naming
the field, and the server keeps serving with nothing left in flight. Plus the in-process pieces:
`SamplingParams` ranges, the scheduler isolating a request whose sampling fails, the last-resort 500.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess, assert_error, running_server, serve_model_path

from tide.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from tide.server.limits import RequestLimits

MODEL = "tide-demo"
BODY_READ_TIMEOUT = 2.0
HEADER_READ_TIMEOUT = 2.0
CHARS_PER_TOKEN = 1024
MAX_BATCH = 64
MAX_LOGPROB_ENTRIES = 10_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = serve_model_path(tmp_path_factory.mktemp("serve-model"))
    with running_server(model, "--served-model-name", MODEL,
                        "--body-read-timeout", str(BODY_READ_TIMEOUT),
                        "--header-read-timeout", str(HEADER_READ_TIMEOUT),
                        "--prompt-chars-per-token", str(CHARS_PER_TOKEN),
                        "--max-batch-size", str(MAX_BATCH),
                        "--max-logprob-entries", str(MAX_LOGPROB_ENTRIES),
                        log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def info(server):
    return server.get("/get_model_info").json()


def _server_info(server: ServerProcess) -> dict:
    return server.get("/get_server_info").json()


def _assert_clean(server: ServerProcess, timeout: float = 20.0) -> None:
    """Nothing in flight on either side, no KV held, and a generation still works."""
    deadline = time.monotonic() + timeout
    while True:
        info = _server_info(server)
        idle = (info["num_http_requests_in_flight"] == 0 and info["num_running_reqs"] == 0
                and info["num_queued_reqs"] == 0 and info["kv_held_slots"] == 0)
        if idle:
            break
        assert time.monotonic() < deadline, f"requests left behind: {info}"
        time.sleep(0.05)
    assert info["invariants_ok"]
    out = server.post("/generate", {"input_ids": [5, 6, 7],
                                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert out.status_code == 200, out.text
    assert len(out.json()["output_ids"]) == 3


def _raw_post(server: ServerProcess, path: str, raw: bytes | str) -> httpx.Response:
    content = raw.encode() if isinstance(raw, str) else raw
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def _sp(**params) -> str:
    return json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}})


def _cmpl(**fields) -> str:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})


def _chat(**fields) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, **fields})


# (route, raw JSON body, status, param) -- raw text so lone surrogates and huge numbers go as sent.
BAD = [
    # integers past what the sampler and the wire take (2**63 .. 2**64: overflowed the sampler)
    ("/generate", _sp(top_k=2**63 + 5), "sampling_params.top_k"),
    ("/generate", _sp(top_k=2**64 + 5), "sampling_params.top_k"),
    ("/generate", _sp(top_k=2**31), "sampling_params.top_k"),
    ("/generate", _sp(top_k=4097), "sampling_params.top_k"),  # demo vocabulary: 4096
    ("/v1/completions", _cmpl(top_k=2**64), "top_k"),
    ("/generate", _sp(stop_token_ids=[2**64 + 5]), "sampling_params.stop_token_ids.0"),
    ("/generate", _sp(stop_token_ids=[4096]), "sampling_params.stop_token_ids"),
    ("/generate", _sp(temperature=2**64 + 5), "sampling_params.temperature"),
    ("/generate", _sp(seed=2**63), "sampling_params.seed"),
    ("/v1/completions", _cmpl(seed=2**63), "seed"),
    ("/v1/completions", _cmpl(max_tokens=2**70), "max_tokens"),
    ("/generate", json.dumps({"input_ids": [1, 2**64]}), "input_ids.1"),
    ("/generate", json.dumps({"input_ids": [1, 4096]}), "input_ids"),
    ("/generate", '{"text": "hi", "top_logprobs_num": 1' + "0" * 5000 + "}", None),
    # lone surrogates (a 500 and a leaked request each)
    ("/generate", '{"text": "hi", "sampling_params": {"stop": "\\ud800"}}', "sampling_params.stop"),
    ("/v1/completions", '{"model": "tide-demo", "prompt": "hi", "stop": ["ok", "\\udc00"]}',
     "stop.1"),
    ("/generate", '{"text": "\\ud800"}', "text"),
    ("/v1/completions", '{"model": "tide-demo", "prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions",
     '{"model": "tide-demo", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages.0.content"),
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}',
     "sampling_params.temperature"),
    ("/generate", _sp(repetition_penalty=1e-300), "sampling_params.repetition_penalty"),
    ("/v1/completions", _cmpl(repetition_penalty=1e-300), "repetition_penalty"),
    # request ids: logged and echoed, so bounded and printable; unique once expanded for n
    ("/v1/completions", _cmpl(rid="evil\n19:00:00 ERROR forged line"), "rid"),
    ("/generate", json.dumps({"text": ["a", "b"], "rid": ["ok", "x" * 257]}), "rid"),
    ("/abort_request", json.dumps({"rid": "a\u0000b"}), "rid"),
    ("/generate", json.dumps({"text": ["a", "b"], "rid": ["x-0", "x"],
                              "sampling_params": [{"max_new_tokens": 2},
                                                  {"n": 2, "max_new_tokens": 2}]}), "rid"),
    ("/update_weights_from_disk", json.dumps({"model_path": "/x", "weight_version": ""}),
     "weight_version"),
    ("/update_weights_from_disk", json.dumps({"model_path": "/x", "weight_version": "v\n2"}),
     "weight_version"),
    # counts
    ("/v1/completions", _cmpl(n=50000), "n"),
    ("/v1/completions", _cmpl(n=129), "n"),
    ("/v1/completions", _cmpl(prompt=["a", "b", "c"], n=30), "n"),  # 90 sequences > 64
    ("/v1/completions", _cmpl(logprobs=21), "logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=10**30), "top_logprobs"),
    ("/generate", json.dumps({"text": "hi", "top_logprobs_num": 101}), "top_logprobs_num"),
    ("/v1/completions", _cmpl(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("/v1/completions", _cmpl(stop="x" * 1025), "stop"),
    ("/generate", _sp(stop_token_ids=list(range(1025))), "sampling_params.stop_token_ids"),
    ("/generate", json.dumps({"input_ids": [[1, 2]] * (MAX_BATCH + 1)}), "input_ids"),
    ("/generate", json.dumps({"input_ids": [[1, 2]] * 9, "sampling_params": {"n": 8}}),
     "sampling_params"),
    ("/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 4097}),
     "messages"),
    # chat_template_kwargs are template variables, not the render call's own arguments: a client's
    # own template would render with no bound on time or memory
    ("/v1/chat/completions",
     _chat(chat_template_kwargs={"chat_template": "{{ 'x' * 1500000000 }}"}),
     "chat_template_kwargs.chat_template"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"tokenize": True}),
     "chat_template_kwargs.tokenize"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={f"v{i}": 1 for i in range(65)}),
     "chat_template_kwargs"),
    # JSON nested 1,000 deep (2 KB) and just past the bound
    ("/generate", '{"text": ' + "[" * 1000 + "]" * 1000 + "}", None),
    ("/generate", "[" * 1000 + "]" * 1000, None),
    ("/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"x": json.loads("[" * 40 + "]" * 40)}}), None),
    # admin routes (no keys on this server: open to local users)
    ("/update_weights_from_disk", json.dumps({"model_path": "/tmp/a\u0000b"}), "model_path"),
    ("/update_weights_from_distributed",
     '{"names": ["x"], "dtypes": ["float32"], "shapes": [[1' + "0" * 400 + "]]}", "shapes.0.0"),
    ("/update_weights_from_distributed",
     json.dumps({"names": ["x"], "dtypes": ["float32"], "shapes": [[-1]]}), "shapes.0"),
    ("/init_weights_update_group", json.dumps({
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 10**30,
        "world_size": 2}), "rank_offset"),
]


@pytest.mark.parametrize("path,raw,param", BAD, ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(server, path, raw, param):
    resp = _raw_post(server, path, raw)
    assert resp.status_code == 400, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["message"] and err["type"] == "invalid_request_error"
    assert resp.headers.get("connection") != "close"  # a 4xx keeps the connection
    assert _server_info(server)["num_http_requests_in_flight"] == 0  # nothing registered


# Sequences x max new tokens x (1 + top logprobs) past MAX_LOGPROB_ENTRIES, and the param each names.
LOGPROB_HEAVY = [
    ("/generate", {"input_ids": [[5, 6]] * 50, "top_logprobs_num": 100,
                   "sampling_params": {"max_new_tokens": 2}}, "top_logprobs_num"),  # 50*2*101
    ("/generate", {"input_ids": [5, 6], "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 200, "n": 60}}, "return_logprob"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "stream": True,
                   "sampling_params": {"max_new_tokens": 150}}, "return_logprob"),  # 150*151/2
    ("/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 100, "n": 5,
                         "logprobs": 20}, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 100, "n": 10, "logprobs": True, "top_logprobs": 20},
     "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", LOGPROB_HEAVY,
                         ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(LOGPROB_HEAVY)])
def test_logprob_entries_are_bounded_before_queueing(server, path, body, param):
    """Each limit alone allows these; their product (what the HTTP process holds and writes) is
    refused up front, naming the field that asked for logprobs."""
    resp = _raw_post(server, path, json.dumps(body))
    assert resp.status_code == 400, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, "limit_exceeded"), err
    assert str(MAX_LOGPROB_ENTRIES) in err["message"]
    _assert_clean(server)
    # Under the bound the same shape is served, with every entry.
    small = json.loads(json.dumps(body))
    small.pop("stream", None)
    if path == "/generate":
        small["sampling_params"].update(max_new_tokens=3, n=1)
        small["input_ids"] = small["input_ids"][:3] if isinstance(small["input_ids"][0], list) \
            else small["input_ids"]
    else:
        small.update(max_tokens=3, n=1)
    resp = _raw_post(server, path, json.dumps(small))
    assert resp.status_code == 200, resp.text


def test_input_logprob_entries_count_against_the_bound(server):
    """Input logprobs add (prompt length - logprob_start_len) x (1 + top) entries a sequence."""
    body = {"input_ids": [[5] * 400] * 20, "return_logprob": True, "top_logprobs_num": 1,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}  # 20 * 400 * 2
    resp = _raw_post(server, "/generate", json.dumps(body))
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (
        "top_logprobs_num", "limit_exceeded")
    _assert_clean(server)
    body["logprob_start_len"] = 300  # 20 * 100 * 2
    resp = _raw_post(server, "/generate", json.dumps(body))
    assert resp.status_code == 200, resp.text
    assert all(len(o["meta_info"]["input_token_logprobs"]) == 100 for o in resp.json())


def test_millions_of_tiny_lists_are_refused_quickly(server):
    """A body of ~1M empty lists (under the body limit) is a 400 after a bounded walk, and the
    event loop answers others meanwhile, instead of seconds of validation per request."""
    raw = '{"input_ids": [' + ",".join(["[]"] * 1_000_000) + "]}"
    t, cpu = time.monotonic(), server.cpu_seconds()
    resp = _raw_post(server, "/generate", raw)
    took, used = time.monotonic() - t, server.cpu_seconds() - cpu
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_json"
    assert "arrays and objects" in resp.json()["error"]["message"]
    assert used < 1.0 and took < 10, (used, took)  # the server's work; wall time only for a hang
    _assert_clean(server)


@pytest.mark.parametrize("content", [
    {"id": "x", "choices": [{"text": "é\u2028\"", "logprobs": {"top": [{"a": -0.5}, None]}}],
     "usage": {"n": 2**62}, "flags": [True, False, None, 1e300, -0.0]},
    [[{"meta_info": {"output_top_logprobs": [[[-1.25, 7, "ü"]]]}}], []],
    {}, [], "plain", 3, {"choices": [{True: 1, None: [2], 3: "x"}]},
])
def test_large_json_response_has_json_response_bytes(content):
    """Responses with logprobs are encoded a piece at a time (the event loop runs between
    pieces); the bytes are exactly starlette's `JSONResponse`'s."""
    from starlette.responses import JSONResponse

    from tide.server.utils import large_json_response

    resp = large_json_response(content)
    assert resp.body == JSONResponse(content).body
    assert resp.media_type == "application/json"
    with pytest.raises(ValueError):
        large_json_response({"choices": [{"logprob": float("nan")}]})


@pytest.mark.parametrize("shape", ["generate", "generate_batch", "chat"])
def test_large_json_response_encodes_small_pieces(shape, monkeypatch):
    """No single `json.dumps` call (which holds the GIL throughout) encodes more than a small piece
    of a large logprob response, whatever its nesting."""
    from starlette.responses import JSONResponse

    from tide.server import utils

    rows, top = 3000, 50
    out = {"text": "x", "output_ids": list(range(rows)), "meta_info": {
        "id": "a", "output_token_logprobs": [[-0.5, t, "tok"] for t in range(rows)],
        "output_top_logprobs": [[[-1.25, t, "w"] for t in range(top)] for _ in range(rows)]}}
    content = {"generate": out, "generate_batch": [out, out], "chat": {"id": "c", "choices": [{
        "index": 0, "logprobs": {"content": [
            {"token": "a", "logprob": -0.1, "bytes": [97],
             "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": [98]}] * 20}] * rows}}]}}[shape]
    sizes: list[int] = []
    dumps = utils._dumps

    def recording(value):
        encoded = dumps(value)
        sizes.append(len(encoded))
        return encoded

    monkeypatch.setattr(utils, "_dumps", recording)
    body = utils.large_json_response(content).body
    assert body == JSONResponse(content).body
    assert len(body) > 2_000_000 and max(sizes) < 100_000, (len(body), max(sizes))


def test_a_client_gone_before_its_body_is_a_quiet_499():
    """`read_body`: a disconnect while the body streams in is the client's doing: a 499 with no
    traceback, not the last-resort 500 of a bug."""
    import asyncio

    from starlette.requests import ClientDisconnect

    from tide.server.errors import APIError
    from tide.server.utils import read_body

    class Gone:
        async def body(self) -> bytes:
            raise ClientDisconnect()

    with pytest.raises(APIError) as caught:
        asyncio.run(read_body(Gone()))  # type: ignore[arg-type]
    assert (caught.value.status_code, caught.value.code) == (499, "client_closed_request")


def test_chat_template_variables_still_reach_the_template(server):
    resp = _raw_post(server, "/v1/chat/completions",
                     _chat(chat_template_kwargs={"enable_thinking": False, "x": [1, 2]}))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 8}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 8}),
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 8}}),
])
def test_concurrent_streams_with_one_rid_get_one_stream_and_400s(server, path, body):
    """A stream submits once its response starts: its rid is reserved when checked, so concurrent
    requests with the same rid get a 400 before any response starts, never a 200 carrying only an
    error event; once the stream ended the rid is free again."""
    import asyncio

    body = {**body, "stream": True, "rid": f"same-{path.rsplit('/', 1)[-1]}"}

    async def one(client: httpx.AsyncClient) -> tuple[int, str]:
        async with client.stream("POST", path, json=body) as resp:
            return resp.status_code, (await resp.aread()).decode()

    async def race() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*[one(client) for _ in range(4)])

    results = asyncio.run(race())
    # Which requests overlap depends on timing (a finished stream frees its rid), but every one is
    # either a whole stream or a 400 before the response started.
    assert 200 in [code for code, _ in results], results
    for code, text in results:
        if code == 200:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text
        else:
            assert json.loads(text)["error"]["code"] == "duplicate_rid", text


    async def alone() -> tuple[int, str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await one(client)

    assert asyncio.run(alone())[0] == 200  # the rid was released: usable again
    _assert_clean(server)


def test_a_checked_rid_is_reserved_until_released():
    """The window between a stream's rid check and its submit: a reserved rid is taken for
    everyone else (same owner), free for other owners, and free again once released."""
    from tide.server.errors import APIError
    from tide.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager.__new__(TokenizerManager)  # only the rid bookkeeping is exercised
    tm.rid_to_state, tm._reserved = {}, {}
    keys = tm.check_rids_free(["a", "b"], "alice", reserve=True)
    for rid in ("a", "b"):
        with pytest.raises(APIError, match="already in use"):
            tm.check_rids_free([rid], "alice")
    assert tm.check_rids_free(["a"], "bob") == []  # rids are scoped by owner
    tm.release_rids(keys)
    assert tm.check_rids_free(["a", "b"], "alice", reserve=True) == [("alice", "a"),
                                                                       ("alice", "b")]


def test_nothing_leaks_after_failed_requests(server):
    """Each of these used to be a 500 that left its request registered forever (and its rid
    blocked): now they are 400s, and the rid is free again at once."""
    bodies = [
        {"text": "hi", "rid": "reuse-me", "sampling_params": {"top_k": 2**64 + 5}},
        {"text": "hi", "rid": "reuse-me", "sampling_params": {"stop_token_ids": [2**64]}},
        {"text": "hi", "rid": "reuse-me", "sampling_params": {"temperature": 2**64 + 5}},
    ]
    raws = [json.dumps(b) for b in bodies]
    raws.append('{"text": "hi", "rid": "reuse-me", "sampling_params": {"stop": "\\ud800"}}')
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Content-Type": "application/json"}) as http:
        for _ in range(50):
            for raw in raws:
                resp = http.post("/generate", content=raw)
                assert resp.status_code == 400, resp.text
        ok = http.post("/generate", content=json.dumps(
            {"text": "hi", "rid": "reuse-me", "sampling_params": {"max_new_tokens": 2}}))
        assert ok.status_code == 200, ok.text
        assert ok.json()["meta_info"]["id"] == "reuse-me"
    _assert_clean(server)


def test_temperature_below_epsilon_is_greedy(server):
    body = {"input_ids": [11, 12, 13, 14], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    greedy = server.post("/generate", {**body, "sampling_params": {
        **body["sampling_params"], "temperature": 0.0}}).json()
    for temp in (1e-300, 5e-324, 1e-6):
        out = server.post("/generate", {**body, "sampling_params": {
            **body["sampling_params"], "temperature": temp}})
        assert out.status_code == 200, out.text
        out = out.json()
        assert out["output_ids"] == greedy["output_ids"], temp
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = [lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(expected, abs=1e-4)
        assert all(-50.0 < lp <= 0.0 for lp in logprobs)


def test_bad_top_k_never_hurts_its_batch(server):
    """Six innocent streams and bad-top_k requests sent together: the bad ones are refused alone and
    every innocent stream ends with all its tokens."""
    max_new = 24
    results: list[tuple[int, int, str | None]] = []
    bad_status: list[int] = []

    def innocent(i: int) -> None:
        body = {"input_ids": [20 + i, 21, 22], "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                    "temperature": 0.8, "top_k": 40, "seed": i}}
        last = None
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        results.append((resp.status_code, len(last["output_ids"]),
                        last["meta_info"]["finish_reason"]["type"]))

    def bad(top_k: int) -> None:
        body = {"input_ids": [30, 31, 32], "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0.8, "top_k": top_k}}
        bad_status.append(server.post("/generate", body).status_code)

    threads = [threading.Thread(target=innocent, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=bad, args=(k,)) for k in (2**63 + 5, 2**64 - 1, 10**6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == [(200, max_new, "length")] * 6
    assert bad_status == [400, 400, 400]
    _assert_clean(server)


# ---------------------------------------------------------------- bodies: size and arrival time
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def _http_exchange(server: ServerProcess, head: bytes, body: bytes = b"",
                   timeout: float = 10.0) -> tuple[bytes, float, bool]:
    """Send raw bytes; return (response bytes up to the first body, seconds to the answer, whether
    the server then closed the connection)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        start = time.monotonic()
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - start
        sock.settimeout(1.0)
        try:
            closed = sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed = False
    return data, elapsed, closed


def _closed_after(sock: socket.socket, trickle: bytes | None, limit: float,
                  start: float | None = None) -> float:
    """Seconds until the server closes `sock` (recv gives b""), sending `trickle` every 0.3 s;
    counted from `start` (a `time.monotonic()`; by default now)."""
    start = time.monotonic() if start is None else start
    sock.settimeout(0.3)
    while time.monotonic() - start < limit:
        try:
            if sock.recv(1) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if trickle is not None:
            try:
                sock.sendall(trickle)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
    raise AssertionError(f"the connection was still open after {limit} s")


def test_slow_request_headers_lose_their_connection(server):
    """A connection that sends nothing, or a request whose header lines trickle in, is closed once
    its headers are HEADER_READ_TIMEOUT late; the server answers others meanwhile, and a kept-alive
    connection that sends its next request on time is served."""
    opened = time.monotonic()  # the server's clock for `idle` starts at most this late
    idle = socket.create_connection(("127.0.0.1", server.port))
    slow = socket.create_connection(("127.0.0.1", server.port))
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert server.get("/health").status_code == 200
        assert HEADER_READ_TIMEOUT - 0.05 < _closed_after(idle, None, 15, opened) \
            < HEADER_READ_TIMEOUT + 3
        assert _closed_after(slow, b"X-Slow: 1\r\n", 15) < HEADER_READ_TIMEOUT + 3
    finally:
        idle.close()
        slow.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(3):  # the third request starts over 2 s after the connection opened
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(1.0)
    # After a response the next request's headers are due within the deadline too: bytes that
    # start no request (blank lines; the rest of a body the route never read) do not hold it.
    for first, trickle in ((b"", b"\r\n"),
                           (b"Content-Length: 1000000\r\n", b"x" * 10)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + first + b"\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            assert _closed_after(sock, trickle, 15) < HEADER_READ_TIMEOUT + 3
    _assert_clean(server)


def test_declared_oversized_body_refused_before_reading(server):
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    data, elapsed, closed = _http_exchange(server, head)  # not a byte of the body sent
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"connection: close" in data.lower() and closed  # the body is never read
    assert elapsed < BODY_READ_TIMEOUT, elapsed  # answered at once, not after the read timeout
    err = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_too_large" and "8388608" in err["message"]
    _assert_clean(server)


def test_half_sent_upload_gets_408(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    data, elapsed, closed = _http_exchange(server, head, b'{"model": "tide-demo", ')
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert BODY_READ_TIMEOUT - 0.5 < elapsed < BODY_READ_TIMEOUT + 3, elapsed
    assert b"connection: close" in data.lower() and closed
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    _assert_clean(server)


def test_200mb_body_refused_while_others_stream(server):
    """A 200 MB body (declared), then a 32 MB one (chunked), are answered 413 while two streams go
    on; the server never holds them: its resident memory grows by at most a few tens of MB."""
    pid = server.proc.pid
    base = _rss_mb(pid)
    peak = [base]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            time.sleep(0.02)

    streamed: list[int] = []

    def stream(i: int) -> None:
        body = {"input_ids": [40 + i, 41], "stream": True,
                "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
        last = None
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        streamed.append(len(last["output_ids"]))

    payload = b'{"text": "' + b"a" * 200_000_000 + b'"}'

    def chunks():  # no Content-Length: refused once 8 MiB have arrived
        for start in range(0, 32 << 20, 1 << 20):
            yield payload[start:start + (1 << 20)]

    threads = [threading.Thread(target=watch)] + [
        threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120,
                          headers={"Content-Type": "application/json"}) as http:
            for content in (payload, chunks()):
                # The server answers 413 and closes without reading the rest; a client still
                # writing then sees the connection closed instead of the answer.
                try:
                    assert_error(http.post("/generate", content=content), 413)
                except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
                    pass
            assert http.get("/health").status_code == 200
    finally:
        for t in threads[1:]:
            t.join(120)
        stop.set()
        threads[0].join()
    assert streamed == [48, 48]
    assert peak[0] - base < 48, (base, peak[0])
    _assert_clean(server)


def test_weight_payload_routes_take_larger_bodies(server):
    """A 9 MiB body is over the generation limit but under the weight-payload one: it is read and
    refused for what it holds, not for its size."""
    payload = json.dumps({"serialized_named_tensors": "A" * (9 << 20)})
    resp = _raw_post(server, "/update_weights_from_tensor", payload)
    assert 400 <= resp.status_code < 500 and resp.status_code != 413, resp.text[:300]
    try:
        assert_error(_raw_post(server, "/generate", json.dumps({"text": "A" * (9 << 20)})), 413)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # answered 413 and closed before the client finished writing
    _assert_clean(server)


# ---------------------------------------------------------------- prompts: bound and tokenization
def test_prompt_over_the_character_bound_is_refused_untokenized(server, info):
    """A 6 MB prompt (tokenizing it would take seconds and about a GB) is refused at once."""
    limit = info["context_length"] * CHARS_PER_TOKEN
    start, cpu = time.monotonic(), server.cpu_seconds()
    resp = server.post("/generate", {"text": "b" * 6_000_000})
    err = assert_error(resp, 400, "text")
    assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]
    used, took = server.cpu_seconds() - cpu, time.monotonic() - start
    assert used < 3.0 and took < 30, (used, took)
    err = assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": ["ok", "b" * (
        limit + 1)]}), 400, "prompt.1")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "b" * (limit + 1)}]}),
        400, "messages")
    assert err["code"] == "context_length_exceeded"
    _assert_clean(server)


def test_long_prompt_does_not_stall_health(server, info):
    """A prompt of several hundred thousand characters (under the bound, over the context) is
    tokenized off the event loop: /health keeps answering in well under a second meanwhile."""
    text = ("The quick brown fox jumps over the lazy dog. " * 20000)[:450_000]
    assert len(text) <= info["context_length"] * CHARS_PER_TOKEN
    latencies: list[float] = []
    result: list[httpx.Response] = []
    done = threading.Event()

    def big() -> None:
        result.append(server.post("/generate", {"text": text}, timeout=120))
        done.set()

    thread = threading.Thread(target=big)
    # The probing client is made (and connected) before the long request starts, so probing
    # covers all of it however slowly a client starts.
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        started = time.monotonic()
        thread.start()
        while not done.is_set():
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.005)
    thread.join()
    took = time.monotonic() - started
    err = assert_error(result[0], 400, "text")
    assert err["code"] == "context_length_exceeded"
    # The probes overlapped it (each ran before it answered); its duration varies with the machine.
    assert len(latencies) >= 5, (took, len(latencies))
    assert max(latencies) < 1.0, max(latencies)


# ---------------------------------------------------------------- a stalled scheduler
def _scheduler_pid(server: ServerProcess) -> int:
    """The server's multiprocessing-spawned child (its other child is the resource tracker)."""
    pid = server.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    spawned = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.append(child)
    assert len(spawned) == 1, children
    return spawned[0]


def test_server_info_with_stalled_scheduler_is_503(server):
    pid = _scheduler_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        resp = server.get("/get_server_info", timeout=30)
        elapsed = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    err = assert_error(resp, 503)
    assert err["code"] == "scheduler_timeout" and elapsed < 15
    _assert_clean(server)


# ---------------------------------------------------------------- in-process pieces
def test_last_resort_500_closes_the_connection():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from tide.server.http_server import InternalErrorMiddleware

    async def boom(request):
        raise RuntimeError("bug")

    async def fine(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/boom", boom), Route("/fine", fine)])
    app.add_middleware(InternalErrorMiddleware)
    with TestClient(app, raise_server_exceptions=True) as client:
        resp = client.get("/boom")
        assert resp.status_code == 500
        assert resp.headers["connection"] == "close"
        assert resp.json()["error"]["code"] == "internal_error"
        assert "RuntimeError" in resp.json()["error"]["message"]
        assert client.get("/fine").text == "ok"


def test_request_limits_are_validated():
    limits = RequestLimits()
    assert limits.body_limit("/generate") == 8 << 20
    assert limits.body_limit("/update_weights_from_tensor") == 1 << 30
    assert limits.max_prompt_chars(512) == 512 * 32
    for bad in ({"max_request_body_bytes": 0}, {"body_read_timeout": 0},
                {"header_read_timeout": -1}, {"max_n": -1}, {"tokenizer_threads": 1.5}, {"max_json_depth": True},
                {"max_logprob_entries": 0}, {"max_json_containers": 2.0}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            RequestLimits(**bad)


@pytest.mark.parametrize("params,field", [
    ({"top_k": 2**63 + 5}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"max_new_tokens": 2**63}, "max_new_tokens"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": 10**400}, "top_p"),
    ({"seed": 2**63}, "seed"),
    ({"stop": "a\ud800"}, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
])
def test_sampling_params_ranges(params, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**params)


def test_sampling_params_tiny_temperature_is_greedy():
    sp = SamplingParams(temperature=1e-300)
    assert sp.temperature == 0.0 and sp.is_greedy
    assert SamplingParams(temperature=2).temperature == 2.0
    assert isinstance(SamplingParams(temperature=2**64 + 5).temperature, float)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=513).check_vocab(512)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1, 512]).check_vocab(512)
    SamplingParams(top_k=512, stop_token_ids=[511]).check_vocab(512)


def test_sampling_failure_is_isolated_to_its_request(llama_engine):
    """A request whose sampling setup fails inside the sampler (parameters that got past
    validation) is aborted alone; the six requests prefilled in the same batch finish normally."""
    from tide.scheduler.request import Req

    sched = llama_engine.scheduler
    assert not sched.has_work()
    max_new = 5
    innocent = [Req(rid=f"ok-{i}", origin_input_ids=[3 + i, 4, 5, 6],
                    sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.7,
                                                   top_k=20, seed=i, ignore_eos=True))
                for i in range(6)]
    bad_params = SamplingParams(max_new_tokens=max_new, temperature=0.7, ignore_eos=True)
    bad_params.top_k = 2**63 + 5  # past validation: overflows when the sampler builds its tensor
    bad = Req(rid="bad", origin_input_ids=[9, 9, 9], sampling_params=bad_params)
    reqs = [*innocent[:3], bad, *innocent[3:]]
    for req in reqs:
        sched.add_request(req)
    first = sched.step()
    assert set(first) == set(reqs), "all seven were not prefilled in one batch"
    while sched.has_work():
        sched.step()
    assert bad.finished_reason["type"] == "abort"
    assert "sampling failed" in bad.finished_reason["message"] and bad.output_ids == []
    for req in innocent:
        assert req.finished_reason == {"type": "length", "length": max_new}, req.finished_reason
        assert len(req.output_ids) == max_new
    sched.check_invariants()
    assert sched.num_running() == 0
