"""The model facts tide needs, read from an HF `config.json` (and `generation_config.json`).

Layer kinds (full or sliding-window attention) come from the config, exactly as transformers derives
them per architecture (`layer_kinds_from_hf`); never from the model's name.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# transformers' legacy spelling of a full-attention layer.
_LAYER_TYPE_ALIASES = {"attention": FULL_ATTENTION}

# Architectures whose checkpoint holds a multimodal model: tide serves the text tower, read from the
# config's `text_config`.
TEXT_TOWER_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)

# transformers' class defaults for fields a Gemma config.json may leave out (real hub configs do: the
# Gemma-3 `text_config` omits vocab_size, rope bases, the window pattern...).
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 10000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "eos_token_id": 1, "bos_token_id": 2,
}
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "eos_token_id": 1, "bos_token_id": 2,
}
_GEMMA3_ROPE_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}
_GEMMA3_WINDOW_PATTERN = 6
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": _GEMMA2_DEFAULTS,
    "Gemma3ForCausalLM": _GEMMA3_DEFAULTS,
    "Gemma3ForConditionalGeneration": _GEMMA3_DEFAULTS,
}
_GEMMA_ARCHS = tuple(_ARCH_DEFAULTS)
# Where transformers applies the soft-caps (Gemma-3 reads attn_logit_softcapping but never applies
# it; Gemma3ForConditionalGeneration does not apply final_logit_softcapping): tide mirrors it.
_ATTN_SOFTCAP_ARCHS = ("Gemma2ForCausalLM",)
_FINAL_SOFTCAP_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_NULL_MEANS_OFF = ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window")
_GELU_ACTS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class LayerKind:
    """How one layer attends: to the whole sequence, or to a sliding window of the last
    `sliding_window` tokens, the query's own token included (transformers' convention: the query at
    position p sees keys at positions p - sliding_window + 1 .. p)."""

    attention_type: str = FULL_ATTENTION
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.attention_type == FULL_ATTENTION:
            if self.sliding_window is not None:
                raise ValueError("a full_attention layer has no sliding_window")
        elif self.attention_type == SLIDING_ATTENTION:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(
                    f"sliding_window must be a positive integer, got {self.sliding_window!r}"
                )
        else:
            raise ValueError(f"unknown attention_type {self.attention_type!r}")

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


@dataclass(frozen=True)
class RopeParams:
    theta: float
    scaling: dict[str, Any] | None  # None for the default (unscaled) rope


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # One entry per layer; empty means every layer is full attention.
    layer_kinds: tuple[LayerKind, ...] = ()
    # Rope of sliding layers where it differs from `rope_theta`/`rope_scaling` (Gemma-3's local base).
    sliding_rope: RopeParams | None = None
    hidden_act: str = "silu"
    # Attention scores are scaled by query_pre_attn_scalar**-0.5 when set (Gemma), else head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    # Soft-caps as the architecture applies them (None: off): attention scores, and final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.layer_kinds and len(self.layer_kinds) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_kinds)} entries for {self.num_hidden_layers} layers"
            )

    def layer_kind(self, layer_id: int) -> LayerKind:
        return self.layer_kinds[layer_id] if self.layer_kinds else LayerKind()

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k.is_sliding)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        sliding = set(self.sliding_layer_ids)
        return tuple(i for i in range(self.num_hidden_layers) if i not in sliding)

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any sliding layer (None when no layer slides)."""
        windows = [k.sliding_window for k in self.layer_kinds if k.sliding_window is not None]
        return max(windows) if windows else None

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.sliding_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        """Both full and sliding-window layers (what a two-pool KV cache pays off for)."""
        return bool(self.sliding_layer_ids) and bool(self.full_layer_ids)

    @property
    def attention_scaling(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    @classmethod
    def from_dir(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model_path {model_path!r} has no config.json")
        hf = _read_json(path)
        gen_path = os.path.join(model_path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        return cls.from_hf_dict(hf, gen)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None) -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json field 'architectures' is missing or empty")
        arch = archs[0]
        text = hf
        if arch in TEXT_TOWER_ARCHITECTURES:
            tower = hf.get("text_config")
            if not isinstance(tower, dict):
                raise ValueError(f"config.json of {arch} needs a 'text_config' object")
            text = tower
        # A missing (or null) field takes transformers' default for the architecture, except the
        # fields where an explicit null means "off".
        merged = {**_ARCH_DEFAULTS.get(arch, {}), **{k: v for k, v in text.items() if v is not None}}
        for key in _NULL_MEANS_OFF:
            if key in text and text[key] is None:
                merged[key] = None
        text = merged
        num_heads = _req(text, "num_attention_heads")
        hidden = _req(text, "hidden_size")
        num_layers = _req(text, "num_hidden_layers")
        head_dim = text.get("head_dim") or hidden // num_heads
        rope, sliding_rope = _rope_params(arch, text)
        eos: list[int] = []
        for source in (gen or {}, hf, text):
            value = source.get("eos_token_id")
            if value is None:
                continue
            for tok in value if isinstance(value, list) else [value]:
                if tok not in eos:
                    eos.append(int(tok))
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or text.get("dtype") or "float32"
        tie_source = hf if "tie_word_embeddings" in hf else text
        return cls(
            architecture=arch,
            vocab_size=_req(text, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(text, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            tie_word_embeddings=bool(tie_source.get("tie_word_embeddings", arch in _GEMMA_ARCHS)),
            attention_bias=bool(text.get("attention_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)),
            checkpoint_dtype=_DTYPE_NAMES.get(str(dtype_name), torch.float32),
            eos_token_ids=tuple(eos),
            bos_token_id=(gen or {}).get(
                "bos_token_id", hf.get("bos_token_id", text.get("bos_token_id"))
            ),
            layer_kinds=layer_kinds_from_hf(arch, text, num_layers),
            sliding_rope=sliding_rope,
            hidden_act=_hidden_act(arch, text),
            query_pre_attn_scalar=_opt_float(text, "query_pre_attn_scalar", arch in _GEMMA_ARCHS),
            attn_logit_softcapping=_opt_float(
                text, "attn_logit_softcapping", arch in _ATTN_SOFTCAP_ARCHS
            ),
            final_logit_softcapping=_opt_float(
                text, "final_logit_softcapping", arch in _FINAL_SOFTCAP_ARCHS
            ),
        )


def layer_kinds_from_hf(arch: str, text: dict[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    """Per-layer attention kinds as transformers derives them for `arch` (() if all are full).

    - Gemma-2: `layer_types`, else every other layer slides starting with layer 0.
    - Gemma-3: `layer_types`, else layer i slides unless (i + 1) % sliding_window_pattern == 0 (6).
    - Qwen2/Qwen3: the window applies only with `use_sliding_window`; `layer_types`, else layers
      i >= max_window_layers slide.
    - Mistral: a set `sliding_window` applies to every layer (transformers ignores `layer_types`).
    - Others (Llama): no sliding window; transformers ignores the field.
    """
    if arch in _GEMMA_ARCHS:
        if text.get("use_bidirectional_attention"):
            raise ValueError("config field 'use_bidirectional_attention' is not supported")
        window = text.get("sliding_window")
        if arch == "Gemma2ForCausalLM":
            default = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
        else:
            pattern = text.get("sliding_window_pattern", _GEMMA3_WINDOW_PATTERN)
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
            default = [
                SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
            ]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = text.get("sliding_window") if text.get("use_sliding_window") else None
        start = text.get("max_window_layers", 28)
        default = [
            SLIDING_ATTENTION if window is not None and i >= start else FULL_ATTENTION
            for i in range(num_layers)
        ]
    elif arch == "MistralForCausalLM":
        window = text.get("sliding_window")
        return _kinds([SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers,
                      window)
    else:
        return ()
    types = text.get("layer_types")
    if types is None:
        types = default
    elif not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(
            f"layer_types must be a list of {num_layers} entries (num_hidden_layers), got {types!r}"
        )
    return _kinds(types, window)


def _kinds(types: list[Any], window: Any) -> tuple[LayerKind, ...]:
    kinds = []
    for i, t in enumerate(types):
        t = _LAYER_TYPE_ALIASES.get(t, t)
        if t == FULL_ATTENTION:
            kinds.append(LayerKind())
        elif t == SLIDING_ATTENTION:
            if window is None:
                raise ValueError(
                    f"layer_types[{i}] is sliding_attention but sliding_window is not set "
                    "(for Qwen2/Qwen3 it applies only with use_sliding_window=true)"
                )
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
            kinds.append(LayerKind(SLIDING_ATTENTION, window))
        else:
            raise ValueError(
                f"layer_types[{i}] is {t!r}; supported: {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
    if all(not k.is_sliding for k in kinds):
        return ()
    return tuple(kinds)


def _rope_params(arch: str, text: dict[str, Any]) -> tuple[RopeParams, RopeParams | None]:
    """(rope of full layers, rope of sliding layers if different). transformers 5 keeps rope in
    `rope_parameters` (per layer type for Gemma-3); older configs use rope_theta / rope_scaling (and
    Gemma-3's rope_local_base_freq)."""
    params = text.get("rope_parameters") or {}
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        per_type = params if FULL_ATTENTION in params or SLIDING_ATTENTION in params else {}
        full = dict(per_type.get(FULL_ATTENTION) or {})
        if not per_type and text.get("rope_scaling"):
            full.update(text["rope_scaling"])  # legacy: rope_scaling applies to global layers only
        full.setdefault("rope_theta", text.get("rope_theta", _GEMMA3_ROPE_THETA[FULL_ATTENTION]))
        local = dict(per_type.get(SLIDING_ATTENTION) or {})
        local.setdefault(
            "rope_theta", text.get("rope_local_base_freq", _GEMMA3_ROPE_THETA[SLIDING_ATTENTION])
        )
        return _rope(full), _rope(local)
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    scaling = text.get("rope_scaling") or (params if params else None)
    return _rope({**(scaling or {}), "rope_theta": theta}), None


def _rope(params: dict[str, Any]) -> RopeParams:
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = rope_type
    return RopeParams(float(params["rope_theta"]), None if rope_type == "default" else scaling)


def _hidden_act(arch: str, text: dict[str, Any]) -> str:
    if arch in _GEMMA_ARCHS:
        act = text.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in _GELU_ACTS:
            raise ValueError(f"hidden_activation must be one of {_GELU_ACTS}, got {act!r}")
        return act
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' for {arch}, got {act!r}")
    return act


def _opt_float(text: dict[str, Any], key: str, applies: bool) -> float | None:
    value = text.get(key) if applies else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _req(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json is missing required field {key!r}")
    return hf[key]


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object file, or a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
