"""Triton kernels for paged attention over `req_to_token`.

- Decode: split-KV. Stage 1 runs one program per (request, kv head, split) over a slice of the sequence
  for all q heads of that kv head's group (GQA-aware: the group rides the M dim of `tl.dot`), writing a
  partial output and its log-sum-exp; stage 2 merges the splits. The grid depends only on the batch
  size, so the pair can be captured in a CUDA graph; sequence lengths are read on the device.
- Extend: one program per (request, q head, block of new tokens), streaming the cached prefix and the
  new tokens (already stored in the pool) through `req_to_token` with a causal mask on the new part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tide.layers import pdl


@triton.jit
def _attend_block(q, K, V, slots, mask_n, keep, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                  offs_d, mask_d, sm_scale, m_i, l_i, acc):
    """One block of keys and values (pool rows `slots`) through online softmax for the query rows of
    `q`; `keep` [rows, BLOCK_N] says which scores count. Returns the updated (max, sum, output)."""
    k = tl.load(
        K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    qk = tl.where(keep, tl.dot(q, k) * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    v = tl.load(
        V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    sm_scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b)
    # Short sequences use fewer, longer splits; programs past the last one exit at once.
    per_split = tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), MIN_SPLIT_LEN)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if start >= end:
        return  # stage 2 only reads the splits that hold tokens

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_block(q, K, V, slots, mask_n, mask_n[None, :], kvh, stride_kt,
                                      stride_kh, stride_vt, stride_vh, offs_d, mask_d, sm_scale,
                                      m_i, l_i, acc)
    out = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    tl.store(
        MidO + b * stride_mb + offs_h[:, None] * stride_mh + split * stride_ms + offs_d[None, :],
        out,
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(MidLse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out, SeqLens,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ot, stride_oh,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    per_split = tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), MIN_SPLIT_LEN)
    active = tl.cdiv(seq_len, per_split)
    offs_s = tl.arange(0, NUM_SPLITS)
    mask_s = offs_s < active
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
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


MIN_SPLIT_LEN = 64
# Tokens per stage-1 iteration. With up to 128 splits this measured best at 8k and 32k context on an
# H200 (40 vs 50 us per layer at 32k with 64 splits of 64-token blocks; benchmarks/RESULTS.md).
DECODE_BLOCK_N = 32


def num_kv_splits(parallel_rows: int, max_splits: int) -> int:
    """Splits per (request, kv head): enough programs to fill the GPU when the batch is small."""
    splits = 1
    while splits < max_splits and parallel_rows * splits < 1024:
        splits *= 2
    return splits


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
) -> None:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    num_splits = num_kv_splits(batch * num_kv_heads, mid_lse.shape[2])
    block_d = triton.next_power_of_2(head_dim)
    use_pdl = pdl.enabled(q)
    _decode_stage1[(batch, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        sm_scale,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=block_d, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        USE_PDL=use_pdl, num_warps=4, num_stages=2, launch_pdl=use_pdl,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_D=block_d, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStarts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t, sm_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
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
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = prefix + offs_m
    kv_end = prefix + tl.minimum((mblk + 1) * BLOCK_M, ext_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal over the new tokens
        m_i, l_i, acc = _attend_block(q, K, V, slots, mask_n, keep, kvh, stride_kt, stride_kh,
                                      stride_vt, stride_vh, offs_d, mask_d, sm_scale, m_i, l_i, acc)
    out = acc / l_i[:, None]
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
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buffer.shape[1]
    block_m = 64
    use_pdl = pdl.enabled(q)
    grid = (req_pool_indices.shape[0], num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_starts,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), sm_scale,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
        USE_PDL=use_pdl, num_warps=4, num_stages=2, launch_pdl=use_pdl,
    )
