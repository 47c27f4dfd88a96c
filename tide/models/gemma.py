"""Gemma-2 and Gemma-3 decoders (and the text tower of a Gemma-3 multimodal checkpoint).

What sets them apart from Llama, each as transformers computes it:
- the token embedding is multiplied by sqrt(hidden_size), rounded to the model dtype first;
- RMSNorm scales by (1 + w), in fp32 (`GemmaRMSNorm`); every layer norms the attention output
  and the MLP input and output as well as the attention input ("sandwich" norms);
- attention scores scale by query_pre_attn_scalar**-0.5; the MLP is gated GELU (tanh approximation);
- per-layer kinds from the config: sliding-window layers see only the last `sliding_window` tokens;
- Gemma-2: attention scores and final logits are soft-capped (cap * tanh(x / cap));
- Gemma-3: per-head RMSNorm on q and k before rope, and sliding layers use their own rope base.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tide.executor.forward_batch import ForwardBatch
from tide.layers.activation import gated_mlp_input
from tide.layers.attention.layer import Attention
from tide.layers.linear import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tide.layers.norm import GemmaRMSNorm
from tide.layers.rotary import RotaryEmbedding
from tide.model_config import ModelConfig
from tide.models.llama import gate_up_projection, qkv_projection


class GemmaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qk_norm: bool
    ) -> None:
        super().__init__()
        bias = config.attention_bias
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_projection(config, bias)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # The backend applies RoPE as it stores k and v (one fused launch on the Triton backend).
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scaling, layer_id,
            rotary=rotary, sliding_window=config.layer_kind(layer_id).sliding_window,
            logit_cap=config.attn_logit_softcapping,
            qk_norm=(self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None
            else None,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q/k norms (Gemma-3) run inside the attention backend, before RoPE.
        return self.o_proj(self.attn(q, k, v, forward_batch, positions))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_projection(config, False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act = "gelu_tanh" if config.hidden_act == "gelu_pytorch_tanh" else "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_mlp_input(self.gate_up_proj, x, self.act, self.down_proj))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qk_norm: bool
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_id, rotary, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, normed: torch.Tensor,
        forward_batch: ForwardBatch, next_norm: GemmaRMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`normed`: `input_layernorm(hidden)`, computed by the layer before (fused with its
        residual add). Returns the residual stream and `next_norm` of it (the next layer's input
        norm, or the final norm)."""
        attn = self.self_attn(positions, normed, forward_batch)
        hidden, mlp_in = self.post_attention_layernorm.add_and_norm(
            attn, hidden, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_and_norm(self.mlp(mlp_in), hidden, next_norm)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) kept in fp32 and rounded to the activations' dtype when used (as transformers).
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32),
            persistent=False,
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        local = config.sliding_rope
        self.rotary_emb_local = (
            RotaryEmbedding(config.head_dim, config.max_position_embeddings, local.theta, local.scaling)
            if local is not None
            else self.rotary_emb
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                i,
                self.rotary_emb_local if config.layer_kind(i).is_sliding else self.rotary_emb,
                qk_norm,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        layers = self.layers
        normed = cast(GemmaDecoderLayer, layers[0]).input_layernorm(hidden)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            hidden, normed = layer(positions, hidden, normed, forward_batch, next_norm)
        return normed


class Gemma2ForCausalLM(nn.Module):
    """Parameter names mirror the HF checkpoint after fusion (see `tide.weights.mapping`)."""

    qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, qk_norm=self.qk_norm)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tied)
        self.final_logit_cap = config.final_logit_softcapping

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Logits of each request's last new token, [B, vocab]: fp32, or the model's dtype when
        written into `forward_batch.logits_out` (a decode graph's buffer). The hidden states of
        `forward_batch.score_rows` are kept in `forward_batch.scored_hidden` (input logprobs)."""
        hidden = self.model(input_ids, positions, forward_batch)
        forward_batch.keep_scored_hidden(hidden)
        hidden = hidden[forward_batch.last_token_indices()]
        cap = self.final_logit_cap
        out = forward_batch.logits_out
        if out is None:
            return self.compute_logits(hidden)
        logits = self.lm_head(hidden, out=out)  # model-dtype values in the graphs' buffer
        if cap is not None:  # capped in the model dtype too, so a graph replay equals eager
            logits.copy_(torch.tanh(logits.to(hidden.dtype) / cap) * cap)
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of final hidden states, soft-capped in the model dtype as
        transformers does."""
        logits = self.lm_head(hidden)
        if self.final_logit_cap is not None:
            logits = torch.tanh(logits / self.final_logit_cap) * self.final_logit_cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma-2 plus q/k RMSNorm; sliding layers use the local rope base (`sliding_rope`)."""

    qk_norm = True


# Checkpoint names of a Gemma3ForConditionalGeneration: transformers 5 keeps the text tower under
# `model.language_model.` in memory and writes it as `language_model.model.` on disk.
_TEXT_TOWER_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text tower of a Gemma-3 multimodal checkpoint (config from its `text_config`); vision
    weights are ignored. As in transformers, this head applies no final logit soft-capping."""

    @staticmethod
    def map_checkpoint_name(name: str) -> str | None:
        """Checkpoint name -> parameter name; None for weights tide does not serve (vision)."""
        for prefix, replacement in _TEXT_TOWER_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        if name.startswith(_VISION_PREFIXES):
            return None
        return name
