"""Constrained decoding (`json_schema`, `regex`, `ebnf`; OpenAI's `response_format`).

Truth: HF transformers' greedy `generate` with xgrammar's own HF logits processor (its separate
implementation of the same masks) for tokens and logprobs; a regular expression / JSON parser for
what the outputs must be; the one-step-at-a-time schedule for the overlap schedule.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import threading
import time

import httpx
import pytest
import tide
import torch
from tide.grammar import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH, apply_bitmask, unpack_and_mask
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

from conftest import random_prompts
from server_utils import assert_error, running_server, serve_model_path
from test_overlap import _reqs as overlap_reqs
from test_overlap import _run as overlap_run

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{2,3}"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'
EBNF_RE = r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)"


def _no_whitespace_bias(tokenizer) -> dict[int, float]:
    """-100 on every token that decodes to whitespace only: a random tiny model otherwise may fill
    a JSON value's allowed whitespace until max_new_tokens (the grammar's mask comes first, so
    such a token is still drawn where it is the only one allowed)."""
    return {i: -100.0 for i in range(len(tokenizer))
            if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()}


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"id", "ok"}, value
    assert isinstance(value["id"], int) and not isinstance(value["id"], bool)
    assert 0 <= value["id"] <= 999 and isinstance(value["ok"], bool)


def test_outputs_follow_their_grammar(llama_engine):
    """Sampled and greedy rows, n > 1, three kinds of grammar beside a free row in one batch: each
    constrained output matches its grammar and ends on eos (left out of the text)."""
    bias = _no_whitespace_bias(llama_engine.tokenizer)
    prompts = ["The quick brown fox", "Python is", "In the beginning", "The word", "lazy dog"]
    params = [
        {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 60, "temperature": 1.0, "seed": 5,
         "n": 3, "logit_bias": bias},
        {"regex": REGEX, "max_new_tokens": 20, "temperature": 0.9, "n": 4, "seed": 1},
        {"ebnf": EBNF, "max_new_tokens": 40, "temperature": 1.0, "seed": 2, "n": 2},
        {"regex": REGEX, "max_new_tokens": 20, "temperature": 0},
        {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True},
    ]
    outs = llama_engine.generate(prompt=prompts, sampling_params=params)
    assert len(outs) == 3 + 4 + 2 + 1 + 1
    json_outs, regex_outs, ebnf_outs, greedy_regex, free = (outs[:3], outs[3:7], outs[7:9],
                                                            outs[9], outs[10])
    for out in json_outs + regex_outs + ebnf_outs + [greedy_regex]:
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}, out
        assert out["output_ids"][-1] == 0 and "<eos>" not in out["text"]
    for out in json_outs:
        _check_schema(out["text"])
    for out in regex_outs + [greedy_regex]:
        assert re.fullmatch(REGEX, out["text"]), out["text"]
    for out in ebnf_outs:
        assert re.fullmatch(EBNF_RE, out["text"]), out["text"]
    assert len({o["text"] for o in regex_outs}) > 1  # sampled, not forced to one string
    assert len(free["output_ids"]) == 9


def test_greedy_tokens_and_logprobs_match_hf_with_xgrammars_processor(llama_engine, hf_model_for):
    """Greedy constrained decoding gives HF's tokens under xgrammar's HF logits processor, and
    logprobs of the masked distribution (log-softmax of the processed scores)."""
    hf = hf_model_for("llama")
    tok = llama_engine.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size,
                                              stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info)
    cases = [("regex", r"[a-z ]{3,12}\.", compiler.compile_regex(r"[a-z ]{3,12}\.")),
             ("ebnf", EBNF, compiler.compile_grammar(EBNF)),
             ("json_schema", json.dumps(SCHEMA), compiler.compile_json_schema(json.dumps(SCHEMA)))]
    for (field, text, compiled), prompt in zip(cases, random_prompts(11, [7, 12, 5])):
        out = llama_engine.generate(input_ids=prompt, sampling_params={
            field: text, "temperature": 0, "max_new_tokens": 24}, return_logprob=True)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, eos_token_id=0, pad_token_id=0,
                              logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
                              output_scores=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        assert out["output_ids"] == tokens, field
        logp = torch.log_softmax(torch.stack([s[0] for s in ref.scores]).float(), dim=-1)
        expected = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(expected, abs=1e-4), field


def test_the_overlap_schedule_waits_for_constrained_rows(engine_for):
    """A batch with a constrained request runs one step at a time under the overlap schedule and
    gives exactly the one-step-at-a-time tokens; free requests alone still overlap."""
    engine = engine_for("llama")
    prompts = random_prompts(21, [6, 11, 17])
    params = [{"regex": REGEX, "temperature": 1.0, "seed": 3, "max_new_tokens": 20},
              {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True},
              {"ebnf": EBNF, "temperature": 0.7, "seed": 9, "max_new_tokens": 30}]
    base = overlap_run(engine, overlap_reqs(prompts, params, logprobs=True), overlap=False)
    over = overlap_run(engine, overlap_reqs(prompts, params, logprobs=True), overlap=True)
    assert over["out"] == base["out"]
    for rid in ("r0",):
        assert re.fullmatch(REGEX, engine.tokenizer.decode(base["out"][rid][0][:-1]))
    # Overlap resumed once the constrained rows finished (the free row runs on alone).
    free = overlap_run(engine, overlap_reqs(prompts[1:2], params[1:2]), overlap=True)
    assert free["overlapped"] > 0 and free["out"]["r0"][0] == base["out"]["r1"][0]


def test_bad_grammars_are_value_errors_naming_the_field(llama_engine):
    cases = [({"regex": "a(b"}, "^regex is not a valid regular expression"),
             ({"ebnf": "root ::= "}, "^ebnf is not a valid EBNF grammar"),
             ({"json_schema": "{not json"}, "^json_schema is not valid JSON"),
             ({"json_schema": '{"type": 5}'}, "^json_schema is not a valid JSON schema"),
             ({"regex": ""}, "^regex must not be empty"),
             ({"ebnf": 7}, "^ebnf must be a string"),
             ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, f"^regex may be at most {MAX_GRAMMAR_CHARS}"),
             ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex and ebnf"),
             ({"regex": "a+", "min_new_tokens": 2}, "^min_new_tokens cannot be combined with regex"),
             ({"json_schema": json.dumps(_nested(MAX_SCHEMA_DEPTH))},
              f"^json_schema may nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep, got "
              f"{MAX_SCHEMA_DEPTH + 1}")]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**params)
        with pytest.raises(ValueError, match=message):
            llama_engine.generate(prompt="The", sampling_params=params)
    assert llama_engine.generate(prompt="The", sampling_params={"max_new_tokens": 2})["output_ids"]
    SamplingParams(json_schema=json.dumps(_nested(MAX_SCHEMA_DEPTH - 1)))  # at the bound


def _nested(levels: int) -> dict:
    """A schema of arrays `levels` deep around an integer (levels + 1 JSON containers)."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_grammar_backend_none_and_no_tokenizer_refuse(llama_path, no_tokenizer_checkpoint):
    with tide.Engine(str(llama_path), grammar_backend="none") as engine:
        with pytest.raises(ValueError, match="^regex needs constrained decoding.*grammar_backend"):
            engine.generate(prompt="The", sampling_params={"regex": "a+"})
        assert engine.generate(prompt="The", sampling_params={"max_new_tokens": 2})["output_ids"]
    with tide.Engine(str(no_tokenizer_checkpoint), skip_tokenizer_init=True) as engine:
        with pytest.raises(ValueError, match="^json_schema needs a tokenizer"):
            engine.generate(input_ids=[5, 6], sampling_params={"json_schema": "{}"})
    with pytest.raises(ValueError, match="grammar_backend must be one of"):
        tide.Engine(str(llama_path), grammar_backend="outlines")


class _Gate:
    """A compile held until released (or failing), to see requests wait in `grammar_queue`."""

    def __init__(self, backend, fail: str | None = None) -> None:
        self.backend, self.fail = backend, fail
        self.release = concurrent.futures.Future()
        self.compile_real = backend._compile

    def compile(self, field, text):
        def run():
            self.release.result(timeout=60)
            if self.fail:
                raise ValueError(self.fail)
            return self.compile_real(field, text)
        return self.backend._pool.submit(run)


def test_requests_wait_for_their_grammar_and_others_go_on(llama_path, monkeypatch):
    """While a grammar compiles its request waits in `grammar_queue` (counted as queued); a free
    request decodes meanwhile; an abort reaches a waiting request; a failed compile ends its request
    alone with an abort that says why."""
    with tide.Engine(str(llama_path)) as engine:
        sched = engine.scheduler
        backend = sched._grammar_compiler()
        gate = _Gate(backend)
        monkeypatch.setattr(backend, "compile", gate.compile)
        slow = Req("slow", [5, 6, 7], SamplingParams(regex=REGEX, max_new_tokens=20))
        gone = Req("gone", [5, 6], SamplingParams(regex=REGEX, max_new_tokens=20))
        free = Req("free", [8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                  temperature=0))
        for req in (slow, gone, free):
            sched.add_request(req)
        assert sched.grammar_queue == [slow, gone] and sched.num_queued() == 3
        for _ in range(20):
            sched.step()
        assert free.finished and len(free.output_ids) == 6
        assert not slow.output_ids and sched.has_work()
        assert sched.abort_reqs([gone]) == [gone]
        assert gone.finished_reason["type"] == "abort" and sched.grammar_queue == [slow]
        gate.release.set_result(None)
        deadline = time.monotonic() + 60  # the compile runs on its thread: steps, not a count
        while not slow.finished and time.monotonic() < deadline:
            sched.step()
        assert slow.finished_reason["type"] == "stop", slow.finished_reason
        assert re.fullmatch(REGEX, engine.tokenizer.decode(slow.output_ids[:-1]))
        assert not sched.has_work()
        sched.check_invariants()

        failing = _Gate(backend, fail="regex could not be compiled: too big")
        failing.release.set_result(None)
        monkeypatch.setattr(backend, "compile", failing.compile)
        bad = Req("bad", [5, 6], SamplingParams(regex="x+", max_new_tokens=5))
        sched.add_request(bad)
        got = []
        deadline = time.monotonic() + 60
        while not bad.finished and time.monotonic() < deadline:
            got += sched.step()
        assert bad in got
        assert bad.finished_reason == {"type": "abort",
                                       "message": "regex could not be compiled: too big"}
        assert not sched.has_work()


def test_compiles_run_side_by_side_and_unwaited_ones_are_dropped(llama_path, monkeypatch):
    """A slow compile holds one of the backend's threads: another request's grammar compiles and
    decodes meanwhile. With every thread busy, a compile whose requests are all aborted never
    starts (one still waited for is kept), and the next request with that text compiles it anew."""
    from tide.grammar import COMPILE_THREADS

    with tide.Engine(str(llama_path)) as engine:
        sched = engine.scheduler
        backend = sched._grammar_compiler()
        real, release, started = backend._compile, threading.Event(), []

        def held(field, text):
            started.append(text)
            if text.startswith("held"):
                assert release.wait(60)
            return real(field, text)

        monkeypatch.setattr(backend, "_compile", held)

        def req(rid: str, regex: str) -> Req:
            r = Req(rid, [5, 6], SamplingParams(regex=regex, max_new_tokens=32, temperature=0))
            sched.add_request(r)
            return r

        def run_until(done, limit: float = 60.0) -> None:
            deadline = time.monotonic() + limit
            while not done() and time.monotonic() < deadline:
                sched.step()
            assert done()

        assert COMPILE_THREADS > 1
        slow = [req(f"slow{i}", f"held{i}[a-z]") for i in range(COMPILE_THREADS - 1)]
        fast = req("fast", REGEX)
        run_until(lambda: fast.finished)
        assert re.fullmatch(REGEX, engine.tokenizer.decode(fast.output_ids[:-1]))
        assert all(not r.output_ids and r in sched.grammar_queue for r in slow)
        # every thread busy: the next compiles wait in the pool
        slow.append(req("last", "held-last[a-z]"))
        run_until(lambda: len(started) == COMPILE_THREADS + 1)  # fast's compile, then the held
        lone = req("lone", "held-lone[a-z]")
        pair = [req("pair0", "held-pair[a-z]"), req("pair1", "held-pair[a-z]")]
        lone_future, pair_future = lone.grammar_future, pair[0].grammar_future
        assert pair[1].grammar_future is pair_future and not lone_future.running()
        assert sched.abort_reqs([lone, pair[0]]) == [lone, pair[0]]
        assert lone_future.cancelled() and not pair_future.cancelled()
        assert ("regex", "held-lone[a-z]") not in backend._cache  # forgotten, not a dead slot
        late = req("late", "held-late[a-z]")  # its deadline passes while it waits in the pool
        late_future, late.grammar_deadline = late.grammar_future, time.monotonic() - 1
        sched.step()
        assert late.finished_reason == {"type": "abort",
                                        "message": "regex did not compile within 300 s"}
        assert late_future.cancelled() and ("regex", "held-late[a-z]") not in backend._cache
        release.set()
        run_until(lambda: all(r.finished for r in slow + [pair[1]]))
        ends = [r.finished_reason["type"] for r in slow + [pair[1]]]
        assert ends == ["stop"] * len(ends), ends
        assert "held-lone[a-z]" not in started and "held-late[a-z]" not in started
        again = req("again", "held-lone[a-z]")
        run_until(lambda: again.finished)
        assert again.finished_reason["type"] == "stop" and started.count("held-lone[a-z]") == 1
        assert not sched.has_work()
        sched.check_invariants()


def test_a_grammar_that_never_compiles_times_out(llama_path, monkeypatch):
    """A request whose grammar outlasts the compile deadline ends with an abort saying so; the
    scheduler goes idle."""
    import tide.scheduler.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "COMPILE_TIMEOUT_S", 0.2)
    with tide.Engine(str(llama_path)) as engine:
        sched = engine.scheduler
        backend = sched._grammar_compiler()
        gate = _Gate(backend)
        monkeypatch.setattr(backend, "compile", gate.compile)
        out = engine.generate(prompt="The", sampling_params={"ebnf": EBNF, "max_new_tokens": 5})
        assert out["meta_info"]["finish_reason"] == {
            "type": "abort", "message": "ebnf did not compile within 0.2 s"}
        gate.release.set_result(None)
        assert not sched.has_work()


def test_apply_bitmask_matches_a_boolean_mask():
    """Masked tokens get -inf, allowed ones keep their logits, rows left out are untouched, and
    tokens past the bitmask (a logits row wider than it) keep theirs."""
    rng = random.Random(0)
    for vocab, dtype, rows in ((37, torch.float32, None), (64, torch.bfloat16, [0, 2]),
                               (100, torch.float32, [1])):
        words = (vocab + 31) // 32
        bits = [[rng.random() < 0.3 for _ in range(words * 32)] for _ in range(3)]
        packed = torch.tensor([[sum(1 << b for b in range(32) if row[32 * w + b]) - (
            1 << 32 if row[32 * w + 31] else 0) for w in range(words)] for row in bits],
            dtype=torch.int32)
        logits = torch.randn(3, vocab + 5).to(dtype)
        expected = logits.clone()
        for r in (range(3) if rows is None else rows):
            for t in range(min(vocab + 5, words * 32)):
                if not bits[r][t]:
                    expected[r, t] = -torch.inf
        unpacked = logits.clone()
        apply_bitmask(logits, packed, rows)
        assert torch.equal(logits, expected)
        if rows is None:  # the CUDA path's unpack, run here on the CPU
            unpack_and_mask(unpacked, packed)
            assert torch.equal(unpacked, expected)
    logits = torch.randn(2, 40)  # an all-ones row changes nothing
    before = logits.clone()
    apply_bitmask(logits, torch.full((2, 2), -1, dtype=torch.int32))
    assert torch.equal(logits, before)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = serve_model_path(tmp_path_factory.mktemp("serve-model"))
    with running_server(path, log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        srv.model_dir = path
        yield srv


def test_routes_constrain_outputs(server):
    from transformers import AutoTokenizer

    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    bias = {str(k): v for k, v in _no_whitespace_bias(
        AutoTokenizer.from_pretrained(str(server.model_dir))).items()}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Give a number as JSON"}],
        "max_tokens": 200, "temperature": 0, "logprobs": True, "logit_bias": bias,
        "response_format": {
            "type": "json_schema", "json_schema": {"name": "num", "schema": schema}}}, timeout=120)
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])
    obj = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": "Data:", "max_tokens": 200, "temperature": 0,
        "logit_bias": bias, "response_format": {"type": "json_object"}}, timeout=120).json()
    assert isinstance(json.loads(obj["choices"][0]["text"]), dict)
    gen = httpx.post(server.url + "/generate", json={
        "text": "The answer is", "sampling_params": {"regex": REGEX, "max_new_tokens": 20,
                                                     "temperature": 0}}, timeout=120).json()
    assert re.fullmatch(REGEX, gen["text"]) and gen["meta_info"]["finish_reason"]["type"] == "stop"
    comp = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": "List:", "max_tokens": 40, "temperature": 0.8, "seed": 4,
        "ebnf": EBNF, "n": 2}, timeout=120).json()
    assert all(re.fullmatch(EBNF_RE, c["text"]) for c in comp["choices"])


def test_routes_refuse_bad_constraints(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    cases = [
        ({"response_format": fmt}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "json_schema": "{}"}, "json_schema"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"regex": "a(b"}, "regex"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, None),
    ]
    for extra, param in cases:
        resp = httpx.post(server.url + "/v1/chat/completions", json=chat | extra, timeout=60)
        assert_error(resp, 400, param)
    resp = httpx.post(server.url + "/generate", json={
        "text": "x", "sampling_params": {"json_schema": "{bad"}}, timeout=60)
    assert_error(resp, 400, "sampling_params.json_schema")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_many_distinct_grammars_at_once_leave_the_server_serving(server):
    """48 requests, each with its own regex (48 compiles over the backend's threads), beside 8
    free ones: every output matches its own grammar, the free ones run to length, and /health
    answers meanwhile."""
    import asyncio

    regexes = [f"id{i:02d}-[0-9]{{2,4}}" for i in range(48)]

    async def main() -> tuple[list[dict], list[dict], list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            def generate(params: dict):
                return http.post("/generate", json={"text": "Code:", "sampling_params": {
                    "max_new_tokens": 12, "temperature": 0.7, "seed": 1, **params}})

            constrained = [asyncio.create_task(generate({"regex": r})) for r in regexes]
            free = [asyncio.create_task(generate({"ignore_eos": True})) for _ in range(8)]
            health = [(await http.get("/health")).status_code]
            health += [(await http.get("/health")).status_code]
            return ([(await t).json() for t in constrained], [(await t).json() for t in free],
                    health)

    constrained, free, health = asyncio.run(main())
    assert health == [200, 200]
    cached = httpx.get(server.url + "/get_server_info", timeout=30).json()["grammar_cache_bytes"]
    assert 0 < cached <= 1 << 30
    for regex, out in zip(regexes, constrained, strict=True):
        assert re.fullmatch(regex, out["text"]), (regex, out)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert [o["meta_info"]["completion_tokens"] for o in free] == [12] * 8


def test_a_server_without_a_grammar_backend_refuses_with_400(tmp_path_factory):
    path = serve_model_path(tmp_path_factory.mktemp("serve-model-none"))
    with running_server(path, "--grammar-backend", "none",
                        log_dir=tmp_path_factory.mktemp("server-log-none")) as srv:
        resp = httpx.post(srv.url + "/generate", json={
            "text": "x", "sampling_params": {"regex": "a+", "max_new_tokens": 3}}, timeout=60)
        err = assert_error(resp, 400, "regex")
        assert "grammar-backend none" in err["message"]
        resp = httpx.post(srv.url + "/generate", json={
            "text": "x", "sampling_params": {"max_new_tokens": 3}}, timeout=60)
        assert resp.status_code == 200


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_constrained_rows_on_a_cuda_engine(tmp_path):
    """A CUDA engine (graphs, overlap schedule, one-pass sampling for the free rows): constrained
    rows follow their grammars, greedy ones give the CPU engine's tokens and logprobs, and free rows
    keep the tokens they get alone, with and without the overlap schedule."""
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path / "llama", "llama")
    prompts = random_prompts(31, [5, 17, 40, 9, 23])
    params = [{"regex": REGEX, "temperature": 0, "max_new_tokens": 20},
              {"ebnf": EBNF, "temperature": 0, "max_new_tokens": 40},
              {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
              {"regex": REGEX, "temperature": 1.0, "seed": 4, "max_new_tokens": 20},
              {"temperature": 1.0, "seed": 2, "max_new_tokens": 24, "ignore_eos": True}]
    with tide.Engine(str(path), dtype="float32", device="cpu") as cpu:
        ref = cpu.generate(input_ids=prompts[:2], sampling_params=params[:2], return_logprob=True)
    runs = []
    for overlap_off in (False, True):
        with tide.Engine(str(path), dtype="float32", max_total_tokens=8192,
                         disable_overlap_schedule=overlap_off) as engine:
            alone = engine.generate(input_ids=[prompts[2], prompts[4]],
                                    sampling_params=[params[2], params[4]])
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            runs.append([o["output_ids"] for o in outs])
            assert re.fullmatch(REGEX, outs[0]["text"]) and re.fullmatch(REGEX, outs[3]["text"])
            assert re.fullmatch(EBNF_RE, outs[1]["text"])
            for got, want in zip(outs[:2], ref):
                assert got["output_ids"] == want["output_ids"]
                assert [lp for lp, _ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
                    [lp for lp, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-3)
            assert outs[2]["output_ids"] == alone[0]["output_ids"]
            assert outs[4]["output_ids"] == alone[1]["output_ids"]
    assert runs[0] == runs[1]


_CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def _accepts(ebnf: str, output: str) -> bool:
    """Whether the grammar matches exactly `output`, over a vocabulary of single characters."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(_CHARS))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
    return all(matcher.accept_token(_CHARS.index(c)) for c in output) and matcher.is_completed()


@pytest.mark.parametrize("parser,text", [
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_forced_call_grammars_take_their_parsers_format(parser, text):
    """The grammar a forced tool call gets (tool_choice 'required' or named) accepts one call in
    the parser's format and nothing else; the parser reads that text back as the call."""
    from tide.server.function_call_parser import FunctionCallParser, forced_call_grammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time"}}]
    required = forced_call_grammar(parser, tools, None)
    assert _accepts(required, text)
    assert not _accepts(required, text.replace("Paris", "Paris\\u"))
    assert not _accepts(required, text.replace('"get_weather"', '"rm_rf"'))
    assert not _accepts(required, "Sure. " + text)
    named = forced_call_grammar(parser, tools, "get_time")
    assert not _accepts(named, text)
    assert _accepts(named, text.replace("get_weather", "get_time").replace('"city": "Paris"', ""))
    call_parser = FunctionCallParser(parser, ["get_weather", "get_time"])
    content, calls = call_parser.feed(text)
    more, rest = call_parser.finish()
    assert (content + more).strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls + rest] == [
        ("get_weather", {"city": "Paris"})]
    with pytest.raises(ValueError, match="no tool is named 'nope'"):
        forced_call_grammar(parser, tools, "nope")


def test_an_ambiguous_grammar_ends_before_it_stalls_the_engine(llama_path, monkeypatch):
    """A valid but ambiguous grammar: xgrammar's matcher takes longer per token as the output
    grows (Earley), on the scheduler's thread, so every request would wait on it. Once following
    a token takes longer than MAX_ACCEPT_S for SLOW_ACCEPTS tokens in a row the request ends with
    an abort saying why; a free request beside it finishes as usual."""
    import tide.grammar as grammar_module
    import tide.scheduler.scheduler as scheduler_module

    for module in (grammar_module, scheduler_module):  # the limit and the message's figure
        monkeypatch.setattr(module, "MAX_ACCEPT_S", 0.002)  # real: 50 ms
    with tide.Engine(str(llama_path)) as engine:
        ambiguous = {"ebnf": 'root ::= root root root | root root | "a"', "max_new_tokens": 450,
                     "temperature": 0, "logit_bias": {"0": -100.0}}  # no eos: it goes on
        free = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(prompt=["The", "Python is"], sampling_params=[ambiguous, free])
        reason = outs[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "too ambiguous" in reason["message"], reason
        assert reason["message"].startswith("ebnf: following the grammar took")
        assert 0 < len(outs[0]["output_ids"]) < 450 and set(outs[0]["text"]) == {"a"}
        assert len(outs[1]["output_ids"]) == 30
        assert not engine.scheduler.has_work()


def test_a_grammar_that_leads_nowhere_emits_nothing_outside_it(llama_engine):
    """A grammar that matches no text, or an output after which it allows no token, leaves all
    logits -inf: the request ends with an abort saying so, and no token the grammar does not
    allow (drawn from NaN probabilities, with a NaN logprob) reaches its output."""
    for params in ({"ebnf": "root ::= root"}, {"regex": "[^\\x00-\\U0010FFFF]"}):
        out = llama_engine.generate(prompt="The", sampling_params=params | {"max_new_tokens": 5},
                                    return_logprob=True)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "matches no text" in reason["message"], reason
        assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    b = llama_engine.tokenizer.convert_tokens_to_ids("b")
    out = llama_engine.generate(prompt="The", sampling_params={
        "ebnf": 'root ::= "a" | "b" x\nx ::= x', "logit_bias": {str(b): 100.0},
        "max_new_tokens": 5, "temperature": 0}, return_logprob=True)
    reason = out["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "ebnf: the grammar allows no token after this "
                      "output (no text it matches continues it)"}, reason
    assert out["output_ids"] == [b] and out["text"] == "b"
    assert all(lp == lp for lp, _ in out["meta_info"]["output_token_logprobs"])  # no NaN
    assert llama_engine.generate(prompt="The", sampling_params={"max_new_tokens": 2})["output_ids"]


def test_a_grammar_too_costly_to_compile_is_refused_up_front(llama_engine):
    """A JSON schema within MAX_GRAMMAR_CHARS whose grammar expands far beyond it (2,000 optional
    properties: 15 s of compile on the one compile thread, holding up every constrained request)
    is a ValueError naming json_schema before any work; a schema near the bound still runs."""
    from tide.grammar import MAX_EXPANDED_GRAMMAR_CHARS

    wide = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                        for i in range(2000)}})
    assert len(wide) <= MAX_GRAMMAR_CHARS
    message = (f"^json_schema is not a valid JSON schema: it expands to a grammar of .* more than "
               f"{MAX_EXPANDED_GRAMMAR_CHARS}")
    with pytest.raises(ValueError, match=message):
        SamplingParams(json_schema=wide)
    with pytest.raises(ValueError, match=message):
        llama_engine.generate(prompt="The", sampling_params={"json_schema": wide})
    SamplingParams(json_schema=json.dumps({"enum": [f"v{i}" for i in range(4000)]}))


def test_forced_call_grammars_take_schemas_with_local_refs():
    """Tool parameters with `$defs` and local `$ref`s (as pydantic writes them: a nested model), in
    two tools whose definitions share a name: a forced call follows each function's own
    definitions (its references are not read against the schema built around it)."""
    from tide.server.function_call_parser import forced_call_grammar

    city = {"$defs": {"Place": {"type": "object", "properties": {
        "name": {"type": "string"}, "near": {"$ref": "#/$defs/Place"}}, "required": ["name"],
        "additionalProperties": False}}, "type": "object",
        "properties": {"city": {"$ref": "#/$defs/Place"}}, "required": ["city"]}
    zone = {"definitions": {"Place": {"type": "integer"}}, "type": "object",
            "properties": {"zone": {"$ref": "#/definitions/Place"}}, "required": ["zone"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "parameters": zone}}]
    weather = json.dumps({"name": "get_weather", "arguments": {
        "city": {"name": "Paris", "near": {"name": "Orly"}}}})
    time_call = json.dumps({"name": "get_time", "arguments": {"zone": 3}})
    required = forced_call_grammar("qwen25", tools, None)
    SamplingParams(ebnf=required)
    frame = "<tool_call>\n{}\n</tool_call>"
    assert _accepts(required, frame.format(weather)) and _accepts(required, frame.format(time_call))
    assert not _accepts(required, frame.format(weather.replace('"Orly"', "4")))
    assert not _accepts(required, frame.format(time_call.replace("3", '{"name": "x"}')))
    named = forced_call_grammar("llama3", tools, "get_weather")
    assert _accepts(named, weather.replace("arguments", "parameters"))
    assert not _accepts(named, time_call.replace("arguments", "parameters"))


def test_the_ambiguity_bound_counts_the_matchers_cpu_time_not_a_stalled_host():
    """A token the matcher follows slowly because the host paused the thread (sleeping here) is
    not counted against the grammar; one it spends the CPU time on is."""
    from tide.grammar import MAX_ACCEPT_S, RequestGrammar

    class Matcher:
        def __init__(self, busy: bool) -> None:
            self.busy = busy

        def accept_token(self, token: int) -> bool:
            wall, cpu = time.monotonic(), time.thread_time()
            if self.busy:  # spends the CPU time
                while time.thread_time() - cpu < MAX_ACCEPT_S * 1.5:
                    pass
            else:  # the thread is off the CPU as long
                time.sleep(MAX_ACCEPT_S * 1.5)
            assert time.monotonic() - wall > MAX_ACCEPT_S
            return True

    for busy, counted in ((False, 0), (True, 3)):
        grammar = RequestGrammar(Matcher(busy), vocab_size=64, filler=None)
        for _ in range(3):
            assert grammar.accept(1)
        assert grammar.slow_accepts == counted, (busy, grammar.last_accept_s)


def test_the_grammar_cache_is_bounded_by_bytes(llama_path, monkeypatch):
    """Compiled grammars are kept up to CACHE_MAX_BYTES of xgrammar's tables (least recently used
    dropped first), not only up to a count; a dropped text compiles again when asked for. A
    compile still running holds no bytes and is not dropped (it would run twice)."""
    import tide.grammar as grammar_module

    with tide.Engine(str(llama_path)) as engine:
        backend = engine.scheduler._grammar_compiler()
        real, release = backend._compile, threading.Event()

        def held(field, text):
            if text.startswith("held"):
                assert release.wait(60)
            return real(field, text)

        monkeypatch.setattr(backend, "_compile", held)
        deadline = time.monotonic() + 30  # sizes are counted by the compiles' done-callbacks

        def settle(keys: list[str], nbytes: int) -> None:
            def state() -> tuple:
                return [text for _, text in backend._cache], backend.cached_bytes

            while state() != (keys, nbytes) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state() == (keys, nbytes)

        texts = [f"item{i}[a-z]{{1,3000}}" for i in range(4)]
        size = backend.compile("regex", texts[0]).result().memory_size_bytes
        settle(texts[:1], size)
        assert size > 0
        monkeypatch.setattr(grammar_module, "CACHE_MAX_BYTES", int(size * 2.5))
        pending = backend.compile("regex", "held[a-z]")  # the least recently used from here on
        futures, sizes = [], []
        for i, text in enumerate(texts):  # one at a time: the evictions follow this order
            futures.append(backend.compile("regex", text))  # the first is a cache hit
            sizes.append(futures[-1].result().memory_size_bytes)
            kept = max(0, i - 1)  # two fit and three do not: the sizes are alike
            settle(["held[a-z]", *texts[kept:i + 1]], sum(sizes[kept:]))
        assert max(sizes) < 1.2 * min(sizes), sizes
        assert backend.compile("regex", "held[a-z]") is pending  # running: kept, not run twice
        assert backend.compile("regex", texts[3]) is futures[3]  # kept
        again = backend.compile("regex", texts[0])  # dropped: compiled anew
        assert again is not futures[0] and again.result().memory_size_bytes == sizes[0]
        release.set()
        assert pending.result().memory_size_bytes > 0
