"""RMSNorm with an optional fused residual add (computed in fp32 like the HF reference)."""

from __future__ import annotations

import torch
from torch import nn

from tide.layers import fp8
from tide.layers.fp8 import QuantizedRows
from tide.parallel.group import TpGroup


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, tp: TpGroup | None = None,
        quantize: bool = False,
    ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual). With `tp`
        (and a residual), `x` is this rank's partial product of a row-parallel projection: it is
        summed over the ranks first, in the same launch as the add and norm where the one-shot
        kernel serves it. `quantize` (the next projection `takes_fp8_rows`): norm(...) may come
        as `QuantizedRows`, in the norm's own launch on CUDA (not after the one-shot kernel)."""
        if tp is not None and residual is not None and tp.size > 1:
            fused = tp.all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = tp.all_reduce(x)
        if x.is_cuda:
            from tide.layers import triton_ops

            return triton_ops.rmsnorm(x, self.weight, self.eps, residual, quantize=quantize)
        if residual is not None:
            x = x + residual
        y = self._norm(x)
        normed = QuantizedRows(*fp8.quantize_rows(y), y.dtype) if quantize else y
        return normed if residual is None else (normed, x)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, rounded once at the end.

    The weight is stored as the checkpoint has it (an offset from 1; zero is the identity), so a
    dummy load fills it with `dummy_value` = 0 rather than 1.
    """

    # Set by `tide.layers.batch_invariant.set_batch_invariant`: on CUDA the norm then runs one
    # Triton program per row (the same math).
    batch_invariant = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.dummy_value = 0.0  # type: ignore[attr-defined]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            if self.batch_invariant:
                from tide.layers import batch_invariant_triton

                return batch_invariant_triton.rms_norm(x, self.weight, self.eps, offset=1.0)
            from tide.layers import triton_ops

            return triton_ops.gemma_rmsnorm(x, self.weight, self.eps)  # type: ignore[return-value]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     then: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + self(x), then(that sum)): a sandwich norm's output added to the residual
        stream, and the next norm of the stream, rounded as transformers rounds them. One launch
        on CUDA (outside batch-invariant mode, which keeps its one-norm kernel)."""
        if (x.is_cuda and not self.batch_invariant and not then.batch_invariant
                and then.eps == self.eps):
            from tide.layers import triton_ops

            return triton_ops.gemma_rmsnorm(  # type: ignore[return-value]
                x, self.weight, self.eps, residual, then.weight)
        total = residual + self(x)
        return total, then(total)
