"""When a request may stop and what its text keeps.

`min_new_tokens` (sglang's name; `min_tokens` in the OpenAI routes): until a request has that many
tokens, the tokens that would end it get no probability and stop strings completed by then do not
count: no stop ends it before its min_new_tokens + 1-th token (vLLM's `min_tokens`).
`no_stop_trim` (sglang's name, in every route): the text keeps a matched stop string and what its
token decoded past it, or a matched stop token's text, which are left out by default (as sglang does).

Truth: HF transformers' `min_new_tokens` (its `MinNewTokensLengthLogitsProcessor`, which bans the
eos ids it is given) for tokens and logprobs; a hand-written scan of the unconstrained greedy text
for stop strings."""

from __future__ import annotations

import dataclasses
import random

import httpx
import pytest
import tide
import torch
from tide.detokenizer import IncrementalDetokenizer
from tide.layers.sampler import SamplingBatchInfo, edit_logits
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

from conftest import VOCAB, random_prompts
from server_utils import assert_error, running_server, serve_model_path
from test_overlap import _reqs as overlap_reqs
from test_overlap import _same as overlap_same

PROMPT = random_prompts(41, [12])[0]


@pytest.fixture(scope="module")
def demo_engine():
    """The built-in demo model (trained: its greedy text has words and spaces)."""
    with tide.Engine() as engine:
        yield engine


def test_min_new_tokens_is_checked():
    assert SamplingParams(min_new_tokens=5, max_new_tokens=5).min_new_tokens == 5
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(ValueError, match="min_new_tokens"):
            SamplingParams(min_new_tokens=bad)
    with pytest.raises(ValueError, match="min_new_tokens must be at most max_new_tokens"):
        SamplingParams(min_new_tokens=9, max_new_tokens=8)


def test_a_minimum_no_token_could_meet_is_a_value_error(llama_engine):
    """Ending ids covering the whole vocabulary (eos and stop_token_ids) with a minimum: no token
    could be drawn, so the request is refused up front, naming min_new_tokens."""
    rest = list(range(1, VOCAB))  # eos is 0
    with pytest.raises(ValueError, match="^min_new_tokens: every token of the vocabulary"):
        llama_engine.generate(prompt="The", sampling_params={
            "min_new_tokens": 2, "max_new_tokens": 4, "stop_token_ids": rest})
    with pytest.raises(ValueError, match="^min_new_tokens: every token"):
        SamplingParams(min_new_tokens=1, stop_token_ids=[0, 1, 2]).check_endings(3, [])
    SamplingParams(min_new_tokens=1, stop_token_ids=[1, 2]).check_endings(3, [])
    SamplingParams(min_new_tokens=1, ignore_eos=True, stop_token_ids=[1, 2]).check_endings(3, [0])
    out = llama_engine.generate(prompt="The", sampling_params={  # eos ignored: one token is left
        "min_new_tokens": 2, "max_new_tokens": 3, "stop_token_ids": rest, "ignore_eos": True,
        "temperature": 0})
    assert out["output_ids"][:2] == [0, 0]


def test_ending_tokens_are_banned_until_the_minimum():
    """The ban is -inf on the ending ids, first (a bias or penalty cannot lift it), while the
    row's output position (overlap's offset included) is below the minimum; argmax-only rows
    wait until it is reached."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0, min_new_tokens=3, logit_bias={1: 50.0},
                            repetition_penalty=1.5)
    info = SamplingBatchInfo([params], [[4, 4]], [[0]], [False], [0], ending_ids=[(1, 3)])
    out = edit_logits(logits, info)[0]
    assert out[1] == -torch.inf and out[3] == -torch.inf
    assert out[5] == 1.0 and out[2] == -1.0
    assert out[0] == pytest.approx(0.5 / 1.5)  # the prompt's token, penalised
    assert info.bans_endings(0)
    info = dataclasses.replace(info, output_offset=1)  # overlap: its third token is sampled now
    assert not info.bans_endings(0)
    assert edit_logits(logits, info)[0][1] == 3.0 + 50.0
    req = Req("r", [0], SamplingParams(temperature=0, min_new_tokens=2), output_ids=[4])
    req.ending_ids = (1,)
    assert not req.argmax_only
    req.output_ids.append(5)
    assert req.argmax_only
    free = Req("f", [0], SamplingParams(temperature=0, min_new_tokens=2, ignore_eos=True))
    assert free.argmax_only  # nothing would end it: nothing to ban, the graphs' argmax serves


def test_hf_min_new_tokens_parity(llama_engine, hf_model_for):
    """Greedy tokens and logprobs equal HF's `min_new_tokens` with the same ending ids; the ban
    matters on this prompt (the plain greedy output ends at its second token)."""
    model = hf_model_for("llama")
    plain = llama_engine.generate(input_ids=PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})["output_ids"]
    ending = [plain[1], plain[4]]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True,
              "stop_token_ids": ending}
    early = llama_engine.generate(input_ids=PROMPT, sampling_params=params)
    assert early["output_ids"] == plain[:2]
    out = llama_engine.generate(input_ids=PROMPT, return_logprob=True,
                                sampling_params=params | {"min_new_tokens": 6})
    got = out["output_ids"]
    assert len(got) >= 6 and not set(got[:6]) & set(ending)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=16, min_new_tokens=6, eos_token_id=ending,
                            pad_token_id=0)
    assert got == hf[0, len(PROMPT):].tolist()
    if got[-1] in ending:
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": got[-1]}
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + got[:-1]])).logits[0, len(PROMPT) - 1:].float()
    logits[:6, ending] = -torch.inf
    ref = torch.log_softmax(logits, dim=-1)[torch.arange(len(got)), torch.tensor(got)]
    lps = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(ref.tolist(), abs=1e-4)


def test_sampled_rows_never_end_before_the_minimum(llama_engine):
    """Drawn rows (seeded, in one batch with greedy ones) whose ending ids are half the
    vocabulary: each has at least `min_new_tokens` tokens, none of them ending ones, where
    without the minimum they end within a few tokens."""
    ending = list(range(VOCAB // 2))
    base = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True,
            "stop_token_ids": ending}
    prompts = random_prompts(43, [7, 11, 5, 9])
    params = [base | {"seed": i, "min_new_tokens": 10 + i} for i in range(3)]
    params.append({"temperature": 0, "max_new_tokens": 12, "ignore_eos": True,
                   "stop_token_ids": ending, "min_new_tokens": 12})
    outs = llama_engine.generate(input_ids=prompts, sampling_params=params)
    for p, out in zip(params, outs):
        ids = out["output_ids"]
        assert len(ids) >= p["min_new_tokens"]
        assert min(ids[:p["min_new_tokens"]]) >= VOCAB // 2
        if len(ids) < p["max_new_tokens"]:
            assert ids[-1] < VOCAB // 2  # it ended on an ending id, after the minimum
    without = llama_engine.generate(input_ids=prompts[:3], sampling_params=[
        base | {"seed": i} for i in range(3)])
    assert min(len(o["output_ids"]) for o in without) < 10


def test_overlap_schedule_gives_the_same_tokens(llama_path):
    """The overlap schedule (driven step by step on CPU, `test_overlap`'s harness) decides the ban
    with the token still on the device counted: the same tokens and logprobs as one step at a time,
    where some row ends on the very first token it may end on (a ban one step too long would show).
    Batch-invariant matmuls: a row that stops rides one extra step there."""
    ending = list(range(VOCAB // 2))
    params = [{"temperature": 0.8 * (i % 2), "seed": i, "max_new_tokens": 20,
               "ignore_eos": True, "stop_token_ids": ending, "min_new_tokens": 3 + i}
              for i in range(8)]
    prompts = random_prompts(47, [6, 13, 8, 4, 10, 7, 12, 5])
    with tide.Engine(str(llama_path), max_total_tokens=4096,
                     enable_deterministic_inference=True) as engine:
        out = overlap_same(engine, lambda: overlap_reqs(prompts, params, logprobs=True))
    at_first_chance = 0
    for p, (ids, _, _, logprobs, _) in zip(params, (out[f"r{i}"] for i in range(len(params)))):
        assert min(ids[:p["min_new_tokens"]]) >= VOCAB // 2 and len(logprobs) == len(ids)
        at_first_chance += len(ids) == p["min_new_tokens"] + 1 and ids[-1] < VOCAB // 2
    assert at_first_chance >= 1


def _expected_stop(tokenizer, ids: list[int], stops: list[str],
                   minimum: int) -> tuple[str, int] | None:
    """(text, token count) where the stop strings end a request with `min_new_tokens=minimum`, by a
    plain scan of the decoded prefixes: at the first token after the minimum whose text completes
    one (an occurrence that reaches into that token's text), the earliest such occurrence; None if
    there is none."""
    for j in range(minimum + 1, len(ids) + 1):
        before = len(tokenizer.decode(ids[:j - 1]))
        text = tokenizer.decode(ids[:j])
        found = [pos for stop in stops
                 if (pos := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if found:
            return text[:min(found)], j
    return None


def test_stop_strings_count_from_the_minimum(demo_engine):
    """A stop string completed by the `min_new_tokens`-th token is passed over, also beside a longer
    stop string; the first one completed after it ends the request, the text cut there. The minimum
    is the token that completes the first occurrence, so the request must pass it."""
    prompt = "The quick brown fox"
    plain = demo_engine.generate(prompt=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": 48, "ignore_eos": True})
    ids, text = plain["output_ids"], plain["text"]
    tokenizer = demo_engine.tokenizer
    stop = " the" if text.count(" the") >= 2 else max(set(text), key=text.count)
    assert text.count(stop) >= 2, text
    first_end = text.find(stop) + len(stop)
    minimum = next(j for j in range(1, len(ids) + 1)
                   if len(tokenizer.decode(ids[:j])) >= first_end)
    for stops in ([stop], [stop, "Z" * 30]):
        expected = _expected_stop(tokenizer, ids, stops, minimum)
        assert expected is not None and expected[1] > minimum, (text, stops, minimum)
        out = demo_engine.generate(prompt=prompt, sampling_params={
            "temperature": 0, "max_new_tokens": 48, "ignore_eos": True, "stop": stops,
            "min_new_tokens": minimum})
        assert (out["text"], len(out["output_ids"])) == expected, stops
        assert out["output_ids"] == ids[:expected[1]]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop in out["text"]  # the passed-over occurrence stays in the text
    early = demo_engine.generate(prompt=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": 48, "ignore_eos": True, "stop": stop})
    assert early["text"] == text[:text.find(stop)]


STOP_LISTS = ([" "], ["e"], [" the"], ["of", "Z" * 30], [" the", "e"], ["in", " nearest"])


def test_detokenizer_chunks_agree_with_tokens(demo_engine):
    """The server's decoder gets tokens in chunks; split anywhere, it finds the stop the
    scheduler's token-by-token decoder finds, for every minimum and stop lists of mixed lengths,
    and both find the plain scan's."""
    tokenizer = demo_engine.tokenizer
    prompt_ids = tokenizer.encode("In the beginning")
    ids = demo_engine.generate(input_ids=prompt_ids, sampling_params={
        "temperature": 0, "max_new_tokens": 40, "ignore_eos": True})["output_ids"]
    rng = random.Random(5)
    for stops in STOP_LISTS:
        for minimum in (0, 1, 2, 5, 9, 17, 40):
            one = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops, min_new_tokens=minimum)
            for t in ids:
                one.add([t])
            expected = _expected_stop(tokenizer, ids, stops, minimum)
            one_text = one.visible_text if one.stop_matched else None
            assert one_text == (expected[0] if expected else None), (stops, minimum)
            for _ in range(6):
                chunked = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops,
                                                 min_new_tokens=minimum)
                i = 0
                while i < len(ids):
                    n = rng.randint(1, 7)
                    chunked.add(ids[i:i + n])
                    i += n
                chunked.finish()
                assert (chunked.stop_matched, chunked.stop_pos) == (one.stop_matched,
                                                                    one.stop_pos)
                if one_text is not None:
                    assert chunked.visible_text == one_text


def test_eos_ids_past_the_vocabulary_are_not_banned(tmp_path):
    """A config's eos id outside the vocabulary names no token: requests with a minimum run."""
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path / "llama", "llama", eos_token_id=[1, VOCAB + 3])
    with tide.Engine(str(path)) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "min_new_tokens": 4})
    assert out["meta_info"]["finish_reason"]["type"] != "abort", out["meta_info"]
    assert len(out["output_ids"]) >= 4 and 1 not in out["output_ids"][:4]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = serve_model_path(tmp_path_factory.mktemp("serve-model"))
    with running_server(path, log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


def test_server_routes_take_the_minimum(server, demo_engine):
    """`min_tokens` in the OpenAI routes, `min_new_tokens` in /generate's sampling_params; a
    minimum above the output budget, or not a count, is a 400 naming the field."""
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12,
            "temperature": 0, "stop": [" "]}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert plain["usage"]["completion_tokens"] < 6, plain
    held = httpx.post(server.url + "/v1/completions", json=body | {"min_tokens": 6},
                      timeout=60).json()
    assert held["usage"]["completion_tokens"] > 6, held
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 0, "min_tokens": 8}
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 8, reply
    gen = httpx.post(server.url + "/generate", json={
        "text": "The quick brown fox", "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "stop": " ", "min_new_tokens": 6}},
        timeout=60).json()
    assert gen["meta_info"]["completion_tokens"] > 6, gen
    # The server's own decoder (whole and streamed) cuts where the Python API does.
    for stops in STOP_LISTS:
        params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True, "stop": stops,
                  "min_new_tokens": 9}
        want = demo_engine.generate(prompt="In the beginning", sampling_params=params)
        whole = httpx.post(server.url + "/generate", json={
            "text": "In the beginning", "sampling_params": params}, timeout=60).json()
        streamed, last = _stream_text(server.url, {"text": "In the beginning",
                                                   "sampling_params": params})
        assert whole["text"] == streamed == want["text"], stops
        assert whole["output_ids"] == last["output_ids"] == want["output_ids"], stops

    resp = httpx.post(server.url + "/v1/completions", json=body | {"min_tokens": 13}, timeout=60)
    assert_error(resp, 400, "min_tokens")
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json=chat | {"max_tokens": None, "max_completion_tokens": 4}, timeout=60)
    assert_error(resp, 400, "min_tokens")
    assert "max_completion_tokens" in resp.json()["error"]["message"]
    resp = httpx.post(server.url + "/v1/completions", json=body | {"min_tokens": -1}, timeout=60)
    assert_error(resp, 400, "min_tokens")
    for bad in (-1, "3", 13):
        resp = httpx.post(server.url + "/generate", json={
            "text": "x", "sampling_params": {"max_new_tokens": 12, "min_new_tokens": bad}},
            timeout=60)
        assert_error(resp, 400, "sampling_params.min_new_tokens")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def _stream_text(url: str, body: dict) -> tuple[str, dict]:
    """A /generate stream's text, put together from its cumulative events, and its last event."""
    import json

    resp = httpx.post(url + "/generate", json=body | {"stream": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # only ever appended to
    return texts[-1], events[-1]


def test_stop_text_is_trimmed_unless_no_stop_trim(demo_engine, server):
    """A matched stop token's text and a matched stop string stay out of the text by default and in
    it with `no_stop_trim`; `output_ids` keep the token either way. The Python API, /generate (whole
    and streamed: the server's own decoder) and /v1/completions agree."""
    prompt = "The quick brown fox"
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    ids = demo_engine.generate(prompt=prompt, sampling_params=greedy)["output_ids"]
    tokenizer = demo_engine.tokenizer
    token = ids[3]
    assert token not in ids[:3] and tokenizer.decode(ids[3:4]).strip()  # a token with text
    full = tokenizer.decode(ids)
    stop = next(s for s in (" the", " ", "e") if full.find(s, 1) > 0)
    cases = [
        ({"stop_token_ids": [token]}, tokenizer.decode(ids[:3]), 4),
        ({"stop_token_ids": [token], "no_stop_trim": True}, tokenizer.decode(ids[:4]), 4),
    ]
    cut = full.find(stop, 1)
    ends = next(j for j in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:j])) >= cut + len(stop))
    cases += [({"stop": stop}, full[:cut], ends),
              ({"stop": stop, "no_stop_trim": True}, tokenizer.decode(ids[:ends]), ends)]
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    for extra, text, count in cases:
        params = greedy | extra
        out = demo_engine.generate(prompt=prompt, sampling_params=params)
        assert (out["text"], out["output_ids"]) == (text, ids[:count]), extra
        gen = httpx.post(server.url + "/generate", json={
            "text": prompt, "sampling_params": params}, timeout=60).json()
        assert (gen["text"], gen["output_ids"]) == (text, ids[:count]), extra
        streamed, last = _stream_text(server.url, {"text": prompt, "sampling_params": params})
        assert streamed == text and last["output_ids"] == ids[:count], extra
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, **{k: v for k, v in extra.items()}}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == text, (extra, reply)
    resp = httpx.post(server.url + "/generate", json={
        "text": "x", "sampling_params": {"no_stop_trim": "yes"}}, timeout=60)
    assert_error(resp, 400, "sampling_params.no_stop_trim")


def test_python_text_cuts_a_stop_whose_character_the_minimum_splits(llama_engine):
    """min_new_tokens=2 ends inside "é" (two byte tokens): the second byte, the 3rd token, completes
    the stop string "é", so the scheduler's decoder (and the server's) end there and cut it; the
    Python API's text must be cut there too (it kept "é": "Xé" where the server sent "X")."""
    from tide.engine_io import make_output

    tokenizer = llama_engine.tokenizer
    ids = tokenizer.encode("Xéaa")
    e_acute = [t for t in ids if tokenizer.decode([t]) == "\ufffd"]
    assert len(e_acute) == 2, [tokenizer.decode([t]) for t in ids]  # "é" is two byte tokens
    prompt = tokenizer.encode("Hello")
    params = SamplingParams(stop=["é"], min_new_tokens=2, max_new_tokens=8)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=params.stop_strs, min_new_tokens=2)
    n = 0
    for t in ids:
        detok.add([t])
        n += 1
        if detok.stop_matched:
            break
    assert (detok.stop_matched, n, detok.visible_text) == ("é", 3, "X")
    req = Req(rid="r", origin_input_ids=prompt, sampling_params=params)
    req.output_ids = ids[:n]
    req.finished_reason = {"type": "stop", "matched": "é"}
    assert make_output(req, tokenizer, 0.0)["text"] == detok.visible_text == "X"
