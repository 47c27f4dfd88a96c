"""One-row projections (decode at batch size 1) as a Triton GEMV kernel.

At one row a projection is a pure weight stream: y = W x reads every weight once and does almost no
math. cuBLAS reaches 59-95% of copy bandwidth on the Llama-3.1-8B shapes at one row; this kernel, a
program per one to four output rows streaming K in `block_k` chunks, reaches 85-106% (a read-only
stream can beat a copy's read+write rate). Measured with `python -m benchmarks.gemv_sweep` on an
H200. With PDL (see `tide.layers.pdl`) each program loads its first weight tile before waiting on the
previous kernel.

`supported()` says whether a product qualifies (one CUDA row, contiguous weight, a K `config_for` takes);
`Linear` falls back to `F.linear` otherwise. The output is rounded to the weight dtype like cuBLAS's
(to x's dtype for an fp8 weight with its row scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tide.layers import pdl
from tide.layers.triton_ops import act_and_mul


@triton.jit
def _weight_tile(ptrs, k0, row_mask, cols, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of the program's weight rows."""
    if EVEN_N and EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=row_mask[:, None] & (k0 + cols < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(W, X, B, Y, S, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 ACT: tl.constexpr, HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr):
    """Y[rows] = W[rows] . X. With ACT ("silu", "gelu_tanh"; "" for none) W is a [gate | up]
    projection of 2N rows: the program also streams its up rows (rows + N) and stores
    act(gate) * up, each product rounded to the weight dtype first as the unfused pair rounds.
    HAS_SCALE: W is fp8 with a scale a row in S; each row's sum is scaled by it and rounded to X's
    dtype instead."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * K + cols[None, :]
    # The first weight tiles do not depend on the previous kernel: with PDL they stream in while
    # that kernel finishes.
    w = _weight_tile(w_ptrs, 0, row_mask, cols, K, EVEN_N, EVEN_K)
    if ACT != "":
        up_ptrs = w_ptrs + N.to(tl.int64) * K
        w_up = _weight_tile(up_ptrs, 0, row_mask, cols, K, EVEN_N, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if EVEN_K:
        x = tl.load(X + cols).to(tl.float32)
    else:
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    if ACT != "":
        acc_up = w_up.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(X + k0 + cols).to(tl.float32)
        else:
            x = tl.load(X + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        w = _weight_tile(w_ptrs, k0, row_mask, cols, K, EVEN_N, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
        if ACT != "":
            w_up = _weight_tile(up_ptrs, k0, row_mask, cols, K, EVEN_N, EVEN_K)
            acc_up += w_up.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y *= tl.load(S + rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        y = y.to(X.dtype.element_ty)
    else:
        y = y.to(W.dtype.element_ty)
    if ACT != "":
        up = tl.sum(acc_up, 1)
        if HAS_SCALE:
            up *= tl.load(S + N + rows, mask=row_mask, other=0.0)
            up = up.to(X.dtype.element_ty).to(tl.float32)
            y = act_and_mul(y.to(tl.float32), up, ACT, X.dtype.element_ty)
        else:
            up = up.to(W.dtype.element_ty).to(tl.float32)
            y = act_and_mul(y.to(tl.float32), up, ACT, W.dtype.element_ty)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


# (N, K) -> (block_n, block_k, num_warps) where a sweep measured a better config than the K rule
# below (`python -m benchmarks.gemv_sweep --tp-size 2`, H100, 2026-11-26, fraction of copy
# bandwidth): one rank's Llama-3.1-8B qkv, o and down at TP=2, 0.866 -> 0.969, 0.831 -> 0.907,
# 0.972 -> 0.997. Keyed by shape: another model with the same [N, K] (Qwen3-1.7B's qkv is 4096 x
# 2048) takes the same config, measured on that same shape.
_MEASURED: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 4096): (4, 2048, 8),
    (4096, 2048): (2, 1024, 2),
    (4096, 7168): (2, 4096, 4),
}


def config_for(k: int, n: int | None = None, fp8: bool = False) -> tuple[int, int, int] | None:
    """(block_n, block_k, num_warps) for an [N, K] weight. K from 256 to 1024 is one tile of two
    rows on two warps (Qwen3-0.6B's K = 1024 products: 0.50-0.56 -> 0.77-1.04 of copy bandwidth on an
    H100, against one row on four warps). K from 1025 to 4096 is one tile (the next power of two,
    the columns past K masked: Gemma's 3840 and 3584 too), so with PDL a program holds its whole
    weight row before the previous kernel ends; K > 8192 goes in 2048-column chunks (8 warps);
    any other K in the widest of 1024/512/256 that divides it. Shapes in `_MEASURED` take their
    measured config. None: K is none of these (`gemv(config=...)` takes any config: the sweep).
    `fp8` (an fp8 weight, a byte a value): K from 1025 to 4096 goes in 1024-column tiles of four
    rows on four warps (`benchmarks.gemv_sweep --fp8`, H100, 2026-11-27: Llama-3.1-8B's qkv, o and
    gate_up at K = 4096 from 0.64 / 0.59 / 0.75 to 0.72 / 0.78 / 0.94 of copy bandwidth); other
    K by the K rules above, not `_MEASURED` (down_proj's K = 14,336 measured within 2% of the best
    at its bf16 rule)."""
    if fp8 and 1024 < k <= 4096:
        return 4, 1024, 4
    if not fp8 and n is not None and (n, k) in _MEASURED:
        return _MEASURED[(n, k)]
    if 256 <= k <= 1024:
        return 2, triton.next_power_of_2(k), 2
    if 256 <= k <= 4096:
        return 1, triton.next_power_of_2(k), 4
    if k > 8192 and k % 2048 == 0:
        return 1, 2048, 8
    for block_k in (1024, 512, 256):
        if k % block_k == 0:
            return 1, block_k, block_k // 256
    return None


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` serves `x @ weight.T`: one CUDA row of K and a contiguous [N, K] weight with
    a K that `config_for` takes."""
    return (
        x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2
        and x.shape[1] == weight.shape[1] and weight.is_contiguous()
        and config_for(weight.shape[1]) is not None
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         act: str = "", scale: torch.Tensor | None = None) -> torch.Tensor:
    """y[1, N] = x[1, K] @ weight[N, K].T (+ bias), accumulated in fp32 and rounded to the weight
    dtype, in `out` (any float dtype) or a new tensor. `act` ("silu", "gelu_tanh"): `weight` is a
    [gate | up] projection of 2N rows and y = act(gate) * up, bit for bit what the projection
    followed by `triton_ops.silu_and_mul` / `gelu_tanh_and_mul` gives, in one launch.
    `scale` (fp32, one a row of `weight`): `weight` is fp8 (`tide.layers.fp8`), each row's sum is
    multiplied by its scale and the result rounded to x's dtype. x itself is not rounded to fp8:
    at one row the product streams the fp8 weight at full precision of the activation."""
    n, k = weight.shape
    if (scale is not None) != (weight.dtype == torch.float8_e4m3fn):
        raise ValueError("an fp8 weight takes its row scales, and only an fp8 weight does")
    if scale is not None and scale.numel() != n:
        raise ValueError(f"scale holds {scale.numel()} values for {n} weight rows")
    if act not in ("", "silu", "gelu_tanh"):
        raise ValueError(f"act must be '', 'silu' or 'gelu_tanh', got {act!r}")
    if act:
        if bias is not None:
            raise ValueError("a gated GEMV takes no bias")
        if n % 2:
            raise ValueError(f"a gated GEMV needs a [gate | up] weight of even rows, got {n}")
        n //= 2
    block_n, block_k, warps = config or config_for(  # type: ignore[misc]
        k, weight.shape[0], fp8=scale is not None)
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype if scale is not None else weight.dtype,
                          device=weight.device)
    x = x.contiguous()
    use_pdl = pdl.enabled(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        weight, x, bias if bias is not None else x, out, scale if scale is not None else x, n, k,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, ACT=act, HAS_SCALE=scale is not None, USE_PDL=use_pdl,
        num_warps=warps, launch_pdl=use_pdl,
    )
    return out
