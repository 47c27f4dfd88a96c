"""The model facts tide needs, read from an HF `config.json` (and `generation_config.json`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model_path {model_path!r} has no config.json")
        with open(path) as f:
            hf = json.load(f)
        gen_path = os.path.join(model_path, "generation_config.json")
        gen: dict[str, Any] = {}
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf_dict(hf, gen)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None) -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json field 'architectures' is missing or empty")
        num_heads = _req(hf, "num_attention_heads")
        hidden = _req(hf, "hidden_size")
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope = hf.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
        eos: list[int] = []
        for source in (gen or {}, hf):
            value = source.get("eos_token_id")
            if value is None:
                continue
            for tok in value if isinstance(value, list) else [value]:
                if tok not in eos:
                    eos.append(int(tok))
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return cls(
            architecture=archs[0],
            vocab_size=_req(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(hf, "intermediate_size"),
            num_hidden_layers=_req(hf, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            checkpoint_dtype=_DTYPE_NAMES.get(str(dtype_name), torch.float32),
            eos_token_ids=tuple(eos),
            bos_token_id=(gen or {}).get("bos_token_id", hf.get("bos_token_id")),
            hf_config=hf,
        )


def _req(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json is missing required field {key!r}")
    return hf[key]
