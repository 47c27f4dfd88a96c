from tide.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama whose layers all attend within `sliding_window` when the config sets it (the layer
    kinds come from `ModelConfig.layer_kinds`)."""
