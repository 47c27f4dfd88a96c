"""Tool calls and reasoning in chat completions (`--tool-call-parser`, `--reasoning-parser`).

The parsers alone: every split of an output into stream pieces gives what the whole output gives,
for each format. End to end: a tiny Llama trained here to answer three chat prompts with fixed
text (thinking, then a tool call; thinking, then text; the reply after a tool's result) served with
`--tool-call-parser qwen25 --reasoning-parser qwen3`, reached with the official `openai` client,
streamed and not; the earlier turn's call and the tool's result must reach the chat template
(the prompt's token count says they did).
"""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import openai
import pytest
import torch
import transformers
from server_utils import assert_error, running_server

from tide.server.function_call_parser import FunctionCallParser, ToolCall
from tide.server.reasoning_parser import ReasoningParser


def _pieces(text: str, seed: int) -> list[str]:
    """`text` cut at up to 12 random places (seed 0: whole)."""
    if seed == 0 or len(text) < 2:
        return [text]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _calls_of(parser: FunctionCallParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    # Collected in lists and joined once: adding each piece to a string re-copies it (quadratic),
    # which would dominate the timed tests below.
    content: list[str] = []
    calls: list[ToolCall] = []
    for piece in pieces:
        c, k = parser.feed(piece)
        content.append(c)
        calls.extend(k)
    c, k = parser.finish()
    content.append(c)
    calls.extend(k)
    return "".join(content), calls


def _reasoning_of(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning: list[str] = []
    answer: list[str] = []
    for piece in [*pieces, None]:
        r, a = parser.finish() if piece is None else parser.feed(piece)
        reasoning.append(r)
        answer.append(a)
    return "".join(reasoning), "".join(answer)


WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
DEEP_CALL = ('<tool_call>{"name": "get_time", "arguments": ' + '{"a": ' * 995 + "1" + "}" * 995
             + "}</tool_call>")
NAN_CALL = '<tool_call>{"name": "get_time", "arguments": {"x": NaN, "y": 1e999}}</tool_call>'
SURROGATE_CALL = '<tool_call>{"name": "get_time", "arguments": {"s": "\\ud83d"}}</tool_call>'
TIME = ToolCall("get_time", "{}")
CALL_CASES = [
    # (parser, text, content, calls)
    ("qwen25", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     "</tool_call>", "Let me look.", [WEATHER, TIME]),
    ("qwen25", "No tools needed: 2 < 3 and <tool> is not a tag.  ",
     "No tools needed: 2 < 3 and <tool> is not a tag.  ", []),
    # a function the request did not declare, and arguments that are not an object, stay text
    ("qwen25", 'a <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> b',
     'a <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> b', []),
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": {"a": </tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {"a": </tool_call>', []),
    # cut short: a whole JSON object still counts, a half one stays text
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": {}}', "", [TIME]),
    ("qwen25", 'ok <tool_call>{"name": "get_ti', 'ok <tool_call>{"name": "get_ti', []),
    # arguments given as JSON text are accepted as the object they encode
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", [TIME]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": '
     '[1, 2]}}; {"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
    ("llama3", ' {"name": "get_time", "parameters": {}}', "", [TIME]),
    ("llama3", "It is 5 o'clock.", "It is 5 o'clock.", []),
    ("llama3", '{"answer": 4}', '{"answer": 4}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
     '"arguments": {"city": "Paris", "days": [1, 2]}}]', "", [TIME, WEATHER]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', "", [TIME]),
    ("mistral", "[1] says so.", "[1] says so.", []),
    # JSON nested past the decoder's recursion limit is text, not a crash
    ("qwen25", "<tool_call>" + "[" * 100000 + "</tool_call>",
     "<tool_call>" + "[" * 100000 + "</tool_call>", []),
    ("qwen25", DEEP_CALL, DEEP_CALL, []),
    # no arguments: an empty object (as sglang); not strict JSON, or a lone surrogate: text
    ("qwen25", '<tool_call>{"name": "get_time"}</tool_call>', "", [TIME]),
    ("qwen25", NAN_CALL, NAN_CALL, []),
    ("qwen25", SURROGATE_CALL, SURROGATE_CALL, []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CALL_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CALL_CASES)])
def test_tool_calls_parse_the_same_in_any_pieces(fmt, text, content, calls):
    for seed in range(40):
        parser = FunctionCallParser(fmt, ["get_weather", "get_time"])
        got = _calls_of(parser, _pieces(text, seed))
        assert got == (content, calls), (seed, _pieces(text, seed))
        assert parser.num_calls == len(calls)


def test_tool_call_parser_streams_text_without_waiting_for_the_end():
    parser = FunctionCallParser("qwen25", ["get_time"])
    assert parser.feed("The time is <tool") == ("The time is", [])  # the space waits: a call may follow
    assert parser.feed("_call>") == ("", [])
    assert parser.feed('{"name": "get_time", "arguments": {}}</tool_call>') == ("", [TIME])
    assert parser.feed(" done") == ("done", [])
    parser = FunctionCallParser("llama3", ["get_time"])
    assert parser.feed("Plain") == ("Plain", [])
    parser = FunctionCallParser("qwen25", ["get_time"], parallel=False)
    one = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert _calls_of(parser, [one + one]) == ("", [TIME])


def test_call_ids_take_each_family_s_form():
    one = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    [call] = _calls_of(FunctionCallParser("qwen25", ["get_time"]), [one])[1]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.to_openai()["id"] == call.id
    [call] = _calls_of(FunctionCallParser("mistral", ["get_time"]),
                       ['[{"name": "get_time", "arguments": {}}]'])[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)


@pytest.mark.parametrize("text", [
    " " * 400_000 + "x",  # whitespace before the output shows what it is
    '<tool_call>{"name": "get_time", "arguments": {"s": "' + "y" * 400_000 + '"}}</tool_call>',
    '{"name": "get_time", "parameters": {"s": "' + "y" * 400_000 + '"}}',
    "a" + " " * 400_000 + "b",  # whitespace held back inside text
    "<think>" + "z" * 400_000 + "</think>ok",
])
def test_long_outputs_fed_a_few_characters_at_a_time_take_linear_time(text):
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    t0 = time.process_time()  # CPU time: a stalled host does not inflate it
    for fmt in ("qwen25", "llama3", "mistral"):
        _calls_of(FunctionCallParser(fmt, ["get_time"]), pieces)
    for name in ("qwen3", "deepseek-r1"):
        _reasoning_of(ReasoningParser(name), pieces)
    assert time.process_time() - t0 < 4.0  # ~0.5 s here; quadratic buffering took minutes


def test_many_calls_in_one_piece_take_linear_time():
    """A whole output (a non-streamed reply, /parse_function_call) in one piece: 364k calls in
    8 MB once took ~1 minute, re-copying the rest of the text after each call."""
    parser = FunctionCallParser("qwen25", ["get_time"])
    t0 = time.process_time()
    content, calls = _calls_of(parser, ['<tool_call>{"name": "get_time"}</tool_call>' * 100_000
                                        + "<tool_call></tool_call>" * 250_000])
    assert len(calls) == 100_000 and content == "<tool_call></tool_call>" * 250_000
    assert time.process_time() - t0 < 15.0  # ~3 s here


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        FunctionCallParser("hermes9", [])
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningParser("r2")


REASONING_CASES = [
    ("qwen3", " <think>\nStep one.\nStep two.\n</think>\n\nThe answer is 4.\n",
     "Step one.\nStep two.", "The answer is 4.\n"),
    ("qwen3", "The answer is 4, no <think> tag first.", "", "The answer is 4, no <think> tag first."),
    ("qwen3", "<think>cut short at the token lim", "cut short at the token lim", ""),
    ("qwen3", "<think>a</think>b</think>", "a", "b</think>"),
    ("qwen3", "  ", "", "  "),
    ("qwen3", "<thi", "", "<thi"),
    ("deepseek-r1", "Thinking here.</think>Answer.", "Thinking here.", "Answer."),
    ("deepseek-r1", "<think>\nThinking.\n</think>\nAnswer.", "Thinking.", "Answer."),
    ("deepseek-r1", "no end tag", "no end tag", ""),
    ("qwen3-thinking", "x</think>y", "x", "y"),
]


@pytest.mark.parametrize("name,text,reasoning,answer", REASONING_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_splits_the_same_in_any_pieces(name, text, reasoning, answer):
    for seed in range(40):
        got = _reasoning_of(ReasoningParser(name), _pieces(text, seed))
        assert got == (reasoning, answer), (seed, _pieces(text, seed))


# ---------------------------------------------------------------- end to end
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ARGS = '{"city": "Paris"}'
ANSWERED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
GREET = [{"role": "user", "content": "Say hello."}]
# (messages, tools, the output the model is trained to give)
SCRIPT = [
    (ASK, TOOLS, "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (GREET, None, "<think>\nA greeting.\n</think>\n\nHello there!"),
    (ANSWERED, TOOLS, "<think>\nIt said sunny.\n</think>\n\nIt is sunny in Paris."),
]
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}"
    "{% if m['role'] == 'tool' %} [{{ m['tool_call_id'] }}]{% endif %}"
    "<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _prompt_ids(tok, messages, tools) -> list[int]:
    rendered = []
    for m in messages:  # as the server hands them to the template: arguments as objects
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        rendered.append(m)
    text = tok.apply_chat_template(rendered, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    """A tiny Llama that answers SCRIPT's prompts with SCRIPT's outputs (greedy), checked here."""
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("scripted") / "m", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    seqs = []
    for messages, tools, out in SCRIPT:
        prompt = _prompt_ids(tok, messages, tools)
        target = tok(out, add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append((prompt, target))
    width = max(len(p) + len(t) for p, t in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, t) in enumerate(seqs):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
        mask[i, :len(p) + len(t)] = 1
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(400):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 2e-3:
            break
    model.eval()
    with torch.no_grad():
        for prompt, target in seqs:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target) + 4,
                                 do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.eos_token_id)
            assert out[0, len(prompt):].tolist() == target, "the model did not learn its script"
    model.save_pretrained(path)
    return path, {id(m): len(_prompt_ids(tok, m, t)) for m, t, _ in SCRIPT}


@pytest.fixture(scope="module")
def server(scripted_model, tmp_path_factory):
    path, _ = scripted_model
    with running_server(path, "--served-model-name", "scripted", "--tool-call-parser", "qwen25",
                        "--reasoning-parser", "qwen3",
                        log_dir=tmp_path_factory.mktemp("tool-log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, messages, tools=None, **kw):
    extra = {"tools": tools} if tools else {}
    return client.chat.completions.create(model="scripted", messages=messages, temperature=0,
                                          max_tokens=160, **extra, **kw)


def test_tool_call_comes_back_as_tool_calls(client, scripted_model):
    _, prompt_tokens = scripted_model
    resp = _chat(client, ASK, TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert resp.usage.prompt_tokens == prompt_tokens[id(ASK)]


def test_forced_tool_calls(client):
    """tool_choice 'required' or a named function: the output is one call of the request's
    functions in the parser's format, its arguments following the function's schema, also where
    the model would have answered in text (greeting), thinking first (the call), or called
    another function; streamed as well."""
    pytest.importorskip("xgrammar")
    both = [*TOOLS, {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}}]
    named_time = {"type": "function", "function": {"name": "get_time"}}
    for messages, choice, name in [(ASK, "required", "get_weather"),
                                   (ASK, named_time, "get_time"),
                                   (GREET, named_time, "get_time")]:
        resp = _chat(client, messages, both, tool_choice=choice)
        out = resp.choices[0]
        assert out.finish_reason == "tool_calls", out
        assert out.message.content is None
        [call] = out.message.tool_calls
        assert call.function.name == name
        args = json.loads(call.function.arguments)
        if name == "get_time":
            assert args in ({"zone": "UTC"}, {"zone": "CET"})
        else:
            # The model was trained to think first; forced, it does not, and its city differs.
            assert set(args) <= {"city"} and all(isinstance(v, str) for v in args.values())
        chunks = list(client.chat.completions.create(
            model="scripted", messages=messages, tools=both, tool_choice=choice, temperature=0,
            max_tokens=160, stream=True))
        streamed = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])
                    if ch.choices]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (name, call.function.arguments)]


def test_plain_answer_keeps_content_and_reasoning(client):
    choice = _chat(client, GREET).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Hello there!"
    assert choice.message.tool_calls is None
    assert choice.message.model_extra["reasoning_content"] == "A greeting."


def test_tool_result_turn_reaches_the_template(client, scripted_model):
    _, prompt_tokens = scripted_model
    resp = _chat(client, ANSWERED, TOOLS)
    assert resp.usage.prompt_tokens == prompt_tokens[id(ANSWERED)]
    assert resp.choices[0].message.content == "It is sunny in Paris."
    assert resp.choices[0].finish_reason == "stop"


def test_a_reply_sent_back_as_the_client_got_it_renders_as_written(client, scripted_model):
    """The openai tool loop: `messages.append(reply.message)` (with its null `refusal`, and what
    `model_dump` adds), then the tool's result; rendered as the same turn written by hand."""
    path, _ = scripted_model
    reply = _chat(client, ASK, TOOLS).choices[0].message
    [call] = reply.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    written = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]}, result]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = len(_prompt_ids(tok, written, TOOLS))
    for sent in (reply, reply.model_dump()):
        resp = _chat(client, [*ASK, sent, result], TOOLS)
        assert resp.usage.prompt_tokens == want


def test_streamed_tool_call_and_reasoning(client):
    chunks = list(_chat(client, ASK, TOOLS, stream=True, n=2))
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        reasoning = "".join(d.delta.model_extra.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.delta.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.delta.tool_calls or ()]
        assert reasoning == "The user wants weather."
        assert content == ""
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] \
            == [(0, "get_weather", {"city": "Paris"})]
        assert deltas[-1].finish_reason == "tool_calls"
        assert all(d.finish_reason is None for d in deltas[:-1])
    # the plain answer streams too, thinking first
    deltas = [c.choices[0] for c in _chat(client, GREET, stream=True) if c.choices]
    kinds = [("r" if d.delta.model_extra.get("reasoning_content") else "")
             + ("c" if d.delta.content else "") for d in deltas]
    kinds = [k for k in kinds if k]
    assert kinds and set(kinds[:1]) == {"r"} and kinds[-1] == "c" and "rc" not in kinds
    assert "".join(d.delta.content or "" for d in deltas) == "Hello there!"


def test_separate_reasoning_false_and_tool_choice_none_leave_text(client):
    resp = _chat(client, GREET, extra_body={"separate_reasoning": False})
    assert resp.choices[0].message.content == "<think>\nA greeting.\n</think>\n\nHello there!"
    assert "reasoning_content" not in resp.choices[0].message.model_extra
    # tool_choice none: the tools are neither rendered nor parsed
    resp = _chat(client, ASK, TOOLS, tool_choice="none")
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason in ("stop", "length")


def _said(arguments: str) -> dict:
    """An assistant turn that called get_weather with `arguments`."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]}


BAD_TOOL_REQUESTS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}], "tool_choice": "required"},
     "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS * 2}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": ANSWERED[1]["tool_calls"]}]},
     "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [*ASK, _said('{"a": "\\ud800"}')]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*ASK, _said('{"a": ' * 40 + "1" + "}" * 40)]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*ASK, {"role": "assistant", "content": None,
                          "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.1.function_call"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOL_REQUESTS,
                         ids=[p for _, p in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_name_the_field(server, extra, param):
    body = {"model": "scripted", "messages": ASK, "max_tokens": 4, **extra}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), 400,
                 param)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_parse_routes_split_a_given_text(server):
    """sglang's /parse_function_call and /separate_reasoning: the chat parsers on a text a client
    generated through /generate; the server's parsers by default, or the one named."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=30)

    two = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    out = post("/parse_function_call", {"text": 'Sure. <tool_call>{"name": "get_time", '
                                                '"arguments": {}}</tool_call>', "tools": two})
    assert out.status_code == 200, out.text
    assert out.json() == {"normal_text": "Sure.", "calls": [
        {"tool_index": 1, "name": "get_time", "parameters": "{}"}]}
    out = post("/parse_function_call", {"text": '{"name": "get_weather", "parameters": '
                                                '{"city": "Oslo"}}', "tools": two,
                                        "tool_call_parser": "llama3"}).json()
    assert out == {"normal_text": "", "calls": [
        {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'}]}
    out = post("/separate_reasoning", {"text": "<think>hm</think> 4"}).json()
    assert out == {"text": "4", "reasoning_text": "hm"}
    out = post("/separate_reasoning", {"text": "hm</think>4",
                                       "reasoning_parser": "deepseek-r1"}).json()
    assert out == {"text": "4", "reasoning_text": "hm"}
    assert_error(post("/parse_function_call", {"text": "x", "tool_call_parser": "nope"}), 400,
                 "tool_call_parser")
    assert_error(post("/parse_function_call", {"text": "x", "tools": [two[1]] * 129}), 400,
                 "tools")
    assert_error(post("/separate_reasoning", {"text": "x", "reasoning_parser": "r9"}), 400,
                 "reasoning_parser")
    assert_error(post("/separate_reasoning", {}), 400, "text")
    # no longer than a prompt may be (512 positions x 32 characters here)
    assert_error(post("/separate_reasoning", {"text": "x" * 20_000}), 400, "text")
    assert_error(post("/parse_function_call", {"text": "x" * 20_000}), 400, "text")
