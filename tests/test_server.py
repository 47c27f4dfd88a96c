"""`tide serve` end to end: one real server subprocess for the module, reached over HTTP.

Covers the issue's acceptance list: the official `openai` client (completions, chat, streaming, n > 1,
logprobs, usage), `/generate` parity with `Engine.generate`, 64 concurrent streams plus 16 clients that
disconnect (no KV held afterwards), bad input (status + OpenAI error body naming the field, server stays
up), `/metrics` parsing and counters, admin/native routes.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
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

MAX = 12  # small max_tokens keeps the module fast on a shared CPU


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return serve_model_path(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running_server(model_path, "--served-model-name", "tide-test",
                        log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(model_path):
    import tide

    eng = tide.Engine(str(model_path))
    yield eng
    eng.shutdown()


def _load(server: ServerProcess) -> dict:
    return server.get("/get_server_info").json()


def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _load(server)
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {info}")
        time.sleep(0.05)


def _sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _logprob_values(entries) -> list[float]:
    """The float logprobs in `/generate`'s logprob lists (entries `[logprob, id, text]`, nested
    per position for top logprobs), in order."""
    if isinstance(entries, list) and entries and isinstance(entries[0], float):
        return [entries[0]]
    return [v for e in (entries or []) for v in _logprob_values(e)]


def _logprob_tokens(entries) -> list:
    """The same lists with each logprob value dropped: ids and texts, in order."""
    if isinstance(entries, list) and entries and isinstance(entries[0], float):
        return [entries[1:]]
    return [t for e in (entries or []) for t in _logprob_tokens(e)]


PROMPTS = ["The quick brown fox", "Python is a programming", "In the beginning was"]


# ---------------------------------------------------------------- OpenAI client (acceptance 1)
def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tide-test"]


def test_completion_and_stream_match(client):
    full = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=MAX,
                                     temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=MAX,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == choice.text
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_usage_with_n_counts_each_prompt_once(client, engine):
    """OpenAI's semantics for n > 1: the prompt is billed once per prompt, every choice's output
    counts, and cached_tokens (a part of prompt_tokens) never exceeds it."""
    prompt = PROMPTS[0] + " and n"
    n_prompt = len(engine.tokenizer.encode(prompt))
    for _ in range(2):  # the second request finds the prompt in the radix cache
        out = client.completions.create(model="tide-test", prompt=prompt, max_tokens=3, n=3,
                                        temperature=1.0, seed=5, extra_body={"ignore_eos": True})
        usage = out.usage
        assert usage.prompt_tokens == n_prompt
        assert usage.completion_tokens == 3 * 3
        assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chat = client.chat.completions.create(model="tide-test", n=3, max_tokens=2, seed=1,
                                          messages=[{"role": "user", "content": prompt}])
    chat_again = client.chat.completions.create(model="tide-test", n=3, max_tokens=2, seed=1,
                                                messages=[{"role": "user", "content": prompt}])
    assert chat.usage.prompt_tokens == chat_again.usage.prompt_tokens
    assert 0 < chat_again.usage.prompt_tokens_details.cached_tokens <= chat_again.usage.prompt_tokens


def test_completion_stream_has_final_usage_without_stream_options(client):
    stream = client.completions.create(model="tide-test", prompt=PROMPTS[1], max_tokens=4,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert all(len(c.choices) == 1 for c in chunks)  # `chunk.choices[0]` loops keep working
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_chat_and_stream_match(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="tide-test", messages=messages, max_tokens=MAX,
                                          temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert full.usage.completion_tokens >= 1

    stream = client.chat.completions.create(model="tide-test", messages=messages,
                                            max_tokens=MAX, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, roles, finish, usage = "", [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert roles == ["assistant"]
    assert text == msg.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_tools_with_tool_choice_none_are_left_out(client):
    """A server without --tool-call-parser takes `tools` with tool_choice 'none': they are not
    rendered (the same prompt and reply as without them), and the reply is plain content."""
    messages = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model="tide-test", messages=messages, max_tokens=MAX,
                                           temperature=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    none = client.chat.completions.create(model="tide-test", messages=messages, max_tokens=MAX,
                                          temperature=0, tools=tools, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert "reasoning_content" not in none.choices[0].message.model_extra


def test_logit_bias_reaches_the_sampler(client, server, model_path):
    """Banning the greedy reply's first tokens (OpenAI's -100) changes the reply and none of them
    appears; +100 all but forces a token; /generate, completions and chat alike."""
    from transformers import AutoTokenizer

    def generate(**params) -> dict:
        return server.post("/generate", {"text": PROMPTS[0], "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX, "ignore_eos": True, **params}}).json()

    plain = generate()["output_ids"]
    bias = {str(t): -100 for t in plain[:3]}
    banned = generate(logit_bias=bias)
    assert banned["output_ids"] != plain and not set(plain[:3]) & set(banned["output_ids"])
    out = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=MAX,
                                    temperature=0, logit_bias=bias, extra_body={"ignore_eos": True})
    assert out.choices[0].text == banned["text"]
    forced = plain[0]
    chat = client.chat.completions.create(
        model="tide-test", messages=[{"role": "user", "content": "Hello"}], max_tokens=MAX,
        temperature=0, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    tok = AutoTokenizer.from_pretrained(model_path)
    assert chat.choices[0].message.content == tok.decode([forced] * MAX)


def test_parse_routes_need_a_parser_named_when_the_server_has_none(server):
    err = assert_error(server.post("/parse_function_call", {"text": "x"}), 400,
                       "tool_call_parser")
    assert "--tool-call-parser" in err["message"]
    assert_error(server.post("/separate_reasoning", {"text": "x"}), 400, "reasoning_parser")
    out = server.post("/separate_reasoning", {"text": "<think>a</think>b",
                                              "reasoning_parser": "qwen3"})
    assert out.json() == {"text": "b", "reasoning_text": "a"}


def test_chat_without_include_usage_sends_no_usage_chunk(client):
    stream = client.chat.completions.create(
        model="tide-test", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, stream=True)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)


def test_n_greater_than_one(client):
    out = client.completions.create(model="tide-test", prompt=PROMPTS[2], max_tokens=6,
                                    temperature=1.0, n=3, seed=5)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    again = client.completions.create(model="tide-test", prompt=PROMPTS[2], max_tokens=6,
                                      temperature=1.0, n=3, seed=5)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert out.usage.completion_tokens == 3 * 6 or any(c.finish_reason == "stop"
                                                       for c in out.choices)

    chat = client.chat.completions.create(
        model="tide-test", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
        temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_n_streamed_with_multiple_prompts(client):
    stream = client.completions.create(model="tide-test", prompt=PROMPTS[:2], max_tokens=4,
                                       temperature=0, n=2, stream=True)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy copies agree


@pytest.mark.parametrize("echo", [False, True])
def test_completion_text_offsets_point_into_the_text_streamed_or_not(client, echo):
    """Each token's text_offset is where its text starts in the returned text (a special token
    the text leaves out takes no room), and a stream gives the same offsets: it computed them from
    the text sent so far, which lags while a possible stop string is held back."""
    base = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=6,
                                     temperature=0, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    kwargs = dict(model="tide-test", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                  logprobs=0, echo=echo, stop=[first + "QQQ"])  # holds the first token back
    out = client.completions.create(**kwargs)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    special = {"<|begin_of_text|>", "<s>", "<|endoftext|>"}
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        if tok not in special and "\ufffd" not in tok:
            assert text[off:off + len(tok)] == tok, (tok, off, text)
    streamed: list[int] = []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs:
                streamed += c.logprobs.text_offset
    assert streamed == lp.text_offset


def test_completion_logprobs(client):
    out = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=5,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=False):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert abs(max(top.values()) - chosen) < 1e-5


def test_completion_echo(client, server):
    out = client.completions.create(model="tide-test", prompt=PROMPTS[1], max_tokens=3,
                                    temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(model="tide-test", prompt=PROMPTS[1], max_tokens=3,
                                      temperature=0)
    assert out.choices[0].text == PROMPTS[1] + plain.choices[0].text
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    # The prompt is scored (OpenAI's legacy echo): its logprobs are /generate's input logprobs.
    native = server.post("/generate", {"text": PROMPTS[1], "return_logprob": True,
                                       "top_logprobs_num": 1, "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 0}}).json()
    scored = native["meta_info"]["input_token_logprobs"]
    prompt_tokens = out.usage.prompt_tokens
    assert len(scored) == prompt_tokens
    got = lp.token_logprobs[1:prompt_tokens]
    assert all(abs(g - e[0]) < 1e-4 for g, e in zip(got, scored[1:], strict=True))
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    # Streamed, the echoed prompt (sent once prefilled) carries the same logprobs.
    streamed = [c for chunk in client.completions.create(
        model="tide-test", prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=1,
        stream=True) for c in chunk.choices]
    assert streamed[0].text == PROMPTS[1]
    assert streamed[0].logprobs.token_logprobs == lp.token_logprobs[:prompt_tokens]
    # max_tokens=0 with echo scores a text (the legacy scoring idiom).
    only = client.completions.create(model="tide-test", prompt=PROMPTS[1], max_tokens=0,
                                     temperature=0, echo=True, logprobs=0)
    assert only.choices[0].text == PROMPTS[1] and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:prompt_tokens]


def test_token_id_prompts(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model="tide-test", prompt=ids, max_tokens=5,
                                       temperature=0)
    by_text = client.completions.create(model="tide-test", prompt=PROMPTS[0], max_tokens=5,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tide-test", prompt=[ids, ids[:2]], max_tokens=3,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text.startswith(by_text.choices[0].text[:1])


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="tide-test", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 2
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-5
        assert isinstance(item.bytes, list)


def test_stop_string_never_streamed_past(client):
    prompt = PROMPTS[1]
    ref = client.completions.create(model="tide-test", prompt=prompt, max_tokens=24,
                                    temperature=0).choices[0].text
    assert len(ref) >= 6, ref
    stop = ref[3:6]
    expected = ref[: ref.index(stop)]
    full = client.completions.create(model="tide-test", prompt=prompt, max_tokens=24,
                                     temperature=0, stop=[stop, "never-appears"])
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    text = ""
    for chunk in client.completions.create(model="tide-test", prompt=prompt, max_tokens=24,
                                           temperature=0, stop=stop, stream=True):
        for c in chunk.choices:
            text += c.text
            assert stop not in text and expected.startswith(text)
    assert text == expected


# ---------------------------------------------------------------- /generate parity (acceptance 2)
def test_generate_matches_engine(server, engine):
    params = {"max_new_tokens": MAX, "temperature": 0, "ignore_eos": True}
    ref = engine.generate(prompt=PROMPTS, sampling_params=params)
    single = server.post("/generate", {"text": PROMPTS[0], "sampling_params": params}).json()
    assert single["output_ids"] == ref[0]["output_ids"]
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": MAX}
    assert single["meta_info"]["completion_tokens"] == MAX
    assert single["text"] == ref[0]["text"]

    batch = server.post("/generate", {"text": PROMPTS, "sampling_params": params}).json()
    assert [b["output_ids"] for b in batch] == [r["output_ids"] for r in ref]

    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    by_ids = server.post("/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert [b["output_ids"] for b in by_ids] == [r["output_ids"] for r in ref]

    for _ in range(5):  # a fast machine may finish between two turns of the stream's loop
        resp = server.post("/generate", {"text": PROMPTS[1], "sampling_params": params,
                                         "stream": True})
        events = _sse_events(resp.text)
        if len(events) >= 3:
            break
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["output_ids"] == ref[1]["output_ids"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative text grows
    assert len(events) >= 3  # really streamed, token by token

    resp = server.post("/generate", {"text": PROMPTS, "sampling_params": params, "stream": True})
    final = {e["index"]: e for e in _sse_events(resp.text)[:-1]}
    assert [final[i]["output_ids"] for i in range(len(PROMPTS))] == [r["output_ids"] for r in ref]


def test_generate_logprobs_match_engine(server, engine):
    params = {"max_new_tokens": 5, "temperature": 0}
    ref = engine.generate(prompt=PROMPTS[2], sampling_params=params, return_logprob=True,
                          top_logprobs_num=2)
    out = server.post("/generate", {"text": PROMPTS[2], "sampling_params": params,
                                    "return_logprob": True, "top_logprobs_num": 2,
                                    "return_text_in_logprobs": True}).json()
    got = out["meta_info"]["output_token_logprobs"]
    exp = ref["meta_info"]["output_token_logprobs"]
    assert [g[1] for g in got] == [e[1] for e in exp]
    assert all(abs(g[0] - e[0]) < 1e-4 for g, e in zip(got, exp, strict=False))
    assert all(isinstance(g[2], str) for g in got)
    assert len(out["meta_info"]["output_top_logprobs"]) == len(got)


def test_generate_input_logprobs_match_engine(server, engine):
    params = {"max_new_tokens": 3, "temperature": 0}
    ids = engine.tokenizer.encode(PROMPTS[1])
    ref = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                          top_logprobs_num=2, logprob_start_len=0)["meta_info"]
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}
    meta = server.post("/generate", body).json()["meta_info"]
    got, exp = meta["input_token_logprobs"], ref["input_token_logprobs"]
    assert [g[1] for g in got] == ids == [e[1] for e in exp]
    assert got[0][0] is None and exp[0][0] is None
    assert all(abs(g[0] - e[0]) < 1e-4 for g, e in zip(got[1:], exp[1:], strict=True))
    assert all(isinstance(g[2], str) for g in got)
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(ids)
    assert [[t[1] for t in row] for row in tops[1:]] == [
        [t for _, t in row] for row in ref["input_top_logprobs"][1:]]
    # A stream carries them once, in its last event; max_new_tokens = 0 only scores.
    events = [e for e in _sse_events(server.post("/generate", {**body, "stream": True}).text)
              if e != "[DONE]"]
    assert [("input_token_logprobs" in e["meta_info"]) for e in events] == [False] * (
        len(events) - 1) + [True]
    assert events[-1]["meta_info"]["input_token_logprobs"] == got
    scored = server.post("/generate", {**body, "sampling_params": {"max_new_tokens": 0},
                                       "logprob_start_len": 2}).json()
    assert scored["output_ids"] == []
    # Scored from position 2, the prompt's first token comes from the prefix cache, so the prefill
    # runs another shape: ids and texts exactly, logprob values to float noise.
    entries = scored["meta_info"]["input_token_logprobs"]
    assert _logprob_tokens(entries) == _logprob_tokens(got[2:])
    assert _logprob_values(entries) == pytest.approx(_logprob_values(got[2:]), abs=1e-4)
    bad = server.post("/generate", {**body, "logprob_start_len": -2})
    assert_error(bad, 400, "logprob_start_len")
    past = server.post("/generate", {**body, "logprob_start_len": 10**12})  # past the prompt
    assert past.status_code == 200 and "input_token_logprobs" not in past.json()["meta_info"]
    assert_error(server.post("/generate", {**body, "logprob_start_len": 10**24}), 400,
                 "logprob_start_len")


def test_generate_n_and_rid(server):
    out = server.post("/generate", {"text": PROMPTS[0], "rid": "my-rid",
                                    "sampling_params": {"max_new_tokens": 3, "n": 2,
                                                        "temperature": 0}}).json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["my-rid-0", "my-rid-1"]
    one = server.post("/generate", {"text": PROMPTS[0], "rid": "solo",
                                    "sampling_params": {"max_new_tokens": 2}}).json()
    assert one["meta_info"]["id"] == "solo"


def test_max_new_tokens_zero(server):
    out = server.post("/generate", {"text": PROMPTS[0],
                                    "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


# ---------------------------------------------------------------- concurrency (acceptance 3)
def test_concurrent_streams_and_disconnects(server, engine):
    prompts = PROMPTS + ["Hello world"]
    params = {"max_new_tokens": MAX, "temperature": 0, "ignore_eos": True}
    refs = {p: r["output_ids"] for p, r in
            zip(prompts, engine.generate(prompt=prompts, sampling_params=params), strict=False)}
    before = _metric_values(server)

    async def full_stream(http: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"text": prompt, "sampling_params": params, "stream": True}
        last = None
        async with http.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        assert last is not None and last["meta_info"]["finish_reason"]["type"] == "length"
        return last["output_ids"]

    async def quitter(http: httpx.AsyncClient, prompt: str) -> int:
        body = {"model": "tide-test", "prompt": prompt, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= 2:
                        break  # leave mid-stream: closing the response drops the connection
        return seen

    async def main() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            full = [full_stream(http, prompts[i % len(prompts)]) for i in range(64)]
            quit_ = [quitter(http, prompts[i % len(prompts)]) for i in range(16)]
            results = await asyncio.gather(*full, *quit_)
        return results[:64], results[64:]

    full_results, quit_results = asyncio.run(main())
    for i, ids in enumerate(full_results):
        assert ids == refs[prompts[i % len(prompts)]], i
    assert all(q >= 2 for q in quit_results)

    info = _wait_idle(server)
    assert info["kv_held_slots"] == 0, info
    assert info["invariants_ok"]
    assert info["kv_free_slots"] + info["kv_cached_slots"] == info["max_total_tokens"]
    assert info["num_http_requests_in_flight"] == 0
    after = _metric_values(server)
    aborted = _delta(before, after, "tide:num_requests_total", finish_reason="abort")
    assert aborted == 16
    # the quitters were stopped early: far fewer than 16 * 400 tokens were generated for them
    generated = _delta(before, after, "tide:generation_tokens_total")
    assert generated < 64 * MAX + 16 * 400 / 2

    # flushing now frees everything the radix cache kept
    assert server.post("/flush_cache").status_code == 200
    info = _load(server)
    assert info["kv_free_slots"] == info["max_total_tokens"]


def test_abort_request_route(server):
    async def run() -> list[dict]:
        body = {"text": PROMPTS[0], "rid": "to-abort", "stream": True,
                "sampling_params": {"max_new_tokens": 480, "ignore_eos": True, "n": 8}}
        last: dict[int, dict] = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/generate", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if not last:
                            r = await http.post("/abort_request", json={"rid": "to-abort"})
                            assert r.status_code == 200 and r.json()["num_aborted"] == 8
                            # the reply comes after the aborts landed: nothing runs any more
                            info = (await http.get("/get_server_info")).json()
                            assert info["num_running_reqs"] == 0
                            assert info["num_http_requests_in_flight"] == 0
                        last[event["index"]] = event
        return [last[i] for i in sorted(last)]

    outs = asyncio.run(run())
    assert len(outs) == 8
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["completion_tokens"] < 480
    assert _wait_idle(server)["kv_held_slots"] == 0
    r = server.post("/abort_request", {"rid": "no-such-request"})
    assert r.status_code == 200 and r.json()["num_aborted"] == 0


def test_non_streaming_client_disconnect_aborts(server):
    """A non-streaming client that times out (goes away) gets its request aborted."""
    before = _metric_values(server)
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 480, "ignore_eos": True,
                                                    "n": 8}}
    with pytest.raises(httpx.TimeoutException):
        server.post("/generate", body, timeout=0.2)
    deadline = time.monotonic() + 30
    while True:
        aborted = _delta(before, _metric_values(server), "tide:num_requests_total",
                         finish_reason="abort")
        finished = _delta(before, _metric_values(server), "tide:num_requests_total",
                          finish_reason="length")
        if aborted + finished >= 8:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert aborted == 8, (aborted, finished)
    assert _wait_idle(server)["kv_held_slots"] == 0


# ---------------------------------------------------------------- bad input (acceptance 4)
def _raw_post(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json"})


BAD_COMPLETIONS = [
    ({"model": "tide-test", "prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ({"model": "tide-test", "prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": "tide-test", "prompt": 123}, 400, "prompt"),
    ({"model": "tide-test", "prompt": [1.5, 2]}, 400, "prompt"),
    ({"model": "tide-test", "prompt": "hi", "n": 1.5}, 400, "n"),
    ({"model": "tide-test", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "tide-test", "prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ({"model": "tide-test", "prompt": "hi", "temperature": 3.0}, 400, "temperature"),
    ({"model": "tide-test", "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"model": "tide-test", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tide-test", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "tide-test", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tide-test", "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"model": "tide-test", "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": "tide-test", "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"model": "tide-test", "prompt": "hi", "top_k": 0}, 400, "top_k"),
    ({"model": "tide-test", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"model": "tide-test", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": "tide-test", "prompt": ""}, 400, "prompt"),
    ({"model": "tide-test", "prompt": []}, 400, "prompt"),
    ({"model": "tide-test", "prompt": [[]]}, 400, "prompt.0"),
    ({"model": "tide-test", "prompt": [10**9]}, 400, "prompt"),
    ({"model": "tide-test", "prompt": "hi " * 2000}, 400, "prompt"),
    ({"model": "tide-test", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "tide-test", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "tide-test", "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "tide-test", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "tide-test", "prompt": "hi", "logit_bias": {"5": "1"}}, 400, "logit_bias.5"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_requests(server, body, status, param):
    err = assert_error(server.post("/v1/completions", body), status, param)
    if param == "prompt" and "hi " in str(body.get("prompt")):
        assert err["code"] == "context_length_exceeded"
    if status == 404:
        assert err["code"] == "model_not_found"


BAD_CHAT = [
    ({"model": "tide-test", "messages": []}, 400, "messages"),
    ({"model": "tide-test", "messages": "hello"}, 400, "messages"),
    ({"model": "tide-test"}, 400, "messages"),
    ({"model": "tide-test", "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ({"model": "tide-test", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    ({"model": "tide-test", "messages": [{"role": "user", "content": "hi", "extra": 1}]}, 400,
     "messages.0.extra"),
    ({"model": "tide-test", "messages": [{"role": "tool", "content": "hi", "tool_call_id": "c"}]},
     400, "messages"),  # the template refuses the role
    ({"model": "tide-test", "messages": [{"role": "tool", "content": "hi"}]}, 400,
     "messages.0.tool_call_id"),
    ({"model": "tide-test", "messages": [{"role": "user", "content": "hi"}],
      "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "tide-test", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),  # no parser
    ({"model": "tide-test", "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": "auto"}, 400, "tool_choice"),
    ({"model": "tide-test", "messages": [{"role": "user", "content": "hi " * 2000}]}, 400,
     "messages"),
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_CHAT,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_CHAT)])
def test_bad_chat_requests(server, body, status, param):
    assert_error(server.post("/v1/chat/completions", body), status, param)


BAD_GENERATE = [
    ({}, 400, "text"),
    ({"text": "hi", "input_ids": [1, 2]}, 400, "text"),
    ({"text": ""}, 400, "text"),
    ({"input_ids": []}, 400, "input_ids"),
    ({"input_ids": [1, -5]}, 400, "input_ids"),
    ({"input_ids": [[1, 2], []]}, 400, "input_ids.1"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 2}}, 400, "sampling_params.top_p"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, 400,
     "sampling_params.max_new_tokens"),
    ({"text": "hi", "sampling_params": {"bogus": 1}}, 400, "sampling_params.bogus"),
    ({"text": "hi", "sampling_params": "greedy"}, 400, "sampling_params"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 100000}}, 400,
     "sampling_params.max_new_tokens"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ({"text": ["a", "b"], "rid": "same"}, 400, "rid"),
    ({"text": "hi", "return_logprob": "yes"}, 400, "return_logprob"),
    ({"text": "hi", "sampling_params": {"logit_bias": {"7": -1000}}}, 400,
     "sampling_params.logit_bias"),
    ({"text": "hi", "unknown": True}, 400, "unknown"),
    ({"text": "hi", "return_logprob": True, "logprob_start_len": -3}, 400, "logprob_start_len"),
    ({"text": "hi", "return_logprob": True, "logprob_start_len": "0"}, 400, "logprob_start_len"),
]


@pytest.mark.parametrize("body,status,param", BAD_GENERATE,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_GENERATE)])
def test_bad_generate_requests(server, body, status, param):
    assert_error(server.post("/generate", body), status, param)


def test_malformed_bodies_and_routes(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"):
        err = assert_error(_raw_post(server, path, b'{"model": "tide-test", "prompt": '), 400)
        assert err["code"] == "invalid_json"
        assert_error(_raw_post(server, path, b"[1, 2, 3]"), 400)
        assert_error(_raw_post(server, path, b""), 400)
        assert_error(_raw_post(server, path, b"\xff\xfe"), 400)
    assert_error(server.get("/no/such/route"), 404)
    assert_error(server.get("/v1/completions"), 405)
    assert_error(server.post("/abort_request", {}), 400, "rid")
    assert_error(server.get("/flush_cache", params={"timeout": "soon"}), 400, "timeout")
    assert_error(server.get("/flush_cache", params={"x": "1"}), 400, "x")  # the unknown one
    assert_error(server.get("/v1/models/nope"), 404, "model")


def test_duplicate_running_rid_rejected(server):
    async def run() -> tuple[int, int]:
        body = {"text": PROMPTS[0], "rid": "dup", "stream": True,
                "sampling_params": {"max_new_tokens": 490, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/generate", json=body) as resp:
                lines = resp.aiter_lines()  # keep a reference: a dropped iterator closes the stream
                async for line in lines:
                    if line.startswith("data: "):
                        break
                second = await http.post("/generate", json={"text": "x", "rid": "dup"})
                if second.status_code == 200:  # the second ran: was the first already over?
                    last = [json.loads(x[6:]) for x in [line] + [x async for x in lines]
                            if x.startswith("data: ") and x != "data: [DONE]"][-1]
                    if last["meta_info"]["finish_reason"]["type"] == "length":
                        raise SlowHost("the first request finished before the second came")
                aborted = await http.post("/abort_request", json={"rid": "dup"})
                assert aborted.json()["num_aborted"] == 1
            return resp.status_code, second.status_code

    first, second = retry_slow_host(lambda: asyncio.run(run()))
    assert (first, second) == (200, 400)


def test_server_healthy_after_bad_input(server, client):
    assert server.get("/health").status_code == 200
    out = client.completions.create(model="tide-test", prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    info = _wait_idle(server)
    assert info["kv_held_slots"] == 0 and info["invariants_ok"]


# ---------------------------------------------------------------- metrics (acceptance 5)
def _metric_values(server) -> dict[tuple, float]:
    text = server.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                         if k != "model_name")))] = s.value
    return values


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics(server, engine):
    before = _metric_values(server)
    for name in ("tide:num_running_reqs", "tide:num_queue_reqs", "tide:kv_used_slots",
                 "tide:token_usage", "tide:cache_hit_rate", "tide:kv_total_slots"):
        assert (name, ()) in before, name
    text = PROMPTS[1]
    out = server.post("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": 7, "temperature": 0, "ignore_eos": True}}).json()
    after = _metric_values(server)
    assert _delta(before, after, "tide:generation_tokens_total") == 7
    assert _delta(before, after, "tide:prompt_tokens_total") == out["meta_info"]["prompt_tokens"]
    assert _delta(before, after, "tide:num_requests_total", finish_reason="length") == 1
    assert _delta(before, after, "tide:time_to_first_token_seconds_count") == 1
    assert _delta(before, after, "tide:e2e_request_latency_seconds_count") == 1
    assert _delta(before, after, "tide:inter_token_latency_seconds_count") == 6
    # the same prompt again hits the radix cache
    server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    final = _metric_values(server)
    assert _delta(after, final, "tide:cached_tokens_total") >= 1
    assert final[("tide:cache_hit_rate", ())] > 0
    assert final[("tide:kv_total_slots", ())] == _load(server)["max_total_tokens"]


# ---------------------------------------------------------------- native / admin routes
def test_native_info_routes(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["is_generation"] is True and info["served_model_name"] == "tide-test"
    sinfo = _load(server)
    for key in ("max_total_tokens", "context_length", "model_path", "num_running_reqs", "version",
                "port"):
        assert key in sinfo
    assert sinfo["api_key"] is None


def test_flush_cache(server):
    server.post("/generate", {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert _load(server)["kv_cached_slots"] > 0
    resp = server.get("/flush_cache")
    assert resp.status_code == 200
    info = _load(server)
    assert info["kv_cached_slots"] == 0 and info["kv_free_slots"] == info["max_total_tokens"]
    assert server.post("/flush_cache", {"timeout": 1.0}).status_code == 200


def test_flush_cache_busy_then_timeout(server):
    async def run() -> tuple[int, int]:
        body = {"text": PROMPTS[0], "stream": True,
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/generate", json=body) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                busy = await http.post("/flush_cache")
                task = asyncio.ensure_future(http.post("/flush_cache", json={"timeout": 30}))
                tail = [json.loads(x[6:]) async for x in lines
                        if x.startswith("data: ") and x != "data: [DONE]"]
                done = await task
                if busy.status_code == 200 and (
                        not tail or tail[-1]["meta_info"]["finish_reason"]["type"] == "length"):
                    raise SlowHost("the request finished before the flush")
            return busy.status_code, done.status_code

    busy, waited = retry_slow_host(lambda: asyncio.run(run()))
    assert busy == 400  # requests running: not flushed, says so
    assert waited == 200  # waited for idle, then flushed


def test_incremental_streaming_output(server, model_path, tmp_path):
    """`--incremental-streaming-output`: each /generate stream event carries what the sequence
    added since the last one; together they are the cumulative stream's last event (the same
    greedy text, ids and logprobs), and a logprob stream is bounded by its entries, not by every
    event's copy of them."""
    body = {"text": "The quick brown fox", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "stream": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}

    def stream(srv) -> list:
        resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        events = [e for e in _sse_events(resp.text) if e != "[DONE]"]
        assert events and all("error" not in e for e in events), events
        return events

    full = stream(server)[-1]
    with running_server(model_path, "--served-model-name", "tide-test",
                        "--incremental-streaming-output", "--max-logprob-entries", "200",
                        log_dir=tmp_path) as srv:
        # A fast machine can finish the 40 tokens between two turns of the stream's loop, which
        # then sends them in one event: stream again until the output comes in several.
        for _ in range(5):
            parts = stream(srv)
            if len(parts) > 1:
                break
        assert len(parts) > 1
        meta = parts[-1]["meta_info"]
        assert meta["completion_tokens"] == 40
        assert "".join(p["text"] for p in parts) == full["text"]
        assert sum((p["output_ids"] for p in parts), []) == full["output_ids"]
        # The shared server may hold the prompt in its prefix cache from an earlier test, so its
        # prefill runs another shape: tokens must match exactly, logprob values to float noise.
        for key in ("output_token_logprobs", "output_top_logprobs"):
            joined = sum((p["meta_info"][key] for p in parts), [])
            assert _logprob_tokens(joined) == _logprob_tokens(full["meta_info"][key])
            assert _logprob_values(joined) == pytest.approx(_logprob_values(full["meta_info"][key]),
                                                            abs=1e-4)
        # It was served under a bound of 200 entries: 40 tokens x 3 fit, where a cumulative
        # stream counts 40 * 41 / 2 x 3 = 2,460 and is refused.
