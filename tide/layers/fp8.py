"""fp8 projections (`quantization="fp8"`): weights and activations in float8_e4m3 with one scale a
row, products accumulated in fp32 and written in the model dtype (W8A8, quantized online at load).

A weight row (one output channel) is scaled so that its largest magnitude is 448, the largest
finite e4m3 value; an activation row (one token) the same way when the product runs. The product
is then `(x_q @ w_q.T) * s_x * s_w`: on CUDA one fp8 tensor-core launch (tide's Triton kernel at
decode sizes on sm_90, `fp8_triton.scaled_mm`; `torch._scaled_mm` with row-wise scales
otherwise), elsewhere the same formula in fp32 (slow, for tests and CPU serving).

The model-dtype weight stays the parameter every load and update path writes; the fp8 copy and its
scales are *derived* parameters (`derived = True`, unknown to checkpoints and to `WeightMap`) that
`Linear.requantize` refills in place, so CUDA graphs keep their addresses. The weight updater
requantizes every projection an update wrote once the update's writes have finished, so no forward
ever sees an fp8 weight that disagrees with its model-dtype weight after an update returns.
Quantization reads a row only: a checkpoint tensor written into some rows of a fused parameter, or
a tensor-parallel rank's part, is quantized on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows whose largest magnitude is below this are scaled as if it were this: an all-zero row then
# quantizes to zeros with a finite scale.
MIN_AMAX = 1e-12


class QuantizedRows(NamedTuple):
    """Activation rows already in fp8 for an fp8 product, as the kernel that computed them (the
    norm before qkv / gate_up, the activation before down) wrote them: `values` (rows, K) e4m3 and
    `scale` (rows, 1) fp32, exactly `quantize_rows` of the model-dtype rows it would otherwise have
    written; `dtype`: that model dtype, which the product writes. A projection that runs in fp8
    (`Linear.takes_fp8_rows`) takes them in place of a tensor."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the 2-D `x` as fp8 (`x * 448 / amax`, rounded to nearest, saturated) and the
    fp32 scales `amax / 448` that undo it, shape (rows, 1). The same bits on every device.
    `out` / `scale`: where to write them (contiguous, of those shapes and dtypes)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.is_cuda and x.shape[0] > 0 and x.shape[1] % 2 == 0:
        from tide.layers import fp8_triton

        return fp8_triton.quantize_rows(x, out, scale)
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(MIN_AMAX)
    # A true division (`448 / tensor` would be a reciprocal times 448, rounded twice).
    inv = torch.full_like(amax, FP8_MAX).div_(amax)
    q = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    s = amax / FP8_MAX
    if out is not None:
        q = out.copy_(q)
    if scale is not None:
        s = scale.copy_(s)
    return q, s


def scaled_product(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                   w_scale: torch.Tensor, dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`(xq @ wq.T) * x_scale * w_scale (+ bias)` in `dtype`, rounded once: xq (M, K) and wq
    (N, K) fp8, x_scale (M, 1) and w_scale (1, N) fp32, bias (N,)."""
    if xq.is_cuda:
        from tide.layers import fp8_triton

        y = fp8_triton.scaled_mm(xq, x_scale, wq, w_scale, dtype, bias)  # decode sizes on sm_90
        if y is not None:
            return y
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias,
                                out_dtype=dtype)
    y = torch.mm(xq.float(), wq.float().t()) * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def linear(x: torch.Tensor | QuantizedRows, wq: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W given as fp8 rows `wq` and their scales `w_scale` (1, N); `x` is
    quantized a row at a time first (unless it comes quantized). The result has x's dtype and
    leading dims; the bias is added before the one rounding to it."""
    if isinstance(x, QuantizedRows):
        return scaled_product(x.values, x.scale, wq, w_scale, x.dtype, bias)
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(rows.contiguous())
    y = scaled_product(xq, x_scale, wq, w_scale, x.dtype, bias)
    return y.reshape(*x.shape[:-1], wq.shape[0])


def supports(in_features: int, out_features: int) -> bool:
    """Whether a projection of this shape can run in fp8 (the fp8 GEMM takes dims that are
    multiples of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


def quantize_model(model: "nn.Module") -> int:
    """Give every projection of `model` that supports it an fp8 copy of its weight (the output
    head keeps the model dtype: logits and logprobs stay as precise as the hidden state allows).
    Returns how many projections run in fp8."""
    from tide.layers.linear import Linear, ParallelLMHead

    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module, ParallelLMHead):
            out_features, in_features = module.weight.shape
            if supports(in_features, out_features):
                module.use_fp8()
                count += 1
    return count
