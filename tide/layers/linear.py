"""Linear layers whose weights may be fused from several checkpoint tensors.

A fused parameter carries `shard_offsets`: shard id -> (row offset, row count). The weight loader writes
each checkpoint tensor into its rows; nothing else in tide needs to know about fusion.
"""

from __future__ import annotations

import torch
from torch import nn


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    # Set on every projection of an engine with `enable_deterministic_inference`: the product is then
    # computed by `tide.layers.batch_invariant.linear` (a row's result independent of the batch).
    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    @classmethod
    def tied(cls, weight: nn.Parameter) -> "Linear":
        """A bias-free projection that shares `weight` (tied word embeddings)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight = weight
        layer.bias = None
        return layer

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ b). With `out` (any float dtype), the result, rounded to the weight dtype,
        is written there and returned."""
        if self.batch_invariant:
            from tide.layers import batch_invariant

            y = batch_invariant.linear(x, self.weight, self.bias)
            return y if out is None else out.copy_(y)
        if x.is_cuda and x.shape[0] == 1:
            from tide.layers import gemv

            if gemv.supported(x, self.weight):
                return gemv.gemv(x, self.weight, self.bias, out=out)
        y = nn.functional.linear(x, self.weight, self.bias)
        return y if out is None else out.copy_(y)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim (qkv, gate_up)."""

    def __init__(self, in_features: int, shards: dict[str | int, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shards.items():
            offsets[shard_id] = (start, size)
            start += size
        self.weight.shard_offsets = offsets  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.shard_offsets = offsets  # type: ignore[attr-defined]
