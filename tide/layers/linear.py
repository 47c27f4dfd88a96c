"""Linear layers whose weights may be fused from several checkpoint tensors, and split over the
ranks of a tensor-parallel group.

A fused parameter carries `shard_offsets`: shard id -> (row offset, row count). The weight loader writes
each checkpoint tensor into its rows; nothing else in tide needs to know about fusion.

Under tensor parallelism (`tide.parallel.tp_context`) a parameter that holds only part of a checkpoint
tensor carries `tp_split`: shard id (None for an unfused parameter) -> (dim, start, size, full): this
rank holds `[start, start + size)` of the checkpoint tensor's `full` entries along `dim`. The weight
map narrows every incoming tensor by it, so all load and update paths shard the same way.
Column-parallel layers (`MergedLinear` with `tp_slices`) need no communication; `RowParallelLinear`
sums its partial products with one all-reduce; the vocabulary is split over the ranks
(`VocabParallelEmbedding`, one all-reduce; `ParallelLMHead`, one all-gather of the logits).
"""

from __future__ import annotations

import torch
from torch import nn

from tide.layers.fp8 import QuantizedRows
from tide.parallel.group import current_tp


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
        # With `use_fp8()`: the weight's fp8 rows and their scales (1, out_features), derived from
        # `weight` by `requantize()` (see tide.layers.fp8).
        self.weight_fp8: nn.Parameter | None = None
        self.weight_scale: nn.Parameter | None = None

    def use_fp8(self) -> None:
        """Run this projection's products in fp8 from now on (`tide.layers.fp8`)."""
        from tide.layers import fp8

        out_features, in_features = self.weight.shape
        if not fp8.supports(in_features, out_features):
            raise ValueError(f"a {out_features} x {in_features} projection cannot run in fp8 "
                             "(dims must be multiples of 16)")
        device = self.weight.device
        self.weight_fp8 = nn.Parameter(
            torch.empty(out_features, in_features, dtype=fp8.FP8, device=device),
            requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(1, out_features, dtype=torch.float32, device=device), requires_grad=False)
        for derived in (self.weight_fp8, self.weight_scale):
            derived.derived = True  # type: ignore[attr-defined]
        self.requantize()

    def requantize(self) -> None:
        """Refill the fp8 weight and its scales from `weight`, in place (addresses kept)."""
        from tide.layers import fp8

        if self.weight_fp8 is None or self.weight_scale is None:
            return
        fp8.quantize_rows(self.weight.data, out=self.weight_fp8.data,
                          scale=self.weight_scale.data.view(-1, 1))

    def forward(self, x: torch.Tensor | QuantizedRows,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ b). With `out` (any float dtype), the result, rounded to the weight dtype
        (x's dtype for an fp8 projection), is written there and returned. `x` may come as fp8
        rows where `takes_fp8_rows` said so."""
        return self.product(x, self.bias, out)

    def product(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ `bias`), by the batch-invariant kernel, the fp8 product, the decode GEMV or
        torch."""
        if isinstance(x, QuantizedRows):
            if self.weight_fp8 is None or self.weight_scale is None:
                raise ValueError("fp8 rows reach a projection that does not run in fp8")
            from tide.layers import fp8

            y = fp8.linear(x, self.weight_fp8, self.weight_scale, bias)
            return y if out is None else out.copy_(y)
        if self.batch_invariant:
            from tide.layers import batch_invariant

            y = batch_invariant.linear(x, self.weight, bias)
            return y if out is None else out.copy_(y)
        if self.uses_gemv(x):
            from tide.layers import gemv

            weight, scale = self.gemv_operands()
            return gemv.gemv(x, weight, bias, out=out, scale=scale)
        if self.weight_fp8 is not None and self.weight_scale is not None:
            from tide.layers import fp8

            y = fp8.linear(x, self.weight_fp8, self.weight_scale, bias)
            return y if out is None else out.copy_(y)
        if (out is not None and bias is None and x.dim() == 2 and out.is_contiguous()
                and out.dtype == x.dtype == self.weight.dtype):
            return torch.mm(x, self.weight.t(), out=out)  # straight into `out`, no copy
        y = nn.functional.linear(x, self.weight, bias)
        return y if out is None else out.copy_(y)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether the product of the 2-D rows `x` quantizes them to fp8 first: then the kernel
        that computes `x` may hand them over as `QuantizedRows` instead (the same bits, one launch
        fewer). Not for one CUDA row, which the decode GEMV takes unrounded."""
        return (self.weight_fp8 is not None and not self.batch_invariant and x.dim() == 2
                and not self.uses_gemv(x))

    def uses_gemv(self, x: torch.Tensor) -> bool:
        """Whether the product of `x` runs the decode GEMV (`tide.layers.gemv`): one CUDA row of a
        shape it takes, outside deterministic inference."""
        if self.batch_invariant or not (x.is_cuda and x.shape[0] == 1):
            return False
        from tide.layers import gemv

        return gemv.supported(x, self.gemv_operands()[0])

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, row scales) the decode GEMV streams: the fp8 copy and its scales where this
        projection runs in fp8 (the one row is not rounded to fp8 there), else the weight."""
        if self.weight_fp8 is not None and self.weight_scale is not None:
            return self.weight_fp8, self.weight_scale
        return self.weight, None


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim (qkv, gate_up). Column-parallel
    with `tp_slices` (shard id -> (start, full rows) of the checkpoint tensor): `shards` then gives
    this rank's row counts."""

    def __init__(self, in_features: int, shards: dict[str | int, int], bias: bool = False,
                 tp_slices: dict[str | int, tuple[int, int]] | None = None) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shards.items():
            offsets[shard_id] = (start, size)
            start += size
        params = [self.weight] if self.bias is None else [self.weight, self.bias]
        for param in params:
            param.shard_offsets = offsets  # type: ignore[attr-defined]
            if tp_slices is not None and any(
                    shards[i] != full for i, (_, full) in tp_slices.items()):
                param.tp_split = {  # type: ignore[attr-defined]
                    i: (0, first, shards[i], full) for i, (first, full) in tp_slices.items()}


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (o_proj, down_proj): each rank
    multiplies its share, one all-reduce sums them, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current_tp()
        start, size = self.tp.split(in_features, "input features of a row-parallel projection")
        super().__init__(size, out_features, bias)
        if self.tp.size > 1:
            self.weight.tp_split = {None: (1, start, size, in_features)}  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor | QuantizedRows, out: torch.Tensor | None = None,
                reduce: bool = True) -> torch.Tensor:
        """The sum over the ranks of their partial products (+ bias). `reduce=False` (no bias):
        this rank's partial product only, for a caller that sums it in a fused launch."""
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel projection with a bias must reduce its sum")
            return self.product(x, None, out)
        if self.tp.size == 1:
            return super().forward(x, out)
        y = self.tp.all_reduce(self.product(x, None))
        if self.bias is not None:
            y = y + self.bias
        return y if out is None else out.copy_(y)


class VocabParallelEmbedding(Embedding):
    """Rank r embeds the ids of its vocabulary share (zeros for the others); one all-reduce."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        self.tp = current_tp()
        self.vocab_start, self.vocab_size, rows = self.tp.vocab_shard(num_embeddings)
        super().__init__(rows, dim)
        if self.tp.size > 1:
            self.weight.tp_split = {  # type: ignore[attr-defined]
                None: (0, self.vocab_start, self.vocab_size, num_embeddings)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_size)
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """The output projection over a vocabulary split like `VocabParallelEmbedding` (and sharing its
    weight when the embeddings are tied): each rank computes its share of the logits, one all-gather
    gives every rank all of them."""

    def __init__(self, hidden: int, vocab: int, tied: nn.Parameter | None = None) -> None:
        self.tp = current_tp()
        start, size, rows = self.tp.vocab_shard(vocab)
        if tied is None:
            super().__init__(hidden, rows)
            if self.tp.size > 1:
                self.weight.tp_split = {None: (0, start, size, vocab)}  # type: ignore[attr-defined]
        else:
            nn.Module.__init__(self)
            self.weight = tied
            self.bias = None
            self.weight_fp8 = None
            self.weight_scale = None
        self.vocab = vocab

    def forward(self, x: torch.Tensor | QuantizedRows,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x, out)
        logits = self.tp.all_gather(self.product(x, None))[..., : self.vocab]
        return logits if out is None else out.copy_(logits)
