"""Llama decoder (also the base of Qwen2 and Qwen3): fused qkv and gate_up, RoPE, paged attention.

The model never touches the KV pool: its attention layers hand q, k and v (before RoPE) to the batch's
attention backend, which rotates them, stores K/V and attends."""

from __future__ import annotations

import torch
from torch import nn

from tide.executor.forward_batch import ForwardBatch
from tide.layers.activation import gated_mlp_input
from tide.layers.attention.layer import Attention
from tide.layers.fp8 import QuantizedRows
from tide.layers.linear import (
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tide.layers.norm import RMSNorm
from tide.layers.rotary import RotaryEmbedding
from tide.model_config import ModelConfig
from tide.parallel import TpGroup, current_tp


def qkv_projection(config: ModelConfig, bias: bool) -> tuple[MergedLinear, int, int]:
    """The fused q/k/v projection of this rank, with its numbers of query and KV heads: query heads
    split evenly over the tensor-parallel ranks, KV heads too (or replicated when fewer than ranks)."""
    tp = current_tp()
    hd = config.head_dim
    q_start, heads = tp.split(config.num_attention_heads, "num_attention_heads")
    kv_start, kv_heads = tp.kv_heads(config.num_key_value_heads)
    q_full, kv_full = config.num_attention_heads * hd, config.num_key_value_heads * hd
    layer = MergedLinear(
        config.hidden_size, {"q": heads * hd, "k": kv_heads * hd, "v": kv_heads * hd}, bias,
        tp_slices={"q": (q_start * hd, q_full), "k": (kv_start * hd, kv_full),
                   "v": (kv_start * hd, kv_full)},
    )
    return layer, heads, kv_heads


def gate_up_projection(config: ModelConfig, bias: bool) -> MergedLinear:
    """The fused gate/up projection of this rank (the intermediate size split over the ranks)."""
    full = config.intermediate_size
    start, size = current_tp().split(full, "intermediate_size")
    return MergedLinear(config.hidden_size, {0: size, 1: size}, bias,
                        tp_slices={0: (start, full), 1: (start, full)})


def deferred_sum(config: ModelConfig) -> TpGroup | None:
    """The group whose sum the norms take over from o_proj and down_proj (fused with the residual
    add and the norm), or None where each projection sums its own output: one rank, or a
    projection bias (added after the sum)."""
    tp = current_tp()
    if tp.size == 1 or config.attention_bias or config.mlp_bias:
        return None
    return tp


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_projection(config, qkv_bias)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scaling, layer_id,
            rotary=rotary, sliding_window=config.layer_kind(layer_id).sliding_window,
            qk_norm=(self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None
            else None,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | QuantizedRows,
        forward_batch: ForwardBatch, reduce: bool = True,
    ) -> torch.Tensor:
        """`reduce=False`: this rank's partial o_proj product (see `DecoderLayer`)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The backend norms q and k per head (Qwen3), applies RoPE and stores k and v (one fused
        # launch on the GPU), then attends.
        return self.o_proj(self.attn(q, k, v, forward_batch, positions), reduce=reduce)


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_projection(config, config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias)

    def forward(self, x: torch.Tensor | QuantizedRows, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(gated_mlp_input(self.gate_up_proj, x, "silu", self.down_proj),
                              reduce=reduce)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, rotary, qkv_bias, qk_norm)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sum_in_norm = deferred_sum(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under tensor parallelism with `sum_in_norm`, the o_proj and down_proj outputs stay
        per-rank partial products, summed over the ranks by the norm after them (with the
        residual add, one launch on GPUs): `hidden` comes in and goes out as such a partial."""
        tp = self.sum_in_norm
        # With fp8 projections the norms hand their rows to qkv / gate_up already quantized.
        quantize = self.self_attn.qkv_proj.takes_fp8_rows(hidden)
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, quantize=quantize)
        else:
            normed, residual = self.input_layernorm(hidden, residual, tp, quantize=quantize)
        hidden = self.self_attn(positions, normed, forward_batch, reduce=tp is None)
        quantize = self.mlp.gate_up_proj.takes_fp8_rows(hidden)
        normed, residual = self.post_attention_layernorm(hidden, residual, tp, quantize=quantize)
        return self.mlp(normed, reduce=tp is None), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.sum_in_norm = deferred_sum(config)  # the last layer's down_proj sum, in the final norm
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary_emb, qkv_bias, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual, self.sum_in_norm)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror the HF checkpoint after fusion (see `tide.weights.mapping`)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(
            config, qkv_bias=self.qkv_bias or config.attention_bias, qk_norm=self.qk_norm
        )
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Logits of each request's last new token, [B, vocab]: fp32, or the model's dtype when
        written into `forward_batch.logits_out` (a decode graph's buffer). The hidden states of
        `forward_batch.score_rows` are kept in `forward_batch.scored_hidden` (input logprobs)."""
        hidden = self.model(input_ids, positions, forward_batch)
        forward_batch.keep_scored_hidden(hidden)
        hidden = hidden[forward_batch.last_token_indices()]
        out = forward_batch.logits_out
        if out is None:
            return self.compute_logits(hidden)
        return self.lm_head(hidden, out=out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of final hidden states (the last norm applied)."""
        return self.lm_head(hidden).float()
