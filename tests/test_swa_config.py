"""Layer kinds, rope and soft-caps read from configs exactly as transformers derives them; attention
backend selection for windowed models; Gemma weight names at real shapes (meta device, no memory)."""

from __future__ import annotations

import json

import pytest
import torch

from tide.layers.attention import base as attn_base
from tide.layers.attention import select_attention_backend
from tide.layers.attention.torch_native import TorchNativeAttnBackend
from tide.model_config import ModelConfig

_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)

# Hub-style configs: real Gemma checkpoints leave many fields to the class defaults.
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000, "eos_token_id": 1,
    "bos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
}
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
    "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {
        "head_dim": 256, "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
        "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type":
        "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
        "vision_use_head": False,
    },
}


def _windows(mc: ModelConfig) -> list[int | None]:
    return [mc.layer_kind(i).sliding_window for i in range(mc.num_hidden_layers)]


def _hf_windows(config) -> list[int | None]:
    return [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]


# ---- derivation of layer kinds, compared with transformers' own config classes


@pytest.mark.parametrize("layers", [1, 5, 8])
def test_gemma2_default_layer_kinds_match_transformers(layers):
    import transformers

    d = dict(_TINY, num_hidden_layers=layers, sliding_window=16)
    mc = ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"], **d})
    assert _windows(mc) == _hf_windows(transformers.Gemma2Config(**d))
    assert _windows(mc)[0] == 16  # layer 0 slides


@pytest.mark.parametrize("layers,pattern", [(13, None), (7, 3), (4, 1), (6, 6)])
def test_gemma3_pattern_layer_kinds_match_transformers(layers, pattern):
    import transformers

    d = dict(_TINY, num_hidden_layers=layers, sliding_window=32)
    if pattern is not None:
        d["sliding_window_pattern"] = pattern
    mc = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForCausalLM"], **d})
    assert _windows(mc) == _hf_windows(transformers.Gemma3TextConfig(**d))


@pytest.mark.parametrize(
    "use,window,start,layers",
    [(False, 4096, 1, 4), (True, 16, 2, 4), (True, 16, 0, 3), (True, 16, 28, 4), (True, None, 0, 2)],
)
def test_qwen2_sliding_window_matches_transformers(use, window, start, layers):
    import transformers

    d = dict(_TINY, num_hidden_layers=layers, use_sliding_window=use, sliding_window=window,
             max_window_layers=start)
    hf = transformers.Qwen2Config(**d)
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        mc = ModelConfig.from_hf_dict({"architectures": [arch], **d})
        assert _windows(mc) == _hf_windows(hf), arch
    # The config transformers writes (layer_types included) reads back the same.
    saved = {**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    assert _windows(ModelConfig.from_hf_dict(saved)) == _hf_windows(hf)


def test_mistral_window_applies_to_every_layer_and_llama_ignores_it():
    d = dict(_TINY, num_hidden_layers=3, sliding_window=16)
    assert _windows(ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **d})) == [16] * 3
    none = dict(d, sliding_window=None)
    mc = ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **none})
    assert not mc.has_sliding_layers and mc.layer_kinds == ()
    llama = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **d})
    assert not llama.has_sliding_layers  # transformers' Llama has no sliding window


def test_hub_gemma2_config_defaults():
    mc = ModelConfig.from_hf_dict(GEMMA2_9B)
    assert _windows(mc) == [4096 if i % 2 == 0 else None for i in range(42)]
    assert mc.is_hybrid and mc.sliding_window == 4096
    assert mc.tie_word_embeddings is True  # Gemma's default; the hub config leaves it out
    assert mc.attn_logit_softcapping == 50.0 and mc.final_logit_softcapping == 30.0
    assert mc.attention_scaling == 256**-0.5
    assert mc.hidden_act == "gelu_pytorch_tanh" and mc.sliding_rope is None
    assert mc.rope_theta == 10000.0 and mc.rope_scaling is None


def test_hub_gemma3_multimodal_config_reads_the_text_tower():
    import transformers

    mc = ModelConfig.from_hf_dict(GEMMA3_12B)
    hf = transformers.Gemma3TextConfig(**GEMMA3_12B["text_config"])
    assert mc.vocab_size == hf.vocab_size == 262208  # class default
    assert _windows(mc) == _hf_windows(hf)
    assert mc.full_layer_ids == tuple(range(5, 48, 6))
    assert mc.max_position_embeddings == hf.max_position_embeddings
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert mc.rope_theta == full["rope_theta"] == 1e6
    assert mc.rope_scaling == {"rope_type": "linear", "factor": 8.0} and full["factor"] == 8.0
    assert mc.sliding_rope is not None and mc.sliding_rope.theta == local["rope_theta"] == 1e4
    assert mc.sliding_rope.scaling is None and local["rope_type"] == "default"
    assert mc.attention_scaling == hf.query_pre_attn_scalar**-0.5
    assert mc.tie_word_embeddings is True and mc.checkpoint_dtype == torch.bfloat16
    assert mc.eos_token_ids == (1, 106)
    assert mc.final_logit_softcapping is None and mc.attn_logit_softcapping is None


def test_gemma3_rope_parameters_per_layer_type_and_legacy_fields():
    import transformers

    legacy = dict(_TINY, num_hidden_layers=2, rope_theta=5000.0, rope_local_base_freq=77.0,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf = transformers.Gemma3TextConfig(**legacy)
    for d in (legacy, hf.to_dict()):
        mc = ModelConfig.from_hf_dict({**d, "architectures": ["Gemma3ForCausalLM"]})
        assert mc.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 5000.0
        assert mc.rope_scaling == {"rope_type": "linear", "factor": 4.0}
        assert mc.sliding_rope.theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 77.0


def test_gemma3_ignores_attention_softcap_like_transformers():
    d = dict(_TINY, num_hidden_layers=2, attn_logit_softcapping=20.0, final_logit_softcapping=9.0)
    mc = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForCausalLM"], **d})
    assert mc.attn_logit_softcapping is None  # Gemma3Attention never passes it to attention
    assert mc.final_logit_softcapping == 9.0
    g2 = ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"], **d,
                                   "final_logit_softcapping": None})
    assert g2.attn_logit_softcapping == 20.0 and g2.final_logit_softcapping is None


@pytest.mark.parametrize(
    "arch,extra,field",
    [
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 16,
                              "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
        ("Gemma2ForCausalLM", {"layer_types": ["full_attention"]}, "layer_types"),
        ("Gemma2ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
        ("Gemma3ForCausalLM", {"sliding_window": 0}, "sliding_window"),
        ("Gemma3ForCausalLM", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("Gemma2ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation"),
        ("Gemma2ForCausalLM", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Gemma3ForConditionalGeneration", {}, "text_config"),
    ],
)
def test_bad_window_configs_are_rejected_naming_the_field(arch, extra, field):
    d = {"architectures": [arch], **_TINY, "num_hidden_layers": 2, **extra}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(d)


# ---- attention backend selection


class _NoWindowBackend(attn_base.AttentionBackend):
    supports_cuda_graph = True


class _WindowBackend(attn_base.AttentionBackend):
    supports_sliding_window = True
    supports_logit_cap = True


def test_backend_selection_never_runs_windows_on_a_backend_without_them(monkeypatch):
    monkeypatch.setitem(attn_base._REGISTRY, "triton", _NoWindowBackend)
    llama = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **_TINY,
                                      "num_hidden_layers": 2})
    gemma2 = ModelConfig.from_hf_dict(GEMMA2_9B)
    gemma3 = ModelConfig.from_hf_dict(GEMMA3_12B)
    assert select_attention_backend("auto", "cuda", llama) is _NoWindowBackend
    assert select_attention_backend("auto", "cpu", llama) is TorchNativeAttnBackend
    for mc in (gemma2, gemma3):
        assert select_attention_backend("auto", "cuda", mc) is TorchNativeAttnBackend
        assert select_attention_backend("torch_native", "cuda", mc) is TorchNativeAttnBackend
        with pytest.raises(ValueError, match="sliding-window") as err:
            select_attention_backend("triton", "cuda", mc)
        assert "torch_native" in str(err.value)
    with pytest.raises(ValueError, match="soft-capping"):
        select_attention_backend("triton", "cuda", gemma2)
    # Soft-capping alone (no window) also needs support.
    capped = ModelConfig.from_hf_dict({**GEMMA2_9B, "layer_types": ["full_attention"] * 42})
    assert not capped.has_sliding_layers
    assert select_attention_backend("auto", "cuda", capped) is TorchNativeAttnBackend
    # Once a backend implements both, auto takes it for windowed models too.
    monkeypatch.setitem(attn_base._REGISTRY, "triton", _WindowBackend)
    assert select_attention_backend("auto", "cuda", gemma2) is _WindowBackend


class _Fp8NewGpuBackend(attn_base.AttentionBackend):
    supports_cuda_graph = True
    fp8_kv_min_capability = (8, 9)


def test_backend_selection_keeps_an_fp8_cache_off_gpus_too_old_for_the_kernels(monkeypatch):
    """An fp8 KV cache on a GPU older than the triton kernels' fp8 needs (an A100 is 8.0): auto
    takes torch_native, triton by name is refused naming kv_cache_dtype; on 8.9 and 9.0, and
    without an fp8 cache, triton stays."""
    monkeypatch.setitem(attn_base._REGISTRY, "triton", _Fp8NewGpuBackend)
    llama = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **_TINY,
                                      "num_hidden_layers": 2})
    assert select_attention_backend("auto", "cuda", llama, (8, 0)) is TorchNativeAttnBackend
    assert select_attention_backend("torch_native", "cuda", llama, (8, 0)) is TorchNativeAttnBackend
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*compute capability 8\.9.*this one is 8\.0"):
        select_attention_backend("triton", "cuda", llama, (8, 0))
    for capability in ((8, 9), (9, 0), (10, 0)):
        assert select_attention_backend("auto", "cuda", llama, capability) is _Fp8NewGpuBackend
        assert select_attention_backend("triton", "cuda", llama, capability) is _Fp8NewGpuBackend
    assert select_attention_backend("auto", "cuda", llama, None) is _Fp8NewGpuBackend
    assert select_attention_backend("triton", "cuda", llama) is _Fp8NewGpuBackend


def test_triton_backend_states_its_fp8_capability():
    pytest.importorskip("triton")
    from tide.layers.attention.triton_backend import TritonAttnBackend

    assert TritonAttnBackend.fp8_kv_min_capability == (8, 9)


# ---- weight names at real shapes


def _hf_on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _tide_on_meta(mc: ModelConfig):
    from tide.models import get_model_class

    with torch.device("meta"):
        return get_model_class(mc.architecture)(mc)


def test_gemma2_9b_names_and_shapes_plan_completely():
    import transformers

    from tide.weights import WeightMap

    hf = _hf_on_meta(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**GEMMA2_9B))
    model = _tide_on_meta(ModelConfig.from_hf_dict(GEMMA2_9B))
    names = [(n, tuple(p.shape), torch.bfloat16) for n, p in hf.named_parameters()]
    targets = WeightMap(model).plan(names, require_complete=True)
    assert len(targets) == len(names) == 1 + 42 * 11 + 1
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert tuple(qkv.shape) == ((16 + 2 * 8) * 256, 3584)


def test_gemma3_12b_text_tower_names_plan_completely_and_ignore_vision():
    import transformers

    from tide.weights import WeightMap

    hf_config = transformers.Gemma3Config(
        text_config=GEMMA3_12B["text_config"], vision_config=GEMMA3_12B["vision_config"]
    )
    hf = _hf_on_meta(transformers.Gemma3ForConditionalGeneration, hf_config)
    model = _tide_on_meta(ModelConfig.from_hf_dict(GEMMA3_12B))
    names = [(n, tuple(p.shape), torch.bfloat16) for n, p in hf.named_parameters()]
    assert any(n.startswith("model.vision_tower.") for n, _, _ in names)
    weight_map = WeightMap(model)
    targets = weight_map.plan(names, require_complete=True)
    assert all(not t.name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
               for t in targets)
    assert {t.param_name for t in targets} == set(weight_map.params)
    # The on-disk (legacy) layout of the same weights resolves to the same parameters.
    legacy = weight_map.resolve("language_model.model.layers.3.self_attn.k_proj.weight")
    assert legacy is not None and legacy.param_name == "model.layers.3.self_attn.qkv_proj.weight"
    assert weight_map.resolve("vision_tower.vision_model.post_layernorm.weight") is None
    assert weight_map.resolve("language_model.lm_head.weight") is None  # tied
    # Two names for one parameter in one update are refused, naming both.
    with pytest.raises(ValueError, match="both map to"):
        weight_map.plan([
            ("model.language_model.norm.weight", (3840,), torch.bfloat16),
            ("language_model.model.norm.weight", (3840,), torch.bfloat16),
        ])


def test_dummy_load_runs_gemma(tmp_path):
    """load_format="dummy": random weights at the config's shapes; Gemma norms start at 0 (their
    identity) and the engine generates finite logprobs."""
    import tide

    d = dict(_TINY, num_hidden_layers=3, sliding_window=4, sliding_window_pattern=3,
             architectures=["Gemma3ForCausalLM"], max_position_embeddings=256, eos_token_id=0)
    (tmp_path / "config.json").write_text(json.dumps(d))
    engine = tide.Engine(str(tmp_path), load_format="dummy")
    try:
        model = engine.model_runner.model
        assert torch.count_nonzero(model.model.layers[0].post_feedforward_layernorm.weight) == 0
        assert model.model.layers[2].self_attn.attn.sliding_window is None
        out = engine.generate(input_ids=list(range(2, 14)), return_logprob=True,
                              sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
        assert len(out["output_ids"]) == 6
        assert all(torch.isfinite(torch.tensor(lp)) for lp, _ in out["meta_info"]["output_token_logprobs"])
    finally:
        engine.shutdown()
