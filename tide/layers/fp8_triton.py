"""Row-wise fp8 quantization in one launch (`tide.layers.fp8.quantize_rows` on CUDA): the same
formula, and the same bits, as the torch reference there.

The values are rounded to e4m3 two at a time by `cvt.rn.satfinite.e4m3x2.f32` (one rounding, to
nearest even, as torch's conversion does) and stored as int16 words, so the rounding is the
instruction's, whatever Triton's own fp32 -> fp8 cast lowers to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tide.layers.fp8 import FP8, FP8_MAX, MIN_AMAX


@triton.jit
def _fp8_words(q, HALF: tl.constexpr):
    """int16 words [HALF] of the fp32 values q [2 * HALF], rounded to e4m3 (the even one low)."""
    even, odd = tl.split(tl.reshape(q, [HALF, 2]))
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f",
                                     [even, odd], dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def _quantize_rows_kernel(X, Q, S, stride_x, stride_q, n_cols, fp8_max, min_amax,
                          BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program a row. Q: the fp8 output as int16 words (`stride_q` in words)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    cols = tl.arange(0, BLOCK)
    words = tl.arange(0, BLOCK // 2)
    if ONE_BLOCK:
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), 0), min_amax)
        inv = tl.math.div_rn(fp8_max, amax)
        q = tl.clamp(x * inv, -fp8_max, fp8_max)
        tl.store(q_row + words, _fp8_words(q, BLOCK // 2), mask=words < n_cols // 2)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        amax = tl.maximum(tl.max(acc, 0), min_amax)
        inv = tl.math.div_rn(fp8_max, amax)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0)
            q = tl.clamp(x.to(tl.float32) * inv, -fp8_max, fp8_max)
            tl.store(q_row + start // 2 + words, _fp8_words(q, BLOCK // 2),
                     mask=start // 2 + words < n_cols // 2)
    tl.store(S + row, tl.math.div_rn(amax, fp8_max))


def quantize_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `tide.layers.fp8.quantize_rows`; rows of an even length."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=FP8, device=x.device) if out is None else out
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if scale is None else scale
    words = q.view(torch.int16)
    block = min(4096, triton.next_power_of_2(cols))
    _quantize_rows_kernel[(rows,)](x, words, s, x.stride(0), words.stride(0), cols, FP8_MAX,
                                   MIN_AMAX, BLOCK=block, ONE_BLOCK=block >= cols,
                                   num_warps=min(16, max(1, block // 256)))
    return q, s
