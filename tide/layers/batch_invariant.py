"""Batch-invariant ops for `enable_deterministic_inference` (CPU here; CUDA in `batch_invariant_triton`).

A row's result must not depend on how many other rows share its call. Measured on torch 2.13 CPU
(fp32, 1 and 2 threads, K and N from 64 to 4096): `F.linear` is NOT batch-invariant — the GEMM picks
its blocking from M, so row i of an [M, K] product changes in the last bits with M. Row-wise
reductions (`mean` over the last dim in RMSNorm, `log_softmax`/`softmax` over the vocab) and
elementwise ops are invariant as they are, so only the matmuls are changed here.

`linear` cuts the rows into blocks of exactly `ROW_BLOCK` rows (the last block zero-padded), so every
GEMM it issues has the same shape [ROW_BLOCK, K] x [K, N] whatever the batch: a row's K-reduction is
then the same sequence of operations wherever the row sits. Cost measured at 1 thread on a
[512, 256] x [256, 1376] projection: 1.15x a plain `F.linear` (block 32; block 1 costs 5x).

On CUDA `linear` and `log_softmax` hand over to the fixed-tile Triton kernels of
`tide.layers.batch_invariant_triton` (cuBLAS picks its algorithm and split-K from M, and torch's CUDA
softmax picks its kernel from the shape and the pointers' alignment, so neither is used there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_BLOCK = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [M, K], computed in [ROW_BLOCK, K] blocks (see the module doc)."""
    if x.is_cuda:
        from tide.layers import batch_invariant_triton

        return batch_invariant_triton.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    pad = (-m) % ROW_BLOCK
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    out = torch.empty(m + pad, weight.shape[0], dtype=torch.result_type(x2, weight), device=x.device)
    for s in range(0, m + pad, ROW_BLOCK):
        torch.mm(x2[s : s + ROW_BLOCK], weight.t(), out=out[s : s + ROW_BLOCK])
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the last dim of [B, V] logits, each row's bits independent of B: torch's
    on CPU (row-wise, measured invariant), the one-program-per-row Triton kernel on CUDA."""
    if x.is_cuda:
        from tide.layers import batch_invariant_triton

        return batch_invariant_triton.log_softmax(x)
    return torch.log_softmax(x.float(), dim=-1)


def set_batch_invariant(model: nn.Module) -> None:
    """Route every projection (`tide.layers.linear.Linear`) of `model` through `linear`, and every
    Gemma RMSNorm on CUDA through the one-program-per-row Triton kernel (torch's CUDA mean picks its
    reduction layout from the number of rows). On CUDA the model's weights must be in place: the
    GEMM's tile-shape check (`batch_invariant_triton.tile_shapes_agree`) runs here, per K."""
    from tide.layers.linear import Linear
    from tide.layers.norm import GemmaRMSNorm

    for module in model.modules():
        if isinstance(module, (Linear, GemmaRMSNorm)):
            module.batch_invariant = True
        if isinstance(module, Linear) and module.weight.is_cuda:
            from tide.layers import batch_invariant_triton

            # Before any CUDA graph is captured: which tile shapes the GEMM may pick (by M).
            batch_invariant_triton.tile_shapes_agree(
                module.weight.shape[1], module.weight.dtype, module.weight.device)
