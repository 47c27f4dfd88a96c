"""Fused Triton kernels for the GPU path: add+RMSNorm, Gemma's RMSNorm (+ residual add + the next
norm), RoPE+KV store, SiLU-and-mul, GELU(tanh)-and-mul, row argmax, one-pass sampling (`sample_rows`).

Each op has the torch reference in `tide.layers` (norm.py, rotary.py, activation.py); these compute the
same function with one launch instead of several, rounding like the reference where the reference
rounds to the model dtype (residual sum, normalized activations before the weight).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tide.layers import fp8, pdl
from tide.layers.fp8 import FP8, QuantizedRows
from tide.layers.fp8_triton import _fp8_words, fp8_row

FP8_MAX = tl.constexpr(fp8.FP8_MAX)
MIN_AMAX = tl.constexpr(fp8.MIN_AMAX)

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Per-request and per-token index arguments (the batch's metadata, read one element a program).
# Their addresses are views into packed or freshly allocated buffers whose 16-byte alignment
# changes with the batch, and Triton would compile a kernel again, in the middle of serving, for
# each alignment it had not seen (measured: the first standard-workload run of a process compiled
# the extend kernels again). Kernels taking them are not specialised on their alignment.
INDEX_ARGS = ("Pos", "Loc", "ReqPoolIdx", "SeqLens", "PrefixLens", "ExtendLens", "ExtendStarts",
              "Order")


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ResOut, Q, S, stride_x, stride_r, stride_o, stride_ro, stride_q,
                    n_cols, eps, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """QUANT: the normed row goes out as fp8 words and a scale (Q, S) instead of into Out."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    if QUANT:
        fp8_row((w * normed).to(tl.float32), Q, S, row, stride_q, n_cols, FP8_MAX, MIN_AMAX,
                BLOCK)
    else:
        tl.store(Out + row * stride_o + cols, w * normed, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, quantize: bool = False
            ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """RMSNorm of x's rows (of residual + x, returned too, with `residual`). `quantize` (2-D x,
    an even row length): the normed rows come as `QuantizedRows` for an fp8 projection, the same
    bits as `fp8.quantize_rows` of the model-dtype rows."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols)
    rows = x2.shape[0]
    block = triton.next_power_of_2(n_cols)
    warps = min(16, max(1, block // 256))
    use_pdl = pdl.enabled(x)
    if quantize:
        if x.dim() != 2 or n_cols % 2:
            raise ValueError(f"fp8 rows need 2-D rows of an even length, got shape {tuple(shape)}")
        q = torch.empty(rows, n_cols, dtype=FP8, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        out, words = x2, q.view(torch.int16)
    else:
        out = torch.empty_like(x2)
        words, scale = out, out
    if residual is None:
        r2, res_out = x2, out
    else:
        r2 = residual.reshape(-1, n_cols)
        res_out = torch.empty_like(x2)
    _rmsnorm_kernel[(rows,)](x2, r2, weight, out, res_out, words, scale, x2.stride(0),
                             r2.stride(0), out.stride(0), res_out.stride(0), words.stride(0),
                             n_cols, eps, HAS_RESIDUAL=residual is not None, QUANT=quantize,
                             BLOCK=block, num_warps=warps, USE_PDL=use_pdl, launch_pdl=use_pdl)
    normed: torch.Tensor | QuantizedRows = (QuantizedRows(q, scale, x.dtype) if quantize
                                            else out.view(shape))
    return normed if residual is None else (normed, res_out.view(shape))


@triton.jit
def _gemma_rmsnorm_kernel(X, W, R, W2, Out, Out2, stride_x, stride_r, stride_o, stride_o2, n_cols,
                          eps, HAS_RESIDUAL: tl.constexpr, HAS_NEXT: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps) * (1.0 + w)).to(Out.dtype.element_ty)
    if HAS_RESIDUAL:
        # residual + norm(x): the norm rounded first, the sum rounded once (a dtype add).
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, y, mask=mask)
    if HAS_NEXT:
        s = y.to(tl.float32)
        w2 = tl.load(W2 + cols, mask=mask, other=0.0).to(tl.float32)
        y2 = s * tl.rsqrt(tl.sum(s * s, 0) / n_cols + eps) * (1.0 + w2)
        tl.store(Out2 + row * stride_o2 + cols, y2.to(Out2.dtype.element_ty), mask=mask)


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None, next_weight: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight) in fp32 rounded once, in one
    launch. With `residual`: residual + norm(x) (as `residual + GemmaRMSNorm(x)` rounds); with
    `next_weight` too: (that sum, the sum normed with `next_weight`), the next sandwich norm."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = residual.reshape(-1, n_cols) if residual is not None else x2
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    has_next = next_weight is not None
    if has_next and residual is None:
        raise ValueError("next_weight needs a residual")
    out2 = torch.empty_like(out) if has_next else out
    if x2.shape[0] == 0:
        return (out.view(shape), out2.view(shape)) if has_next else out.view(shape)
    block = triton.next_power_of_2(n_cols)
    use_pdl = pdl.enabled(x)
    _gemma_rmsnorm_kernel[(x2.shape[0],)](
        x2, weight, r2, next_weight if has_next else weight, out, out2, x2.stride(0), r2.stride(0),
        out.stride(0), out2.stride(0), n_cols, eps, HAS_RESIDUAL=residual is not None,
        HAS_NEXT=has_next, BLOCK=block, num_warps=min(16, max(1, block // 256)), USE_PDL=use_pdl,
        launch_pdl=use_pdl)
    return (out.view(shape), out2.view(shape)) if has_next else out.view(shape)


@triton.jit
def _head_norm(x1, x2, W, offs, mask_d, eps, OUT_TY: tl.constexpr, HEAD_DIM: tl.constexpr,
               HALF: tl.constexpr, GEMMA: tl.constexpr):
    """RMSNorm of each head row given as its two halves (fp32), rounded to `OUT_TY` as the norm's
    own launch rounds it (Gemma: x * r * (1 + w) in fp32, rounded once; otherwise (x * r) rounded,
    then times w, rounded), returned as fp32."""
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(W + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if GEMMA:
        y1 = x1 * r * (1.0 + w1)
        y2 = x2 * r * (1.0 + w2)
    else:
        y1 = w1 * (x1 * r).to(OUT_TY).to(tl.float32)
        y2 = w2 * (x2 * r).to(OUT_TY).to(tl.float32)
    return y1.to(OUT_TY).to(tl.float32), y2.to(OUT_TY).to(tl.float32)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _rope_store_kernel(Q, K, V, Pos, Cos, Sin, Loc, KBuf, VBuf, QW, KW,
                       stride_qt, stride_kt, stride_vt, stride_cos, stride_kb, stride_vb, norm_eps,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QH_P2: tl.constexpr,
                       KH_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       HALF_P2: tl.constexpr, QK_NORM: tl.constexpr, GEMMA_NORM: tl.constexpr,
                       USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    # Positions are an input of the step and the tables constant: read before the wait (PDL).
    pos = tl.load(Pos + t)
    offs = tl.arange(0, HALF_P2)
    mask_d = offs < HALF
    cos = tl.load(Cos + pos * stride_cos + offs, mask=mask_d, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + offs, mask=mask_d, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    heads_q = tl.arange(0, QH_P2)
    mq = (heads_q < NUM_Q_HEADS)[:, None] & mask_d[None, :]
    pq = Q + t * stride_qt + heads_q[:, None] * HEAD_DIM + offs[None, :]
    q1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(pq + HALF, mask=mq, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_norm(q1, q2, QW, offs, mask_d, norm_eps, Q.dtype.element_ty, HEAD_DIM, HALF,
                            GEMMA_NORM)
    tl.store(pq, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=mq)
    tl.store(pq + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=mq)
    heads_k = tl.arange(0, KH_P2)
    mk = (heads_k < NUM_KV_HEADS)[:, None] & mask_d[None, :]
    hk = heads_k[:, None] * HEAD_DIM + offs[None, :]
    k1 = tl.load(K + t * stride_kt + hk, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(K + t * stride_kt + hk + HALF, mask=mk, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_norm(k1, k2, KW, offs, mask_d, norm_eps, K.dtype.element_ty, HEAD_DIM, HALF,
                            GEMMA_NORM)
    r1 = (k1 * cos - k2 * sin).to(K.dtype.element_ty)
    r2 = (k2 * cos + k1 * sin).to(K.dtype.element_ty)
    loc = tl.load(Loc + t).to(tl.int64)
    v1 = tl.load(V + t * stride_vt + hk, mask=mk, other=0.0)
    v2 = tl.load(V + t * stride_vt + hk + HALF, mask=mk, other=0.0)
    if KBuf.dtype.element_ty == tl.float8e4nv:
        # An fp8 cache: from the model-dtype value, round to nearest even and saturate at
        # +-448, as `tide.memory.pools.to_kv_dtype` does on the torch path.
        r1 = r1.to(tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        r2 = r2.to(tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        v1 = v1.to(tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        v2 = v2.to(tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(KBuf + loc * stride_kb + hk, r1.to(KBuf.dtype.element_ty), mask=mk)
    tl.store(KBuf + loc * stride_kb + hk + HALF, r2.to(KBuf.dtype.element_ty), mask=mk)
    tl.store(VBuf + loc * stride_vb + hk, v1.to(VBuf.dtype.element_ty), mask=mk)
    tl.store(VBuf + loc * stride_vb + hk + HALF, v2.to(VBuf.dtype.element_ty), mask=mk)


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, out_cache_loc: torch.Tensor, k_buffer: torch.Tensor,
                      v_buffer: torch.Tensor,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None) -> None:
    """Rotate q in place; rotate k and write k and v straight into the KV pool's slots
    `out_cache_loc`. q/k/v: [T, heads * head_dim] views with unit stride in the last dim; cos/sin:
    [max_pos, head_dim] tables (the first half is used: neox layout).
    `qk_norm` = (q weight, k weight, eps, gemma): first the RMSNorm of every q and k head (Qwen3;
    Gemma's (1 + w) form for Gemma-3), rounded where a separate `rmsnorm` / `gemma_rmsnorm` launch
    rounds (its sum of squares is taken over the two halves: equal up to that fp32 order)."""
    use_pdl = pdl.enabled(q)
    qw, kw, eps, gemma = qk_norm if qk_norm is not None else (cos, cos, 0.0, False)
    _rope_store_kernel[(q.shape[0],)](
        q, k, v, positions, cos, sin, out_cache_loc, k_buffer, v_buffer, qw, kw,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        k_buffer.stride(0), v_buffer.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        QH_P2=triton.next_power_of_2(num_q_heads), KH_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HALF=head_dim // 2, HALF_P2=triton.next_power_of_2(head_dim // 2),
        QK_NORM=qk_norm is not None, GEMMA_NORM=gemma, USE_PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl,
    )


@triton.jit
def act_and_mul(gate, up, ACT: tl.constexpr, OUT_TY: tl.constexpr):
    """act(gate) * up from fp32 `gate` and `up` (values of the model dtype `OUT_TY`), rounded as
    `F.silu(gate) * up` / `F.gelu(gate, approximate="tanh") * up` round: the activation to OUT_TY,
    then the product. ACT: "silu" or "gelu_tanh". Shared by the elementwise kernel below and the
    decode GEMV's gated form, so both give the same bits."""
    if ACT == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi) * (...)
        # 0.5 * (1 + tanh(u)) = sigmoid(2u): no cancellation where tanh(u) is near -1.
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    return (act.to(OUT_TY).to(tl.float32) * up).to(OUT_TY)


@triton.jit
def _act_mul_kernel(X, Out, stride_x, stride_o, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, act_and_mul(gate, up, ACT, Out.dtype.element_ty),
             mask=mask)


@triton.jit
def _act_mul_quant_kernel(X, Q, S, stride_x, stride_q, n_cols, ACT: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """`_act_mul_kernel`'s rows as fp8 words and a scale, one program a row: the row's largest
    magnitude first, then the values again, quantized."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        gate = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = act_and_mul(gate, up, ACT, X.dtype.element_ty).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(y))
    amax = tl.maximum(tl.max(acc, 0), MIN_AMAX)
    inv = tl.math.div_rn(FP8_MAX, amax)
    words = tl.arange(0, BLOCK // 2)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        gate = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = act_and_mul(gate, up, ACT, X.dtype.element_ty).to(tl.float32)
        q = tl.clamp(y * inv, -FP8_MAX, FP8_MAX)
        tl.store(Q + row * stride_q + start // 2 + words, _fp8_words(q, BLOCK // 2),
                 mask=start // 2 + words < n_cols // 2)
    tl.store(S + row, tl.math.div_rn(amax, FP8_MAX))


def act_and_mul_fp8(x: torch.Tensor, act: str) -> QuantizedRows:
    """act(gate) * up of 2-D [gate | up] rows, as `QuantizedRows`: the same bits as
    `fp8.quantize_rows` of `silu_and_mul(x)` / `gelu_tanh_and_mul(x)`. act: "silu" or
    "gelu_tanh"."""
    d = x.shape[-1] // 2
    if x.dim() != 2 or d % 2:
        raise ValueError(f"fp8 rows need 2-D rows of an even length, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape[0], d, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    words = q.view(torch.int16)
    block = min(2048, triton.next_power_of_2(d))
    use_pdl = pdl.enabled(x)
    _act_mul_quant_kernel[(x.shape[0],)](x, words, scale, x.stride(0), words.stride(0), d, ACT=act,
                                         BLOCK=block, num_warps=max(1, min(8, block // 256)),
                                         USE_PDL=use_pdl, launch_pdl=use_pdl)
    return QuantizedRows(q, scale, x.dtype)


def _gated(act: str, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a fused [gate | up] projection output, in one launch."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = 1024
    use_pdl = pdl.enabled(x)
    _act_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out, x2.stride(0), out.stride(0), d, ACT=act, BLOCK=block, num_warps=4, USE_PDL=use_pdl,
        launch_pdl=use_pdl)
    return out.view(*x.shape[:-1], d)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, in one launch; rounds where `F.gelu(gate, approximate="tanh") * up`
    does (the activation, then the product)."""
    return _gated("gelu_tanh", x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in one launch; rounds where `F.silu(gate) * up` does."""
    return _gated("silu", x)


@triton.jit
def _argmax_partial_kernel(X, Vals, Idx, NanIdx, n_cols, stride_x, BLOCK: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)
    best = tl.max(x, 0)
    out = row * NUM_CHUNKS + chunk
    tl.store(Vals + out, best)
    # The first column holding the maximum, clamped to the row (a chunk past its end is all -inf).
    tl.store(Idx + out, tl.minimum(tl.min(tl.where(x == best, cols, n_cols), 0), n_cols - 1))
    tl.store(NanIdx + out, tl.min(tl.where(is_nan, cols, n_cols), 0))


@triton.jit
def _argmax_final_kernel(Vals, Idx, NanIdx, Out, n_cols, NUM_CHUNKS: tl.constexpr,
                         USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = row * NUM_CHUNKS + tl.arange(0, NUM_CHUNKS)
    vals = tl.load(Vals + offs)
    idx = tl.load(Idx + offs)
    best = tl.max(vals, 0)
    first = tl.min(tl.where(vals == best, idx, n_cols), 0)
    first_nan = tl.min(tl.load(NanIdx + offs), 0)  # NaN counts as the maximum, as in torch
    tl.store(Out + row, tl.where(first_nan < n_cols, first_nan, first).to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = the first index of the maximum of row i of a 2-D float tensor, as torch.argmax
    (NaN counts as the maximum), in two short launches that a CUDA graph can hold."""
    rows, n_cols = x.shape
    block = 4096
    chunks = triton.next_power_of_2(triton.cdiv(n_cols, block))
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    nan_idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    use_pdl = pdl.enabled(x)
    _argmax_partial_kernel[(rows, chunks)](x, vals, idx, nan_idx, n_cols, x.stride(0), BLOCK=block,
                                           NUM_CHUNKS=chunks, USE_PDL=use_pdl, num_warps=8,
                                           launch_pdl=use_pdl)
    _argmax_final_kernel[(rows,)](vals, idx, nan_idx, out, n_cols, NUM_CHUNKS=chunks,
                                  USE_PDL=use_pdl, num_warps=1, launch_pdl=use_pdl)
    return out


# Columns a program of `sample_rows` covers: fixed, so a row's result never depends on its batch.
# 2,048 in one block of 4 warps was the fastest of chunks 2k-16k, blocks 512-4k, 4/8 warps (H100,
# Qwen3's vocabulary, 1-256 rows).
SAMPLE_CHUNK = 2048
_SAMPLE_BLOCK = 2048


@triton.jit
def _ln(x, ASM: tl.constexpr):
    """Natural log; on the GPU by `lg2.approx`, which halved the sampling kernel's time against
    `tl.log` (its noise takes two logs an element). CUDA bounds that instruction's error by 2^-22
    *absolute* on [0.5, 2] and 2 ulp elsewhere: fine where the result is far from 0, useless for
    log(u) with u within a few 2^-22 of 1 (see `_exp1`)."""
    if ASM:
        lg = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                       is_pure=True, pack=1)
        return lg * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _exp1(u, ASM: tl.constexpr):
    """E = -log(u) ~ Exp(1) for u ~ U[0, 1). Near 1, where E is tiny and decides the largest Gumbel
    keys, an absolute error of 2^-22 in the log would leave E ~100% wrong, even 0 (a key of +inf:
    that column would win whatever its logit). So for v = 1 - u < 2^-6 (exact: Sterbenz) E is the
    series v + v^2/2 + v^3/3 + v^4/4 (truncation below 2^-26 relative); elsewhere |log u| > 0.015
    and the approximate log is within ~1e-5 relative."""
    v = 1.0 - u
    series = v * (1.0 + v * (0.5 + v * (0.3333333333333333 + v * 0.25)))
    return tl.where(v < 0.015625, series, -_ln(u, ASM))


@triton.jit
def _chunk_program(Rows, Temps):
    """A (row, chunk) program's batch row i, its chunk, its logits row and 1 / its temperature."""
    i = tl.program_id(0)
    return i, tl.program_id(1), tl.load(Rows + i).to(tl.int64), 1.0 / tl.load(Temps + i)


# Row counts change every step: a kernel specialised on them (==1, multiple of 16) would compile again
# in the middle of serving (measured: the first sampled run of a process on a new host took 1.3 s
# longer). Nor on the alignment of the per-row arguments (fresh small tensors). The vocabulary and the
# logits' row stride stay specialised: they are fixed for a model, and their divisibility by 16 is
# what lets the logits load in vectors (unspecialised, the kernel took 2.5x as long at 256 rows).
_SAMPLE_ARGS = ("rows_total",)
_SAMPLE_ROW_ARGS = ("Rows", "Temps", "Seeds")


@triton.jit(do_not_specialize=_SAMPLE_ARGS,
            do_not_specialize_on_alignment=_SAMPLE_ROW_ARGS + ("Floor", "MinX"))
def _sample_partial_kernel(X, Rows, Temps, Seeds, Floor, MinX, Part, Idx, n_cols, stride_x,
                           rows_total, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK: tl.constexpr, LOGPROB: tl.constexpr, TRUNC: tl.constexpr,
                           SHIFT: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i, chunk, row, inv_t = _chunk_program(Rows, Temps)
    seed = tl.load(Seeds + i)
    if TRUNC:  # the row's kept tokens: order key >= floor and score >= min_x (`truncation_bounds`)
        floor = tl.load(Floor + i)
        min_x = tl.load(MinX + i)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32) + n_cols
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    # Tiles of [BLOCK // 4, 4] columns: one Philox evaluation (counter = column // 4) gives the four
    # uniforms of a tile row, column 4c + l taking output l.
    quad = tl.arange(0, BLOCK // 4)
    lane = tl.arange(0, 4)[None, :]
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + 4 * quad[:, None] + lane
        mask = cols < n_cols
        raw = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        raw = tl.where(raw != raw, float("-inf"), raw)  # a NaN logit is never drawn
        x = raw * inv_t
        if seed >= 0:  # Gumbel-max: argmax(x - log E), E = -log U ~ Exp(1)
            u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + quad)
            u = tl.where(lane == 0, u0[:, None], tl.where(lane == 1, u1[:, None],
                         tl.where(lane == 2, u2[:, None], u3[:, None])))
            key = x - _ln(_exp1(u, ASM), ASM)
        else:
            key = x
        if TRUNC:
            key = tl.where((_order_key(raw, SHIFT) >= floor) & (x >= min_x), key, float("-inf"))
        key = tl.where(mask, key, float("-inf"))
        kmax = tl.max(tl.max(key, 1), 0)
        kidx = tl.min(tl.min(tl.where(key == kmax, cols, n_cols), 1), 0)
        best_idx = tl.where(kmax > best, kidx, best_idx)
        best = tl.maximum(best, kmax)
        if LOGPROB:
            m_new = tl.maximum(m, tl.max(tl.max(x, 1), 0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.sum(tl.exp(x - shift), 1), 0)
            m = m_new
    out = i * CHUNKS + chunk
    tl.store(Part + out, best)
    tl.store(Idx + out, best_idx)
    if LOGPROB:
        tl.store(Part + rows_total * CHUNKS + out, m)
        tl.store(Part + 2 * rows_total * CHUNKS + out, s)


@triton.jit(do_not_specialize=_SAMPLE_ARGS, do_not_specialize_on_alignment=_SAMPLE_ROW_ARGS)
def _sample_final_kernel(X, Rows, Temps, Part, Idx, Out, LogP, n_cols, stride_x, rows_total,
                         CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, LOGPROB: tl.constexpr,
                         USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_P2)
    mask = offs < CHUNKS
    at = i * CHUNKS + offs
    best = tl.load(Part + at, mask=mask, other=float("-inf"))
    idx = tl.load(Idx + at, mask=mask, other=n_cols)
    top = tl.max(best, 0)
    # The first column holding the maximum (chunks in column order); a row of nothing but -inf or
    # NaN takes its last column rather than one outside the vocabulary.
    first = tl.minimum(tl.min(tl.where(best == top, idx, n_cols), 0), n_cols - 1)
    tl.store(Out + i, first.to(tl.int64))
    if LOGPROB:
        m = tl.load(Part + rows_total * CHUNKS + at, mask=mask, other=float("-inf"))
        s = tl.load(Part + 2 * rows_total * CHUNKS + at, mask=mask, other=0.0)
        big = tl.max(m, 0)
        shift = tl.where(big == float("-inf"), 0.0, big)
        total = tl.sum(s * tl.exp(m - shift), 0)
        row = tl.load(Rows + i).to(tl.int64)
        x = tl.load(X + row * stride_x + first).to(tl.float32) * (1.0 / tl.load(Temps + i))
        tl.store(LogP + i, x - shift - tl.log(total))


@triton.jit
def _order_key(x, SHIFT: tl.constexpr):
    """An int32 key of fp32 `x` in the same order as the values (the bits, with the magnitude bits
    of negatives flipped; -0 counts as +0), shifted right by SHIFT: 16 leaves the key of a bf16
    value exactly."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


# Pivots a truncation search pass tries in each row's interval, by the logits' key bits: the interval
# shrinks that many-fold a pass, so the 2^16 keys of bf16 logits take 8 passes and the 2^32 of fp32 /
# fp16 logits 11. Fastest of 2-16 at 16-256 rows (H100). The answers are the same for any count up
# to the rounding of the mass sums at a top-p boundary, so the count must not depend on the batch.
TRUNC_PIVOTS = {16: 4, 32: 8}
_TRUNC_BLOCK = 512
_TRUNC_ROW_ARGS = ("Rows", "Temps", "TopK", "TopP", "MinP", "Bounds", "Floor", "MinX")


@triton.jit
def _pivots(Bounds, i, which: tl.constexpr, PIVOTS: tl.constexpr):
    """Row i's search interval (lo, hi] (int64) and its PIVOTS pivots lo + ceil((j + 1)(hi - lo) /
    PIVOTS), the last one hi (meaningless once lo == hi: the search is over)."""
    lo = tl.load(Bounds + i * 4 + 2 * which)
    hi = tl.load(Bounds + i * 4 + 2 * which + 1)
    j = tl.arange(0, PIVOTS).to(tl.int64)
    piv = lo + ((j + 1) * (hi - lo) + PIVOTS - 1) // PIVOTS
    return lo, hi, piv


@triton.jit(do_not_specialize=_SAMPLE_ARGS, do_not_specialize_on_alignment=_TRUNC_ROW_ARGS)
def _trunc_partial_kernel(X, Rows, Temps, Bounds, Part, Cnt, n_cols, stride_x, rows_total,
                          CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          PIVOTS: tl.constexpr, SHIFT: tl.constexpr, SEARCH_K: tl.constexpr,
                          SEARCH_P: tl.constexpr, USE_PDL: tl.constexpr):
    """One chunk of one row: the max m and sum of exp(score - m) of its scores, and at each pivot
    t, the count of its keys >= t (top-k interval) and their sum of exp(score - m) (top-p)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i, chunk, row, inv_t = _chunk_program(Rows, Temps)
    _, _, piv_k = _pivots(Bounds, i, 0, PIVOTS)
    _, _, piv_p = _pivots(Bounds, i, 1, PIVOTS)
    piv_k = tl.maximum(piv_k, -2147483648).to(tl.int32)
    piv_p = tl.maximum(piv_p, -2147483648).to(tl.int32)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    cnt = tl.zeros((PIVOTS,), dtype=tl.int32)
    mass = tl.zeros((PIVOTS,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        raw = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        raw = tl.where(raw != raw, float("-inf"), raw)
        x = raw * inv_t
        key = _order_key(raw, SHIFT)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - shift)
        e = tl.where(mask, tl.exp(x - shift), 0.0)
        s = s * scale + tl.sum(e, 0)
        if SEARCH_K:
            above = (key[:, None] >= piv_k[None, :]) & mask[:, None]
            cnt += tl.sum(above.to(tl.int32), 0)
        if SEARCH_P:
            above = key[:, None] >= piv_p[None, :]
            mass = mass * scale + tl.sum(tl.where(above, e[:, None], 0.0), 0)
        m = m_new
    out = (i * CHUNKS + chunk) * (2 + PIVOTS)
    tl.store(Part + out, m)
    tl.store(Part + out + 1, s)
    j = tl.arange(0, PIVOTS)
    tl.store(Part + out + 2 + j, mass)  # zeros for a search this batch does not run
    tl.store(Cnt + (i * CHUNKS + chunk) * PIVOTS + j, cnt)


@triton.jit
def _narrow(Bounds, i, which: tl.constexpr, above, PIVOTS: tl.constexpr):
    """Narrow row i's interval to the pivots around the first one where `above` turns false: the
    answer (the largest key t whose statistic is above the row's threshold) stays in (lo, hi] or
    is lo, and the interval shrinks PIVOTS-fold."""
    lo, hi, piv = _pivots(Bounds, i, which, PIVOTS)
    j = tl.arange(0, PIVOTS)
    first = tl.min(tl.where(above, PIVOTS, j), 0)
    new_lo = tl.max(tl.where(j < first, piv, lo), 0)
    new_hi = tl.min(tl.where(j >= first, piv - 1, hi), 0)
    active = hi > lo
    tl.store(Bounds + i * 4 + 2 * which, tl.where(active, new_lo, lo))
    tl.store(Bounds + i * 4 + 2 * which + 1, tl.where(active, new_hi, hi))
    return tl.where(active, new_lo, lo)


@triton.jit(do_not_specialize=_SAMPLE_ARGS, do_not_specialize_on_alignment=_TRUNC_ROW_ARGS)
def _trunc_final_kernel(TopK, TopP, MinP, Bounds, Part, Cnt, Floor, MinX, rows_total,
                        CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, PIVOTS: tl.constexpr,
                        SEARCH: tl.constexpr, USE_PDL: tl.constexpr):
    """Row i: its max and sum of exponentials over all chunks, each search's interval narrowed
    (SEARCH: whether the batch searches at all), and the floor and min score the sampling pass
    keeps tokens by. One compiled form serves every batch that searches, whichever searches its
    rows need: the sums' rounding (their reduction order) must not depend on the batch, or a
    row's top-p floor would (measured: 9 of 1,024 fp32 rows moved by a token when the top-k
    search was compiled in or out)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P2)
    j = tl.arange(0, PIVOTS)
    cmask = c < CHUNKS
    at = (i * CHUNKS + c) * (2 + PIVOTS)
    m_c = tl.load(Part + at, mask=cmask, other=float("-inf"))
    s_c = tl.load(Part + at + 1, mask=cmask, other=0.0)
    big = tl.max(m_c, 0)
    shift = tl.where(big == float("-inf"), 0.0, big)
    w = tl.exp(m_c - shift)
    total = tl.sum(s_c * w, 0)
    lo_k = tl.load(Bounds + i * 4)
    lo_p = tl.load(Bounds + i * 4 + 2)
    if SEARCH:
        cnt = tl.sum(tl.load(Cnt + (i * CHUNKS + c)[:, None] * PIVOTS + j[None, :],
                             mask=cmask[:, None], other=0), 0)
        lo_k = _narrow(Bounds, i, 0, cnt.to(tl.float32) > tl.load(TopK + i).to(tl.float32) - 0.5,
                       PIVOTS)
        mass = tl.sum(tl.load(Part + at[:, None] + 2 + j[None, :], mask=cmask[:, None],
                              other=0.0) * w[:, None], 0)
        lo_p = _narrow(Bounds, i, 1, mass > tl.load(TopP + i) * total, PIVOTS)
    tl.store(Floor + i, tl.maximum(tl.maximum(lo_k, lo_p), -2147483648).to(tl.int32))
    min_p = tl.load(MinP + i)
    tl.store(MinX + i, tl.where(min_p > 0.0, big + tl.log(tl.maximum(min_p, 1e-30)),
                                float("-inf")))


def _key_bits(logits: torch.Tensor) -> int:
    """Bits of the order keys of `logits`: 16 for bf16 (exact), 32 otherwise."""
    return 16 if logits.dtype == torch.bfloat16 else 32


def truncation_bounds(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor,
                      top_k: list[int], top_p: list[float], min_p: list[float]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens row i (`logits[rows[i]] / temps[i]`) keeps under top-k, top-p and min-p, found
    without sorting: the token with raw logit x is kept iff its order key (`_order_key`) is at least
    `floor[i]` and its score x / T at least `min_x[i]`. Returns (floor int32, min_x fp32), each
    [len(rows)], on the logits' device; the parameters are host lists (no device sync).

    The kept set is the general path's (`sampler.truncate`): rank below `top_k[i]` (<= 0: no limit),
    probability mass of the tokens before it at most `top_p[i]`, probability at least `min_p[i]`
    times the top one's; the top token is always kept. Tokens tied on one key are kept or dropped
    together, where the sort gives them an arbitrary order. Keys are exact for bf16 logits (16
    bits) and fp32 / fp16 ones (32 bits): each pass reads every row once and narrows, for each
    search, an interval of keys at `TRUNC_PIVOTS` pivots (8 passes for bf16, 11 for fp32). A row's
    bounds depend on its own logits and parameters only."""
    from tide.memory.host_copy import device_tensor

    n = rows.shape[0]
    n_cols = logits.shape[1]
    device = logits.device
    chunks = triton.cdiv(n_cols, SAMPLE_CHUNK)
    bits = _key_bits(logits)
    none, top = -(2 ** (bits - 1)) - 1, 2 ** (bits - 1) - 1  # lo = none: every token is kept
    search_k = [0 < k < n_cols for k in top_k]
    search_p = [p < 1.0 for p in top_p]
    bounds: list[int] = []
    for sk, sp in zip(search_k, search_p):
        bounds += ([none, top] if sk else [none, none]) + ([none, top] if sp else [none, none])
    floor = torch.empty(n, dtype=torch.int32, device=device)
    min_x = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return floor, min_x
    bounds_t = device_tensor(bounds, torch.int64, device)
    k_t = device_tensor(top_k, torch.int64, device)
    p_t = device_tensor(top_p, torch.float32, device)
    minp_t = device_tensor(min_p, torch.float32, device)
    pivots = TRUNC_PIVOTS[bits]
    part = torch.empty(n, chunks, 2 + pivots, dtype=torch.float32, device=device)
    cnt = torch.empty(n, chunks, pivots, dtype=torch.int32, device=device)
    # Which searches the partial passes run is the batch's choice (their sums are the same either
    # way); a row that needs neither is done from the start. Min-p alone needs one pass (the max).
    any_k, any_p = any(search_k), any(search_p)
    use_pdl = pdl.enabled(logits)
    step = pivots.bit_length() - 1  # bits of key a pass settles (pivots: a power of 2)
    for _ in range(-(-bits // step) if any_k or any_p else 1):
        _trunc_partial_kernel[(n, chunks)](
            logits, rows, temps, bounds_t, part, cnt, n_cols, logits.stride(0), n, CHUNKS=chunks,
            CHUNK=SAMPLE_CHUNK, BLOCK=_TRUNC_BLOCK, PIVOTS=pivots, SHIFT=32 - bits,
            SEARCH_K=any_k, SEARCH_P=any_p, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
        _trunc_final_kernel[(n,)](
            k_t, p_t, minp_t, bounds_t, part, cnt, floor, min_x, n, CHUNKS=chunks,
            CHUNKS_P2=triton.next_power_of_2(chunks), PIVOTS=pivots, SEARCH=any_k or any_p,
            USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    return floor, min_x


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                logprobs: bool, truncation: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token for each row `rows[i]` of `logits` [B, vocab] (bf16, fp16 or fp32), reading it once.

    Row i's scores are `logits[rows[i]] * (1 / temps[i])` in fp32 (`temps` > 0). Where `seeds[i]` >= 0
    the token is a draw from their softmax by the Gumbel-max rule: argmax(score - log E) with
    E ~ Exp(1) made from Philox(key=seeds[i], counter=column // 4), so it depends on the seed and the
    row's logits only; where `seeds[i]` < 0 it is the first argmax of the scores. With `logprobs`, also each
    token's log-softmax of the scores. Returns int64 ids [len(rows)] and fp32 logprobs or None.
    `truncation`: `truncation_bounds` of these rows; the draw (or argmax) is then among each row's
    kept tokens, and the logprob still that of the untruncated scores, as the general path's.
    Programs cover `SAMPLE_CHUNK` columns each and the combine runs in column order, so a row's
    results do not depend on the batch it is in."""
    n = rows.shape[0]
    n_cols = logits.shape[1]
    chunks = triton.cdiv(n_cols, SAMPLE_CHUNK)
    part = torch.empty(3 if logprobs else 1, n, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device) if logprobs else out
    if n == 0:
        return out, (logp if logprobs else None)
    use_pdl = pdl.enabled(logits)
    floor, min_x = truncation if truncation is not None else (out, part)  # unread without it
    _sample_partial_kernel[(n, chunks)](logits, rows, temps, seeds, floor, min_x, part, idx, n_cols,
                                        logits.stride(0), n, CHUNKS=chunks, CHUNK=SAMPLE_CHUNK,
                                        BLOCK=_SAMPLE_BLOCK, LOGPROB=logprobs,
                                        TRUNC=truncation is not None, SHIFT=32 - _key_bits(logits),
                                        ASM=logits.is_cuda and not _INTERPRETED, USE_PDL=use_pdl,
                                        num_warps=4, launch_pdl=use_pdl)
    _sample_final_kernel[(n,)](logits, rows, temps, part, idx, out, logp, n_cols, logits.stride(0), n,
                               CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                               LOGPROB=logprobs, USE_PDL=use_pdl, num_warps=1, launch_pdl=use_pdl)
    return out, (logp if logprobs else None)
