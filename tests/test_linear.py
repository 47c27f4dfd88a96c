"""Projections writing into a caller's buffer (the decode graphs' logits buffer)."""

from __future__ import annotations

import torch
from torch import nn

from tide.layers.linear import Linear


def test_product_lands_in_a_buffer_of_its_dtype_without_a_copy_and_equals_linear():
    """A buffer of the model's dtype receives the product itself (the LM head into the graphs'
    logits buffer: no second tensor, no copy); an fp32 buffer receives the same values widened."""
    torch.manual_seed(0)
    lin = Linear(64, 300)
    lin.weight.data = torch.randn(300, 64, dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = nn.functional.linear(x, lin.weight)
    out = torch.empty(5, 300, dtype=torch.bfloat16)
    got = lin(x, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    wide = torch.empty(5, 300, dtype=torch.float32)
    assert torch.equal(lin(x, out=wide), want.float())
    rows = torch.empty(8, 300, dtype=torch.bfloat16)[:5]  # a leading slice, as logits[:bs]
    assert torch.equal(lin(x, out=rows), want)
