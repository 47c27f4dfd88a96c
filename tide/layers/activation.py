from __future__ import annotations

import torch


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
