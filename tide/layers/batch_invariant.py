"""Batch-invariant ops for `enable_deterministic_inference` (CPU).

A row's result must not depend on how many other rows share its call. Measured on torch 2.13 CPU
(fp32, 1 and 2 threads, K and N from 64 to 4096): `F.linear` is NOT batch-invariant — the GEMM picks
its blocking from M, so row i of an [M, K] product changes in the last bits with M. Row-wise
reductions (`mean` over the last dim in RMSNorm, `log_softmax`/`softmax` over the vocab) and
elementwise ops are invariant as they are, so only the matmuls are changed here.

`linear` cuts the rows into blocks of exactly `ROW_BLOCK` rows (the last block zero-padded), so every
GEMM it issues has the same shape [ROW_BLOCK, K] x [K, N] whatever the batch: a row's K-reduction is
then the same sequence of operations wherever the row sits. Cost measured at 1 thread on a
[512, 256] x [256, 1376] projection: 1.15x a plain `F.linear` (block 32; block 1 costs 5x).

A GPU implementation (fixed-tile Triton kernels) belongs behind the same function; until it exists
the engine refuses the option on CUDA rather than run non-invariant kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_BLOCK = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [M, K], computed in [ROW_BLOCK, K] blocks (see the module doc)."""
    if x.is_cuda:
        raise ValueError("enable_deterministic_inference has no batch-invariant CUDA kernels yet")
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


def set_batch_invariant(model: nn.Module) -> None:
    """Route every projection (`tide.layers.linear.Linear`) of `model` through `linear`."""
    from tide.layers.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            module.batch_invariant = True
