from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tide.layers import fp8
from tide.layers.fp8 import QuantizedRows

if TYPE_CHECKING:
    from tide.layers.linear import Linear


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [gate | up] projection output."""
    if x.is_cuda:
        from tide.layers import triton_ops

        return triton_ops.silu_and_mul(x)
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up for a fused [gate | up] projection output; `approximate="tanh"` is
    transformers' `gelu_pytorch_tanh`, `"none"` its exact `gelu`."""
    if x.is_cuda and approximate == "tanh":
        from tide.layers import triton_ops

        return triton_ops.gelu_tanh_and_mul(x)
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def gated_mlp_input(gate_up: Linear, x: torch.Tensor | QuantizedRows, act: str,
                    quantize_for: Linear | None = None) -> torch.Tensor | QuantizedRows:
    """act(gate) * up of the [gate | up] projection `gate_up` of `x`; `act`: "silu", "gelu_tanh"
    or "gelu" (exact). A single CUDA row (bs1 decode) on the decode GEMV takes one launch for the
    projection and the activation together (`gemv.gemv(act=...)`, the same bits as the two-launch
    path); everything else projects, then applies the activation. `quantize_for`: the projection
    the result feeds; where it `takes_fp8_rows`, the result comes as `QuantizedRows` (quantized
    in the activation's launch on CUDA)."""
    if act not in ("silu", "gelu_tanh", "gelu"):
        raise ValueError(f"act must be 'silu', 'gelu_tanh' or 'gelu', got {act!r}")
    if (isinstance(x, torch.Tensor) and act != "gelu" and gate_up.bias is None
            and gate_up.uses_gemv(x)):
        from tide.layers import gemv

        weight, scale = gate_up.gemv_operands()
        return gemv.gemv(x, weight, act=act, scale=scale)
    y = gate_up(x)
    if quantize_for is not None and quantize_for.takes_fp8_rows(y[:, : y.shape[-1] // 2]):
        if y.is_cuda and act != "gelu":
            from tide.layers import triton_ops

            return triton_ops.act_and_mul_fp8(y, act)
        values = silu_and_mul(y) if act == "silu" else gelu_and_mul(
            y, "none" if act == "gelu" else "tanh")
        return QuantizedRows(*fp8.quantize_rows(values), values.dtype)
    return silu_and_mul(y) if act == "silu" else gelu_and_mul(y, "none" if act == "gelu" else "tanh")
