from __future__ import annotations

import importlib

from torch import nn

# architecture name -> "module:Class"; modules import lazily so one broken model never blocks others.
_MODELS: dict[str, str] = {
    "Gemma2ForCausalLM": "tide.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "tide.models.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "tide.models.gemma:Gemma3ForConditionalGeneration",
    "LlamaForCausalLM": "tide.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tide.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "tide.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "tide.models.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architectures {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    module_name, cls_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
