from tide.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before RoPE."""

    qk_norm = True
