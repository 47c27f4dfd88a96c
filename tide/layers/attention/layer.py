from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """One layer's attention over the paged KV cache; the math lives in the batch's backend.

    `sliding_window`: the query at position p sees only keys at positions p - sliding_window + 1 .. p
    (its own token counts, as in transformers); None attends to the whole sequence.
    `logit_cap`: scores (after scaling) go through cap * tanh(score / cap) before the causal/window
    mask and the softmax (Gemma-2's attention soft-capping); None leaves them as they are.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        layer_id: int,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        """k/v None: the new K/V are already in the pool at `out_cache_loc` (fused store)."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
