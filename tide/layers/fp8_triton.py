"""fp8 kernels for `tide.layers.fp8` on CUDA.

- Row-wise quantization in one launch (`quantize_rows`): the same formula, and the same bits, as
  the torch reference. The values are rounded to e4m3 two at a time by
  `cvt.rn.satfinite.e4m3x2.f32` (one rounding, to nearest even, as torch's conversion does) and
  stored as int16 words, so the rounding is the instruction's, whatever Triton's own fp32 -> fp8
  cast lowers to.
- The W8A8 product at decode sizes (`scaled_mm`, up to `MAX_ROWS` token rows on sm_90). cuBLASLt
  tiles every size 128 x 128, which leaves most SMs idle for a few rows and a narrow projection;
  this kernel takes tiles per projection shape and row count (`gemm_config`, measured on H100s by
  `benchmarks/fp8-gemm-w8a8-sweep-h100-2026-11-27.json`) and, for few rows, puts the weight on the
  tensor cores' 64-row side ("swapped" operands). Its fp8 products are promoted to fp32 every
  BLOCK_K, as cuBLAS's default accumulation is: Triton's own default on sm_90 accumulates a whole
  K in the tensor cores' reduced precision, ~1% off at K = 14,336.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tide.layers.fp8 import FP8, FP8_MAX, MIN_AMAX

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: the product stays with torch._scaled_mm
    TensorDescriptor = None


@triton.jit
def _fp8_words(q, HALF: tl.constexpr):
    """int16 words [HALF] of the fp32 values q [2 * HALF], rounded to e4m3 (the even one low)."""
    even, odd = tl.split(tl.reshape(q, [HALF, 2]))
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f",
                                     [even, odd], dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def fp8_row(y, Q, S, row, stride_q, n_cols, fp8_max, min_amax, BLOCK: tl.constexpr):
    """Store the row `y` [BLOCK] (fp32, zeros past n_cols) as `fp8.quantize_rows` does: e4m3
    words at Q + row * stride_q, the scale at S + row. Shared by the quantizing launches (this
    module's, and the norm's in `triton_ops`)."""
    amax = tl.maximum(tl.max(tl.abs(y), 0), min_amax)
    q = tl.clamp(y * tl.math.div_rn(fp8_max, amax), -fp8_max, fp8_max)
    words = tl.arange(0, BLOCK // 2)
    tl.store(Q + row * stride_q + words, _fp8_words(q, BLOCK // 2), mask=words < n_cols // 2)
    tl.store(S + row, tl.math.div_rn(amax, fp8_max))


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
        fp8_row(x, Q, S, row, stride_q, n_cols, fp8_max, min_amax, BLOCK)
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


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(x_desc, w_desc, SX, SW, C, BIAS, M, N, K, stride_cm, BLOCK_R: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """C[m, n] = sum_k X[m, k] W[n, k] * SX[m] * SW[n] (+ BIAS[n]), rounded to C's dtype once;
    X [M, K] and W [N, K] fp8 read through TMA descriptors (out-of-range rows and columns load as
    zeros). One program a BLOCK_R x BLOCK_Q tile whose rows are tokens and columns output
    features, or the reverse (SWAP)."""
    pid = tl.program_id(0)
    if SWAP:
        tiles_q = tl.cdiv(M, BLOCK_Q)
    else:
        tiles_q = tl.cdiv(N, BLOCK_Q)
    pr = pid // tiles_q
    pq = pid % tiles_q
    acc = tl.zeros([BLOCK_R, BLOCK_Q], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if SWAP:
            a = w_desc.load([pr * BLOCK_R, k0])
            b = x_desc.load([pq * BLOCK_Q, k0])
        else:
            a = x_desc.load([pr * BLOCK_R, k0])
            b = w_desc.load([pq * BLOCK_Q, k0])
        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    q = pq * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if SWAP:
        m = q[None, :]
        n = r[:, None]
    else:
        m = r[:, None]
        n = q[None, :]
    acc = acc * tl.load(SX + m, mask=m < M, other=0.0) * tl.load(SW + n, mask=n < N, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(C + m.to(tl.int64) * stride_cm + n, acc.to(C.dtype.element_ty),
             mask=(m < M) & (n < N))


# A product's tiles: (swap, BLOCK_R, BLOCK_Q, BLOCK_K, num_warps, num_stages); None: cuBLASLt.
GemmConfig = tuple[int, int, int, int, int, int]
MAX_ROWS = 256
# Per weight shape (N, K): (up to this many rows, config), in order. Measured on one H100 at the
# CUDA-graph batch sizes (`benchmarks/fp8-gemm-w8a8-sweep-h100-2026-11-27.json`: the fastest
# config at each row count, kept over a row range while within 3% of the fastest, cuBLASLt where
# it is within 3% of the best tile).
_TUNED: dict[tuple[int, int], tuple[tuple[int, GemmConfig | None], ...]] = {
    # Llama-3.1-8B: qkv, o, gate_up, down
    (6144, 4096): ((32, (1, 64, 16, 256, 4, 4)), (64, (1, 64, 32, 256, 4, 4)),
                   (128, (1, 128, 64, 256, 8, 4)), (160, (1, 64, 32, 128, 4, 4)),
                   (192, (1, 64, 64, 128, 4, 4)), (256, None)),
    (4096, 4096): ((64, (1, 64, 16, 256, 4, 4)), (128, (1, 64, 32, 256, 4, 4)),
                   (208, (1, 128, 64, 256, 8, 4)), (256, (1, 64, 128, 256, 4, 4))),
    (28672, 4096): ((16, (1, 64, 16, 256, 4, 4)), (32, (1, 64, 32, 256, 4, 4)),
                    (64, (0, 64, 128, 256, 4, 4)), (128, None), (192, (1, 128, 64, 128, 8, 4)),
                    (256, None)),
    (4096, 14336): ((64, (1, 64, 16, 256, 4, 4)), (128, (1, 64, 32, 256, 4, 4)),
                    (208, (1, 128, 64, 256, 8, 4)), (256, (1, 64, 128, 256, 4, 4))),
    # Qwen3-0.6B: qkv, o, gate_up, down
    (4096, 1024): ((16, (1, 64, 16, 256, 4, 4)), (128, (1, 64, 32, 256, 4, 4)),
                   (208, (1, 64, 32, 128, 4, 4)), (256, (1, 64, 128, 256, 4, 4))),
    (1024, 2048): ((128, (1, 64, 16, 256, 4, 4)), (256, (1, 64, 32, 256, 4, 4))),
    (6144, 1024): ((32, (1, 64, 16, 256, 4, 4)), (64, (1, 64, 32, 256, 4, 4)),
                   (96, (1, 64, 16, 128, 4, 4)), (128, (1, 64, 128, 256, 4, 4)),
                   (160, (1, 64, 32, 128, 4, 4)), (256, (1, 64, 64, 128, 4, 4))),
    (1024, 3072): ((96, (1, 64, 16, 256, 4, 4)), (256, (1, 64, 32, 256, 4, 4))),
}
# Other shapes: swapped 64-row weight tiles up to this many rows, where they won for every
# measured shape (cuBLASLt above it).
_UNTUNED_MAX_ROWS = 64


def gemm_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The tiles `scaled_mm` runs an (m x k) @ (n x k).T product on, or None where cuBLASLt is
    as fast or faster (more than `MAX_ROWS` rows, and per shape as measured)."""
    if not 1 <= m <= MAX_ROWS:
        return None
    ranges = _TUNED.get((n, k))
    if ranges is None:
        if m > _UNTUNED_MAX_ROWS:
            return None
        return (1, 64, 16 if m <= 32 else 32, 256 if k >= 256 else 128, 4, 4)
    for max_rows, config in ranges:
        if m <= max_rows:
            return config
    return None


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`(xq @ wq.T) * x_scale * w_scale (+ bias)` in `dtype`, rounded once (xq (M, K), wq (N, K)
    fp8; x_scale (M, 1), w_scale (1, N) fp32, contiguous; bias (N,)) by `_w8a8_kernel`, or None
    where it does not take the product (not sm_90, no config for the size, or operands TMA cannot
    address)."""
    m, k = xq.shape
    n = wq.shape[0]
    if TensorDescriptor is None or not (xq.is_cuda and _is_sm90(xq.device.index or 0)):
        return None
    config = gemm_config(m, n, k)
    if config is None or not all(
            t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0
            for t in (xq, wq)) or not (x_scale.is_contiguous() and w_scale.is_contiguous()):
        return None
    swap, block_r, block_q, block_k, num_warps, num_stages = config
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    x_rows, w_rows = (block_q, block_r) if swap else (block_r, block_q)
    tiles = (triton.cdiv(n, block_r) * triton.cdiv(m, block_q) if swap
             else triton.cdiv(m, block_r) * triton.cdiv(n, block_q))
    _w8a8_kernel[(tiles,)](
        TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [x_rows, block_k]),
        TensorDescriptor(wq, [n, k], [wq.stride(0), 1], [w_rows, block_k]),
        x_scale, w_scale, out, out if bias is None else bias.contiguous(), m, n, k, out.stride(0),
        BLOCK_R=block_r, BLOCK_Q=block_q, BLOCK_K=block_k, SWAP=bool(swap),
        HAS_BIAS=bias is not None, num_warps=num_warps, num_stages=num_stages)
    return out
