from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """One layer's attention over the paged KV cache; the math lives in the batch's backend."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        """k/v None: the new K/V are already in the pool at `out_cache_loc` (fused store)."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
