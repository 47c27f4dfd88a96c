"""`skip_tokenizer_init=True` (sglang's name): an engine on a checkpoint without tokenizer files takes
token ids and returns token ids; text prompts and stop strings are a ValueError naming the field.
(The server side is in tests/test_server_security.py.)"""

from __future__ import annotations

import pytest

import tide

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22]]


@pytest.fixture(scope="module")
def ids_engine(no_tokenizer_checkpoint):
    engine = tide.Engine(str(no_tokenizer_checkpoint), skip_tokenizer_init=True)
    yield engine
    engine.shutdown()


def test_generates_ids_without_tokenizer_files(ids_engine, llama_engine):
    assert ids_engine.tokenizer is None and ids_engine.config.skip_tokenizer_init
    outs = ids_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    # Same weights with a tokenizer: the same tokens.
    want = llama_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    for out in outs:
        assert set(out) == {"output_ids", "meta_info"}  # no text, as sglang
        assert len(out["output_ids"]) == 8 and out["meta_info"]["completion_tokens"] == 8
    single = ids_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert single["output_ids"] == outs[0]["output_ids"]


def test_stop_token_ids_work_without_a_tokenizer(ids_engine):
    first = ids_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    stop = first[2]
    out = ids_engine.generate(input_ids=PROMPTS[0], sampling_params={
        **GREEDY, "stop_token_ids": [stop], "ignore_eos": False})
    assert out["output_ids"][-1] == stop and len(out["output_ids"]) == first.index(stop) + 1


def test_text_inputs_are_value_errors(ids_engine):
    with pytest.raises(ValueError, match="prompt needs a tokenizer.*skip_tokenizer_init=True"):
        ids_engine.generate(prompt="hello", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="prompt needs a tokenizer"):
        ids_engine.generate(prompt=["a", "b"], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        ids_engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop": "x"})
    with pytest.raises(ValueError, match="stop strings"):
        ids_engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY, {**GREEDY, "stop": ["y"]}])
    # Nothing was left behind by the refused calls.
    assert not ids_engine.scheduler.has_work()


def test_missing_tokenizer_files_name_the_option(no_tokenizer_checkpoint):
    with pytest.raises(ValueError, match="no tokenizer files.*skip_tokenizer_init=True"):
        tide.Engine(str(no_tokenizer_checkpoint))


def test_tokenizer_path_without_files_names_tokenizer_path(no_tokenizer_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"^tokenizer_path .*no tokenizer files"):
        tide.Engine(str(no_tokenizer_checkpoint), tokenizer_path=str(tmp_path))
