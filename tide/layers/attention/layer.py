from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tide.layers.norm import GemmaRMSNorm, RMSNorm
from tide.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch

HeadNorm = RMSNorm | GemmaRMSNorm


class Attention(nn.Module):
    """One layer's attention over the paged KV cache; storing the new K/V and the math live in the
    batch's backend. With a `rotary` table the layer takes q and k before RoPE, and the backend
    rotates them as it stores (the Triton backend fuses both into one launch).

    `sliding_window`: the query at position p sees only keys at positions p - sliding_window + 1 .. p
    (its own token counts, as in transformers); None attends to the whole sequence.
    `logit_cap`: scores (after scaling) go through cap * tanh(score / cap) before the causal/window
    mask and the softmax (Gemma-2's attention soft-capping); None leaves them as they are.
    `qk_norm`: (q norm, k norm), the RMSNorm of every q and k head (Qwen3, Gemma-3), applied before
    RoPE.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        layer_id: int,
        rotary: RotaryEmbedding | None = None,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
        qk_norm: tuple[HeadNorm, HeadNorm] | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
        if logit_cap is not None and not logit_cap > 0:
            raise ValueError(f"logit_cap must be positive, got {logit_cap!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        # Shared by every layer; a list keeps it out of this module's children and state dict.
        self._rotary = [rotary] if rotary is not None else []
        # Owned (and loaded) by the model's attention module; a list keeps them out of this one's.
        self._qk_norm: list[HeadNorm] = list(qk_norm) if qk_norm is not None else []

    @property
    def rotary(self) -> RotaryEmbedding | None:
        return self._rotary[0] if self._rotary else None

    @property
    def qk_norm(self) -> tuple[HeadNorm, HeadNorm] | None:
        """Per-head q and k norms (Qwen3, Gemma-3), which the backend applies before RoPE (the
        Triton backend inside its rope-and-store launch)."""
        return (self._qk_norm[0], self._qk_norm[1]) if self._qk_norm else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: "ForwardBatch",
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hk*D] of the batch's new tokens (`positions` [T]: their positions,
        needed with a rotary table); returns [T, Hq*D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, positions)
