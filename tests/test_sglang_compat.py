"""What sglang's clients send beyond the fields tide implements: `sampling_seed` (sglang's name for
`seed`), `spaces_between_special_tokens` (to the tokenizer's decode), and the request and sampling
fields of features tide does not have, accepted at the defaults such clients send and refused
(400 naming the field) otherwise."""

from __future__ import annotations

import httpx
import pytest
from tide.detokenizer import IncrementalDetokenizer
from tide.engine_io import make_output
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

from conftest import random_prompts
from server_utils import assert_error, running_server, serve_model_path

PROMPT = random_prompts(53, [9])[0]


def test_sampling_seed_is_the_seed(llama_engine):
    p = SamplingParams(sampling_seed=5)
    assert (p.seed, p.sampling_seed) == (5, None)
    assert SamplingParams(seed=5, sampling_seed=5).seed == 5
    with pytest.raises(ValueError, match="sampling_seed"):
        SamplingParams(seed=4, sampling_seed=5)
    for bad in (-1, "5", True, 2**63):
        with pytest.raises(ValueError, match="sampling_seed"):
            SamplingParams(sampling_seed=bad)
    drawn = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "n": 2}
    by_seed = llama_engine.generate(input_ids=PROMPT, sampling_params=drawn | {"seed": 11})
    by_name = llama_engine.generate(input_ids=PROMPT, sampling_params=drawn | {"sampling_seed": 11})
    assert [o["output_ids"] for o in by_name] == [o["output_ids"] for o in by_seed]
    assert by_seed[0]["output_ids"] != by_seed[1]["output_ids"]  # copy j draws with seed + j


class _Recording:
    """A tokenizer that records the keyword arguments of every decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[dict] = []

    def decode(self, ids, skip_special_tokens=False, **kwargs) -> str:
        self.calls.append(kwargs)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


def test_spaces_between_special_tokens_reaches_decode(llama_engine):
    """False goes to every decode of the request (the server's and the scheduler's decoder, the
    Python API's text); the default leaves transformers' own default to the tokenizer."""
    ids = llama_engine.generate(input_ids=PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})["output_ids"]
    for spaces, expected in ((False, [{"spaces_between_special_tokens": False}]), (True, [{}])):
        rec = _Recording(llama_engine.tokenizer)
        detok = IncrementalDetokenizer(rec, PROMPT, False, stop=["zz"],
                                       spaces_between_special_tokens=spaces)
        detok.add(ids[:3])
        detok.add(ids[3:])
        detok.finish()
        req = Req("r", list(PROMPT), SamplingParams(spaces_between_special_tokens=spaces,
                                                    skip_special_tokens=False),
                  output_ids=list(ids), finished_reason={"type": "length", "length": 8})
        out = make_output(req, rec, 0.0)
        assert rec.calls and all(c == expected[0] for c in rec.calls)
        assert out["text"] == detok.visible_text == llama_engine.tokenizer.decode(ids)
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


def test_unsupported_sampling_fields_are_taken_only_when_null():
    params = SamplingParams.from_dict({"json_schema": None, "regex": None, "ebnf": None,
                                       "stop_regex": None, "max_new_tokens": 3})
    assert params.max_new_tokens == 3
    for name, value in (("structural_tag", "{}"), ("stop_regex", "\\n"), ("custom_params", {})):
        with pytest.raises(ValueError, match=f"^{name} is not supported"):
            SamplingParams.from_dict({name: value})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = serve_model_path(tmp_path_factory.mktemp("serve-model"))
    with running_server(path, log_dir=tmp_path_factory.mktemp("server-log")) as srv:
        yield srv


SGLANG_CLIENT_FIELDS = {
    "image_data": None, "lora_path": None, "custom_logit_processor": None,
    "return_hidden_states": False, "session_params": None, "data_parallel_rank": None,
    "log_metrics": False, "input_embeds": None, "modalities": None, "token_ids_logprob": None,
    "return_routed_experts": False, "bootstrap_host": None, "priority": None,
}


def test_generate_takes_an_sglang_client_body(server):
    """An RL client's /generate body (token ids in, no stop trim, special tokens kept, sglang's
    seed name, its unused fields at their defaults) is served; the same fields asking for what
    tide does not do are a 400 naming them."""
    ids = httpx.post(server.url + "/generate", json={"text": "The quick brown fox",
                                                     "sampling_params": {"max_new_tokens": 0}},
                     timeout=60).json()
    assert ids["output_ids"] == []
    sampling = {"temperature": 1.0, "max_new_tokens": 8, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "no_stop_trim": True,
                "sampling_seed": 3, "json_schema": None, "regex": None}
    body = {"input_ids": [10, 11, 12, 13], "sampling_params": sampling, "return_logprob": True,
            **SGLANG_CLIENT_FIELDS}
    first = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert first.status_code == 200, first.text
    again = httpx.post(server.url + "/generate", json=body | {
        "sampling_params": {k: v for k, v in sampling.items() if k != "sampling_seed"} | {
            "seed": 3}}, timeout=60).json()
    assert first.json()["output_ids"] == again["output_ids"]  # sampling_seed is the seed
    assert len(first.json()["meta_info"]["output_token_logprobs"]) == 8
    for name, value in (("image_data", "http://x/a.png"), ("lora_path", "adapter"),
                        ("return_hidden_states", True), ("custom_logit_processor", "code"),
                        ("session_params", {"id": "s"}), ("data_parallel_rank", 0),
                        ("return_routed_experts", True)):
        resp = httpx.post(server.url + "/generate", json=body | {name: value}, timeout=60)
        err = assert_error(resp, 400, name)
        assert "not supported by tide" in err["message"]
    resp = httpx.post(server.url + "/generate", json=body | {
        "sampling_params": sampling | {"stop_regex": "[a-z]+"}}, timeout=60)
    assert_error(resp, 400, "sampling_params.stop_regex")
    resp = httpx.post(server.url + "/generate", json=body | {
        "sampling_params": sampling | {"seed": 4}}, timeout=60)
    assert_error(resp, 400, "sampling_params.sampling_seed")
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    reply = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": "The quick", "max_tokens": 4, "temperature": 0,
        "spaces_between_special_tokens": False, "no_stop_trim": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
