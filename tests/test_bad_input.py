"""Bad input raises ValueError naming the offending field, and leaves the engine usable."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import tide

OK = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def baseline(llama_engine):
    return llama_engine.generate(input_ids=[3, 4, 5], sampling_params=OK)["output_ids"]


def _still_works(engine, baseline) -> None:
    sched = engine.scheduler
    assert not sched.has_work(), "a rejected call left work queued"
    sched.check_invariants()
    out = engine.generate(input_ids=[3, 4, 5], sampling_params=OK)
    assert out["output_ids"] == baseline
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


@pytest.mark.parametrize(
    "params,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 3.0}, "max_new_tokens"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # logits / 0.0 in fp32: NaN
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [512]}, "stop_token_ids"),  # vocab is 512
        ({"stop_token_ids": [2**64 + 5]}, "stop_token_ids"),
        ({"top_k": 513}, "top_k"),
        ({"top_k": 2**63 + 5}, "top_k"),  # used to overflow in the sampler and abort the batch
        ({"max_new_tokens": 2**63}, "max_new_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"seed": 2**63}, "seed"),
        ({"stop": "\ud800"}, "stop"),
        ({"temprature": 0.5}, "temprature"),
        ({"not_a_param": 1}, "not_a_param"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),  # failed after generating
        ({"ignore_eos": "false"}, "ignore_eos"),  # a truthy string
    ],
)
def test_bad_sampling_params(llama_engine, baseline, params, match):
    # Whole-word match: "stop" must not be satisfied by "stop_token_ids", nor "n" by any word.
    with pytest.raises(ValueError, match=rf"\b{match}\b"):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params={**OK, **params})
    _still_works(llama_engine, baseline)


def test_unknown_sampling_param_is_named_among_allowed(llama_engine, baseline):
    with pytest.raises(ValueError, match=r"unknown sampling_params.*temprature") as info:
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params={"temprature": 0.5})
    assert "temperature" in str(info.value)  # the allowed names help spot the typo
    _still_works(llama_engine, baseline)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", "hot"),
                                          ("top_k", 0), ("max_new_tokens", -1),
                                          ("stop_token_ids", "x")])
def test_a_sampling_params_object_changed_after_construction_is_validated(
        llama_engine, baseline, field, value):
    """A `tide.SamplingParams` is checked as it is when passed, like the dict form (it was used
    as given: a negative temperature sampled, a string one aborted the request)."""
    params = tide.SamplingParams(**OK)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params=params)
    _still_works(llama_engine, baseline)


def test_a_stop_token_set_after_construction_is_honoured(llama_engine, baseline):
    params = tide.SamplingParams(**OK)
    params.stop_token_ids = [baseline[1]]
    out = llama_engine.generate(input_ids=[3, 4, 5], sampling_params=params)
    assert out["output_ids"] == baseline[:2]


def test_handover_calls_refuse_wrong_types(llama_engine, baseline):
    """A string where a flag belongs is truthy: "false" aborted every running request."""
    for call, kwargs, name in [
        (llama_engine.update_weight_version, {"new_version": "v2", "abort_all_requests": "false"},
         "abort_all_requests"),
        (llama_engine.continue_generation, {"torch_empty_cache": "no"}, "torch_empty_cache"),
        (llama_engine.flush_cache, {"empty_cache": "no"}, "empty_cache"),
        (llama_engine.release_memory_occupation, {"tags": 5}, "tags"),
        (llama_engine.resume_memory_occupation, {"tags": {"weights": 1}}, "tags"),
        (llama_engine.get_weights_by_name, {"name": 5}, "name"),
        (llama_engine.get_weights_by_name, {"name": "model.norm.weight", "truncate_size": "3"},
         "truncate_size"),
        (llama_engine.init_weights_update_group,
         {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
          "timeout": "3"}, "timeout"),
    ]:
        with pytest.raises(ValueError, match=name):
            call(**kwargs)
    _still_works(llama_engine, baseline)


def test_too_many_sequences_are_refused_before_any_request_exists(llama_engine, baseline):
    from tide.engine_io import MAX_SEQUENCES

    with pytest.raises(ValueError, match="^n: "):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params={**OK, "n": 2**31 - 1})
    with pytest.raises(ValueError, match="^n: "):
        llama_engine.generate(input_ids=[[3, 4]] * 2,
                              sampling_params={**OK, "n": MAX_SEQUENCES // 2 + 1})
    _still_works(llama_engine, baseline)


def test_bad_per_request_options(llama_engine, baseline):
    with pytest.raises(ValueError, match="return_logprob"):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params=OK, return_logprob="no")
    with pytest.raises(ValueError, match="rid"):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params=OK, rid=5)
    with pytest.raises(ValueError, match="rid values must be unique"):
        llama_engine.generate(input_ids=[[3, 4], [5, 6]], sampling_params=OK, rid=["a", "a"])
    with pytest.raises(ValueError, match=r"input_ids\.1 must be a list"):
        llama_engine.generate(input_ids=[[5, 6], 7], sampling_params=OK)
    _still_works(llama_engine, baseline)


def test_empty_prompt(llama_engine, baseline):
    with pytest.raises(ValueError, match="prompt"):
        llama_engine.generate(prompt="", sampling_params=OK)
    with pytest.raises(ValueError, match="prompt"):
        llama_engine.generate(prompt=["fine", ""], sampling_params=OK)
    with pytest.raises(ValueError, match="prompt"):
        llama_engine.generate(prompt=[], sampling_params=OK)
    _still_works(llama_engine, baseline)


def test_empty_or_bad_input_ids(llama_engine, baseline):
    with pytest.raises(ValueError, match="input_ids"):
        llama_engine.generate(input_ids=[], sampling_params=OK)
    with pytest.raises(ValueError, match="input_ids"):
        llama_engine.generate(input_ids=[[1, 2], []], sampling_params=OK)
    with pytest.raises(ValueError, match="input_ids"):
        llama_engine.generate(input_ids=[1, 512], sampling_params=OK)  # vocab is 512
    with pytest.raises(ValueError, match="input_ids"):
        llama_engine.generate(input_ids=[1, -1], sampling_params=OK)
    for bad in ([1, True], [1, 2.0], [1, "3"], [[1, 2], [3, None]], [1, 2**70]):
        with pytest.raises(ValueError, match=r"input_ids must be integers in \[0, 512\)"):
            llama_engine.generate(input_ids=bad, sampling_params=OK)
    with pytest.raises(ValueError, match="prompt|input_ids"):
        llama_engine.generate(sampling_params=OK)
    with pytest.raises(ValueError, match="prompt|input_ids"):
        llama_engine.generate(prompt="hi", input_ids=[1], sampling_params=OK)
    _still_works(llama_engine, baseline)


def test_over_context_length(llama_engine, baseline):
    ctx = llama_engine.context_len
    assert ctx == 512
    with pytest.raises(ValueError, match="max_new_tokens") as info:
        llama_engine.generate(input_ids=[7] * (ctx - 10), sampling_params={**OK, "max_new_tokens": 11})
    assert "context length" in str(info.value)
    with pytest.raises(ValueError, match="context length"):
        llama_engine.generate(input_ids=[7] * (ctx + 1), sampling_params={**OK, "max_new_tokens": 0})
    # Exactly at the limit is allowed.
    out = llama_engine.generate(input_ids=[7] * (ctx - 2), sampling_params={**OK, "max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    _still_works(llama_engine, baseline)


def test_over_kv_capacity(llama_path):
    engine = tide.Engine(str(llama_path), max_total_tokens=64)
    with pytest.raises(ValueError, match="max_total_tokens"):
        engine.generate(input_ids=[7] * 40, sampling_params={**OK, "max_new_tokens": 30})
    base = engine.generate(input_ids=[3, 4, 5], sampling_params=OK)["output_ids"]
    _still_works(engine, base)


def test_bad_item_rejects_whole_batch(llama_engine, baseline):
    stats_before = llama_engine.scheduler.stats.num_generated_tokens
    with pytest.raises(ValueError, match="top_p"):
        llama_engine.generate(
            input_ids=[[3, 4, 5], [6, 7, 8]],
            sampling_params=[OK, {**OK, "top_p": 0.0}],
        )
    assert llama_engine.scheduler.stats.num_generated_tokens == stats_before
    with pytest.raises(ValueError, match="sampling_params"):
        llama_engine.generate(input_ids=[[3, 4, 5], [6, 7, 8]], sampling_params=[OK])
    _still_works(llama_engine, baseline)


def test_tiny_temperature_is_greedy(llama_engine, baseline):
    """Below 1e-5 a temperature means greedy: 1e-300 used to overflow the logits to inf and
    return token 0 with logprob -9999."""
    for temp in (1e-300, 1e-6):
        out = llama_engine.generate(input_ids=[3, 4, 5], return_logprob=True,
                                    sampling_params={**OK, "temperature": temp})
        assert out["output_ids"] == baseline
        assert all(-50 < lp <= 0 for lp, _ in out["meta_info"]["output_token_logprobs"])
    _still_works(llama_engine, baseline)


def test_prompt_with_lone_surrogate(llama_engine, baseline):
    with pytest.raises(ValueError, match="prompt"):
        llama_engine.generate(prompt="hi \ud800", sampling_params=OK)
    _still_works(llama_engine, baseline)


def test_bad_top_logprobs_num(llama_engine, baseline):
    with pytest.raises(ValueError, match="top_logprobs_num"):
        llama_engine.generate(input_ids=[3, 4, 5], sampling_params=OK, top_logprobs_num=-1)
    _still_works(llama_engine, baseline)


# ---- engine construction


def test_unknown_engine_option(llama_path):
    with pytest.raises(ValueError, match="not_an_option"):
        tide.Engine(str(llama_path), not_an_option=1)


@pytest.mark.parametrize(
    "option,value",
    [
        ("max_total_tokens", 0),
        ("chunked_prefill_size", -8),
        ("max_running_requests", 0),
        ("mem_fraction_static", 1.5),
        ("dtype", "float64"),
        ("load_format", "pickle"),
        # types and ranges no field may slip through (each used to fail later, or not at all)
        ("seed", 1.5),  # every unseeded sampled request aborted
        ("seed", -1),
        ("seed", True),
        ("mem_fraction_static", "0.5"),
        ("swa_full_tokens_ratio", None),
        ("schedule_conservativeness", float("nan")),
        ("enable_deterministic_inference", "false"),  # a truthy string turned it on
        ("skip_tokenizer_init", "no"),
        ("log_level", "loud"),
        ("log_level", 3),
        ("device", "tpu"),
        ("device", "meta"),  # every request aborted at its first step
        ("attention_backend", "triton"),  # on CPU (no interpreter): every request aborted
        ("max_total_tokens", 10**12),  # a KV cache larger than the host, allocated
        ("tokenizer_path", "/nonexistent"),
        ("enable_cpu_backup", True),  # without enable_memory_saver
    ],
)
def test_bad_engine_option_values(llama_path, option, value):
    with pytest.raises(ValueError, match=option):
        tide.Engine(str(llama_path), **{option: value})


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        tide.Engine(str(tmp_path / "nope"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_unreadable_config_json_is_named(llama_path, tmp_path, text):
    path = _copy(llama_path, tmp_path / "m")
    (path / "config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(ValueError, match="config.json"):
        tide.Engine(str(path))


def test_path_objects_and_prompt_items_are_taken_or_named(llama_engine, baseline, llama_path):
    import pathlib

    with pytest.raises(ValueError, match="type int"):
        llama_engine.generate(prompt=["fine", 3], sampling_params=OK)
    out = llama_engine.update_weights_from_disk(pathlib.Path(llama_path))
    assert out["success"], out
    with pytest.raises(ValueError, match="model_path must be a path"):
        llama_engine.update_weights_from_disk(5)
    _still_works(llama_engine, baseline)


def test_unknown_architecture(llama_path, tmp_path):
    path = _copy(llama_path, tmp_path / "foo")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures") as info:
        tide.Engine(str(path))
    assert "FooForCausalLM" in str(info.value)


def _rewrite_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",  # a shard of the fused qkv_proj
        "model.layers.0.mlp.up_proj.weight",  # a shard of the fused gate_up_proj
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_weight(llama_path, tmp_path, name):
    path = _copy(llama_path, tmp_path / "missing")

    def drop(tensors):
        assert name in tensors
        del tensors[name]

    _rewrite_weights(path, drop)
    with pytest.raises(ValueError, match="missing") as info:
        tide.Engine(str(path))
    assert name in str(info.value)


def test_missing_weight_qwen2_bias(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.v_proj.bias"
    path = _copy(checkpoints["qwen2"], tmp_path / "nobias")
    _rewrite_weights(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        tide.Engine(str(path))
    assert name in str(info.value)


@pytest.mark.parametrize(
    "name,shape",
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 63)),
        ("model.layers.1.mlp.gate_proj.weight", (127, 64)),
        ("model.embed_tokens.weight", (511, 64)),
        ("model.layers.0.input_layernorm.weight", (65,)),
    ],
)
def test_weight_shape_mismatch(llama_path, tmp_path, name, shape):
    path = _copy(llama_path, tmp_path / "shape")
    _rewrite_weights(path, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ValueError, match="shape") as info:
        tide.Engine(str(path))
    assert name in str(info.value)


def test_unexpected_weight(llama_path, tmp_path):
    path = _copy(llama_path, tmp_path / "extra")
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.9.mlp.down_proj.weight", torch.zeros(64, 128)))
    with pytest.raises(ValueError, match=r"model\.layers\.9"):
        tide.Engine(str(path))


def test_no_weights_file(llama_path, tmp_path):
    path = _copy(llama_path, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        tide.Engine(str(path))


# ---- limits that must be rejected up front, not crash inside a step


def test_top_logprobs_num_over_vocab(llama_path):
    """More top logprobs than the vocabulary has must be a ValueError before anything is queued,
    not a torch error inside step() that leaves the request's KV and request slot allocated."""
    engine = tide.Engine(str(llama_path))  # own engine: a failure here must not poison others
    vocab = engine.model_config.vocab_size
    try:
        with pytest.raises(ValueError, match="top_logprobs_num"):
            engine.generate(input_ids=[3, 4, 5], sampling_params=OK, top_logprobs_num=vocab + 1)
    finally:
        engine.scheduler.check_invariants()  # no KV / request slot leaked either way
    out = engine.generate(input_ids=[3, 4, 5], sampling_params=OK, top_logprobs_num=vocab)
    assert all(len(top) == vocab for top in out["meta_info"]["output_top_logprobs"])


def test_context_length_beyond_model_positions(llama_path):
    """`context_length` above max_position_embeddings: either refused at construction (naming
    context_length) or long prompts work; never an IndexError in the middle of a forward."""
    try:
        engine = tide.Engine(str(llama_path), context_length=1024)
    except ValueError as exc:
        assert "context_length" in str(exc)
        return
    prompt = [7] * 600  # the checkpoint has max_position_embeddings = 512
    try:
        out = engine.generate(input_ids=prompt, sampling_params=OK)
    finally:
        engine.scheduler.check_invariants()
    assert len(out["output_ids"]) == 4


def test_context_length_option_limits_requests(llama_path):
    engine = tide.Engine(str(llama_path), context_length=64)
    assert engine.context_len == 64
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[7] * 60, sampling_params={**OK, "max_new_tokens": 5})
    out = engine.generate(input_ids=[7] * 60, sampling_params={**OK, "max_new_tokens": 4})
    assert len(out["output_ids"]) == 4
