from tide.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with a bias on the q/k/v projections."""

    qkv_bias = True
