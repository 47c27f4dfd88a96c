"""Triton kernels for paged attention over `req_to_token`.

- Decode: split-KV. Stage 1 runs one program per (kv head, request, split) over a slice of the keys the
  query sees, for all q heads of that kv head's group (GQA-aware: the group rides the M dim of
  `tl.dot`), writing a partial output and its log-sum-exp; stage 2 merges the splits. The grid depends
  only on the batch size, so the pair can be captured in a CUDA graph; sequence lengths are read on the
  device. With PDL, head dim > 128 and a 2-byte cache (`split_kv.decode_prefetch`) a split's first block
  of keys streams in while the kernel before it (the layer's rope-and-store) still runs; only the
  newest key, which that kernel stores, waits. An fp8 V may be read as int16 words, two values each,
  and widened in registers (`DecodeBlocks.v_pairs`, `_widen_pairs`).
- Extend: one program per (request, q head, block of new tokens), streaming the keys the block's
  queries see (cached prefix, then the new tokens, already stored in the pool) through `req_to_token`
  with a causal mask on the new part.

Sliding-window layers (`sliding_window`: the query at position p sees keys p - window + 1 .. p, its own
token counts, as in transformers) start every key loop at the first key some query of the program
sees: decode reads exactly the last `window` keys and sizes its splits by that visible length, extend
starts at the window of the block's first query. A sliding layer therefore costs O(window) per token at
any context length, and no kernel ever loads a key slot that no query of the program may see (a pool
may have freed and reused, or never filled, the slots of keys that fell out of the window).
`logit_cap` (Gemma-2's soft-capping) maps the scaled scores through cap * tanh(score / cap) before
the causal/window mask and the softmax.

Block sizes and the key ranges the kernels visit live in `split_kv` (plain Python, the same
arithmetic), so tests and cost estimates can check them without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tide.layers import pdl
from tide.layers.attention.split_kv import (
    MIN_SPLIT_LEN,
    STAGE2_COLUMNS,
    decode_block_config,
    decode_prefetch,
    extend_block_config,
    num_kv_splits,
)
from tide.layers.triton_ops import INDEX_ARGS

# Triton's interpreter (TRITON_INTERPRET=1, chosen when triton is first imported) runs no inline PTX,
# on CPU or CUDA tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# log2(e): scores times this are in the base-2 units of `exp2`.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap) in fp32. tanh|x| = (1 - e^-2|x|) / (1 + e^-2|x|) is finite everywhere;
    below |x| = 1/8, where 1 - e^-2|x| loses digits, its odd series to x^7 (error < 1e-9)."""
    x = s / cap
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    x2 = ax * ax
    series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    th = tl.where(ax < 0.125, series, (1.0 - t) / (1.0 + t))
    return cap * tl.where(x < 0, -th, th)


@triton.jit
def _load_kv_block(K, V, slots, mask_n, kvh, stride_kt, stride_kh, stride_vt, stride_vh, offs_d,
                   mask_d, offs_v, mask_v):
    """Keys [D, BLOCK_N] and values [BLOCK_N, len(offs_v)] of pool rows `slots` (loaded where
    `mask_n`, else 0), in the pool's dtype. `offs_v` is `offs_d`, or with an fp8 pool viewed as
    int16 words (`V_PAIRS` of `_decode_stage1`) the word columns: two values each."""
    k = tl.load(
        K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    v = tl.load(
        V + slots[:, None] * stride_vt + kvh * stride_vh + offs_v[None, :],
        mask=mask_n[:, None] & mask_v[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _widen_pairs(w, ASM: tl.constexpr):
    """fp16 [N, 2 * W] of int16 words [N, W], each two e4m3 values (the low byte first). On the GPU
    (`ASM`) one `cvt.rn.f16x2.e4m3x2` a word; the interpreter, which runs no PTX, shifts and masks.

    Why words: with the fp8 values themselves, the pipeliner loads V from shared memory straight
    into the layout of the P @ V dot, which for 8-bit values that the dot reduces over tokens (V is
    token-major) means a byte at a time (ldmatrix has no 8-bit transpose): 128 byte loads and ~280
    packing instructions a thread per 128-key block. Words load from shared memory 16 bytes at a
    time, widen in registers, and reach the dot as fp16 through shared memory, which ldmatrix
    transposes. At head dim 128 that cuts the sm_90 key loop from 1,370 to 1,050 instructions; it
    measured no faster at 3 stages, faster at 5 and at head dim 256 (`split_kv.decode_block_config`)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        return _sixteen_bit_operand(tl.reshape(tl.join(lo, hi), [w.shape[0], 2 * w.shape[1]]))
    lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), [w.shape[0], 2 * w.shape[1]])


@triton.jit
def _sixteen_bit_operand(x):
    """`x` (fp16) unchanged, behind a `mov` the compiler cannot see through (GPU only).

    For an MMAv2 dot, Triton 3.6 (the GPU hosts' version) sizes the operands' register fragments
    (`kWidth`) by the narrowest value the operands trace back to through loads and elementwise
    ops, halved once more if a `join` lies on the way (`computeOrigBitWidth`). Widened fp8 words
    trace back to 16-bit loads through a join, so the P @ V dot was laid out as for 8-bit operands
    (kWidth 4): its P operand came from shared memory in 64-bit loads assembled by register moves
    instead of by `ldmatrix` (sm_90 key loop: 1,057 instructions, 863 with this boundary). An asm
    statement with side effects ends that trace; ptxas drops the `mov` itself. (Triton 3.9 already
    gives this dot kWidth 2 and compiles the same code with or without the boundary.) One H100, 256
    requests of ~830 tokens: fp8 stage 1 185.4 -> 173.9 us (Qwen3 heads), 186.9 -> 175.3 (Llama
    heads), both at the old register cap; head dim 256: 371 -> 350. Triton's pipeliner cannot
    predicate an asm with side effects, so it must stay in the loop's last stage, beside the
    P @ V dot that uses it."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _scores_to_weights(q, k, keep, sm_scale, logit_cap, m_i, SOFT_CAP: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, LOG2: tl.constexpr):
    """Online-softmax step for one block of keys `k` [D, BLOCK_N] (cache dtype): the new running
    max, the block's weights p and the factor alpha that rescales what was accumulated before.
    `keep` [rows, BLOCK_N] says which scores count. With `LOG2` the scores and the running max are
    in base-2 units (the scale folded into one multiply, `exp2`): the weights are the same, and
    the per-score work is shorter than `tl.exp`'s (extend, where it measured faster)."""
    # K/V widen to the query's dtype: fp16 with an fp8 cache (see `_query_for`), else a no-op.
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
    if SOFT_CAP:
        s = _soft_cap(s * sm_scale, logit_cap)
        if LOG2:
            s = s * LOG2E
    elif LOG2:
        s = s * (sm_scale * LOG2E)
    else:
        s = s * sm_scale
    qk = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows with no kept score yet (extend rows past the new tokens; rows whose window starts after
    # this block if BLOCK_M > BLOCK_N) subtract 0, not -inf: exp(-inf) = 0 there, never NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if LOG2:
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        p = tl.exp(qk - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
    return m_new, p, alpha


@triton.jit
def _attend_kv(q, k, v, keep, sm_scale, logit_cap, m_i, l_i, acc, SOFT_CAP: tl.constexpr,
               DOT_PRECISION: tl.constexpr, V_PAIRS: tl.constexpr, ASM: tl.constexpr):
    """One loaded block of keys and values through online softmax for the query rows of `q`.
    Returns the updated (max, sum, output). A row that has kept no score yet stays at max -inf,
    sum 0, output 0. Decode loads a block's keys and values together (`_load_kv_block`); with
    `V_PAIRS`, `v` holds int16 words of fp8 pairs and is widened here."""
    m_new, p, alpha = _scores_to_weights(q, k, keep, sm_scale, logit_cap, m_i, SOFT_CAP,
                                         DOT_PRECISION, False)
    if V_PAIRS:
        v = _widen_pairs(v, ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_block(q, K, V, slots, mask_n, keep, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                  offs_d, mask_d, sm_scale, logit_cap, m_i, l_i, acc, SOFT_CAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Extend's step: `_attend_kv` of the keys and values at pool rows `slots` (loaded where
    `mask_n`), the values loaded after the scores."""
    k = tl.load(
        K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    m_new, p, alpha = _scores_to_weights(q, k, keep, sm_scale, logit_cap, m_i, SOFT_CAP,
                                         DOT_PRECISION, True)
    v = tl.load(
        V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    ).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _query_for(q, K):
    """The query as the dots take it: with an fp8 cache, fp16, because e4m3 widens to fp16 in one
    instruction on sm89+ (to bf16 it takes several) and every e4m3 value is exact in fp16."""
    if K.dtype.element_ty == tl.float8e4nv:
        q = q.to(tl.float16)
    return q


@triton.jit
def _load_query(Q, b, stride_qt, stride_qh, offs_h, mask_h, offs_d, mask_d, K):
    """The decode query rows of request `b`'s heads `offs_h`, as the dots take them."""
    return _query_for(tl.load(
        Q + b * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ), K)


@triton.jit
def _decode_visible_start(seq_len, sliding_window, SLIDING: tl.constexpr):
    """Position of the first key the decode query (at position seq_len - 1) sees."""
    start = seq_len * 0
    if SLIDING:
        start = tl.maximum(seq_len - sliding_window, 0)
    return start


@triton.jit
def _decode_split_len(visible_len, NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr):
    """Keys per split: short visible ranges use fewer, longer splits."""
    return tl.maximum(tl.cdiv(visible_len, NUM_SPLITS), MIN_SPLIT_LEN)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ot, stride_oh,
    sm_scale, sliding_window, logit_cap,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
    V_PAIRS: tl.constexpr, ASM: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The kv heads of a request are consecutive programs (axis 0), so the programs running at once
    # read whole tokens' rows of the pool (all heads of a token lie together) rather than one head's
    # slice of many requests' rows: +2.5% of copy bandwidth for bf16 at 256 requests (H100).
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b)
    # The splits cover only the visible keys; programs past the last split exit at once.
    kv_start = _decode_visible_start(seq_len, sliding_window, SLIDING)
    per_split = _decode_split_len(seq_len - kv_start, NUM_SPLITS, MIN_SPLIT_LEN)
    start = kv_start + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if start >= end:
        # Stage 2 only reads the splits that hold tokens. Split 0 always holds one (seq_len >= 1)
        # and waits, so this launch still ends after the one before it (PDL's chain).
        return

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if V_PAIRS:
        # V is the fp8 pool viewed as int16 words (strides in words), two values a word.
        offs_v = tl.arange(0, BLOCK_D // 2)
        mask_v = offs_v < HEAD_DIM // 2
    else:
        offs_v = offs_d
        mask_v = mask_d
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        # The first block of keys streams in before the wait: the step's inputs, the request table
        # and the KV of earlier tokens were written by operations without PDL, which every kernel
        # of the forward waited for. The newest token's K/V come from the layer's rope-and-store
        # (PDL, maybe still running): it is left out, and a first block that holds it loads again
        # after the wait. (Without PDL there is nothing to overlap; the same steps, same result.)
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        early = mask_n & (offs_n < seq_len - 1)
        slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=early, other=0).to(tl.int64)
        k, v = _load_kv_block(K, V, slots, early, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                              offs_d, mask_d, offs_v, mask_v)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        if end == seq_len and start + BLOCK_N >= seq_len:
            slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            k, v = _load_kv_block(K, V, slots, mask_n, kvh, stride_kt, stride_kh, stride_vt,
                                  stride_vh, offs_d, mask_d, offs_v, mask_v)
        q = _load_query(Q, b, stride_qt, stride_qh, offs_h, mask_h, offs_d, mask_d, K)
        m_i, l_i, acc = _attend_kv(q, k, v, mask_n[None, :], sm_scale, logit_cap, m_i, l_i, acc,
                                   SOFT_CAP, DOT_PRECISION, V_PAIRS, ASM)
        loop_start = start + BLOCK_N
    else:
        # Every block in the pipelined loop (peeling the first one out of it measured slower at
        # long contexts).
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        q = _load_query(Q, b, stride_qt, stride_qh, offs_h, mask_h, offs_d, mask_d, K)
        loop_start = start
    for n0 in range(loop_start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        k, v = _load_kv_block(K, V, slots, mask_n, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                              offs_d, mask_d, offs_v, mask_v)
        m_i, l_i, acc = _attend_kv(q, k, v, mask_n[None, :], sm_scale, logit_cap, m_i, l_i, acc,
                                   SOFT_CAP, DOT_PRECISION, V_PAIRS, ASM)
    out = acc / l_i[:, None]
    if NUM_SPLITS == 1:
        # One split holds every visible key (large batches): its output is final, and stage 2
        # (which would divide it by a weight of exactly 1) does not run.
        tl.store(
            Out + b * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = m_i + tl.log(l_i)
        tl.store(
            MidO + b * stride_mb + offs_h[:, None] * stride_mh + split * stride_ms
            + offs_d[None, :],
            out,
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(MidLse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _decode_stage2(
    MidO, MidLse, Out, SeqLens,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ot, stride_oh,
    sliding_window,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr, SLIDING: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Merges the splits of one head's output, BLOCK_D columns of it per program (axis 2): each
    program holds NUM_SPLITS x BLOCK_D partial outputs, few enough registers at head dim 256."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)  # an input of the step: read before the wait
    visible = seq_len - _decode_visible_start(seq_len, sliding_window, SLIDING)
    active = tl.cdiv(visible, _decode_split_len(visible, NUM_SPLITS, MIN_SPLIT_LEN))
    offs_s = tl.arange(0, NUM_SPLITS)
    mask_s = offs_s < active
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    o = tl.load(
        MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def stage2_columns(head_dim: int) -> int:
    """Head-dim columns one stage-2 program merges."""
    return min(triton.next_power_of_2(head_dim), STAGE2_COLUMNS)


@functools.cache
def _opt_in_shared_bytes(device: torch.device) -> int:
    """Shared memory one block may opt in to on `device` (227 KB on sm_90, ~99 KB on sm_89): the
    limit Triton checks a launch against."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def _dot_precision(q: torch.Tensor) -> str:
    """fp32 models get fp32 products (as torch's matmul by default), not TF32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hk, D]
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [B, Hq, D]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,  # [B, Hq, NUM_SPLITS, D] fp32
    mid_lse: torch.Tensor,  # [B, Hq, NUM_SPLITS] fp32
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    *,
    prefetch: bool | None = None,
) -> None:
    """One decode query per request over its keys (the last `sliding_window` of them for a sliding
    layer), scores soft-capped at `logit_cap` when given. `prefetch`: whether a split's first key
    block loads before the PDL wait (None: with PDL, where `split_kv.decode_prefetch` says); True
    also without PDL runs the same steps (the CPU tests do)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    num_splits = num_kv_splits(batch * num_kv_heads, mid_lse.shape[2])
    block_d = triton.next_power_of_2(head_dim)
    sliding = sliding_window is not None
    window = sliding_window if sliding else 0
    use_pdl = pdl.enabled(q)
    blocks = decode_block_config(num_splits, head_dim, k_buffer.element_size(), group,
                                 _opt_in_shared_bytes(q.device) if q.is_cuda else None)
    block_n = blocks.block_n
    if prefetch is None:
        prefetch = use_pdl and decode_prefetch(head_dim, block_n, k_buffer.element_size())
    # Words widen as e4m3 (the cache's fp8 type); odd head dims read bytes.
    v_pairs = blocks.v_pairs and v_buffer.dtype == torch.float8_e4m3fn and head_dim % 2 == 0
    v_view = v_buffer.view(torch.int16) if v_pairs else v_buffer
    _decode_stage1[(num_kv_heads, batch, num_splits)](
        q, k_buffer, v_view, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_view.stride(0), v_view.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), sm_scale, window, logit_cap if logit_cap is not None else 1.0,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        SLIDING=sliding, SOFT_CAP=logit_cap is not None, DOT_PRECISION=_dot_precision(q),
        USE_PDL=use_pdl, PREFETCH=prefetch, V_PAIRS=v_pairs, ASM=q.is_cuda and not INTERPRETED,
        num_warps=blocks.warps, num_stages=blocks.stages,
        launch_pdl=use_pdl,
    )
    if num_splits == 1:
        return  # stage 1 wrote the output
    columns = stage2_columns(head_dim)
    _decode_stage2[(batch, num_heads, triton.cdiv(head_dim, columns))](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), window,
        BLOCK_D=columns, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        SLIDING=sliding, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStarts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t, sm_scale, sliding_window, logit_cap,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b)
    if mblk * BLOCK_M >= ext_len:
        return
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(ExtendStarts + b)
    req = tl.load(ReqPoolIdx + b)
    kvh = h // GROUP
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = _query_for(tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ), K)
    q_pos = prefix + offs_m
    kv_end = prefix + tl.minimum((mblk + 1) * BLOCK_M, ext_len)
    # Every key from kv_start on is seen by some query of the block (the first query sees back to
    # kv_start, each new token sees itself): nothing outside the window is loaded.
    kv_start = prefix * 0
    # Keys before the block's first query are seen by every row of the block: those blocks need no
    # causal mask. A window's lower edge differs by row, so a sliding layer masks every block.
    diag_start = prefix + mblk * BLOCK_M
    if SLIDING:
        kv_start = tl.maximum(prefix + mblk * BLOCK_M - sliding_window + 1, 0)
        diag_start = kv_start
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slot_row = ReqToToken + req * stride_r2t
    for n0 in range(kv_start, diag_start, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < diag_start
        slots = tl.load(slot_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_block(q, K, V, slots, mask_n, mask_n[None, :], kvh, stride_kt,
                                      stride_kh, stride_vt, stride_vh, offs_d, mask_d, sm_scale,
                                      logit_cap, m_i, l_i, acc, SOFT_CAP, DOT_PRECISION)
    for n0 in range(diag_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(slot_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal over the new tokens
        if SLIDING:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        m_i, l_i, acc = _attend_block(q, K, V, slots, mask_n, keep, kvh, stride_kt, stride_kh,
                                      stride_vt, stride_vh, offs_d, mask_d, sm_scale, logit_cap,
                                      m_i, l_i, acc, SOFT_CAP, DOT_PRECISION)
    # Rows past ext_len are not stored; a row with no kept key (none here) would divide 0 by 1.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> None:
    """Causal attention of each request's new tokens over its cached prefix and themselves (within
    `sliding_window` for a sliding layer), scores soft-capped at `logit_cap` when given."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buffer.shape[1]
    sliding = sliding_window is not None
    use_pdl = pdl.enabled(q)
    blocks = extend_block_config(head_dim, k_buffer.element_size(),
                                 _opt_in_shared_bytes(q.device) if q.is_cuda else None)
    grid = (req_pool_indices.shape[0], num_heads, triton.cdiv(max_extend_len, blocks.block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_starts,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), sm_scale, sliding_window if sliding else 0,
        logit_cap if logit_cap is not None else 1.0,
        GROUP=group, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
        SLIDING=sliding, SOFT_CAP=logit_cap is not None, DOT_PRECISION=_dot_precision(q),
        USE_PDL=use_pdl, num_warps=blocks.warps, num_stages=blocks.stages, launch_pdl=use_pdl,
    )
