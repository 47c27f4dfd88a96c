"""Batch-invariant Triton kernels: the CUDA half of `enable_deterministic_inference`.

Invariant here: the bits of one row's result depend only on that row's inputs (and, for attention,
the token's own context), never on how many rows share the launch or where the row sits. Each op
gets it by construction, not by tuning luck:

- `linear`: a persistent GEMM that never splits K and always steps through K in `K_STEP`-column
  slices, first to last, into an fp32 accumulator. A row's dot products are then the same sequence
  of MMA steps whether M is 1 or 8192, and which tile a row lands in changes nothing, as an MMA
  output row reads only its own A row. The tile shape (BLOCK_M/N, warps, stages) is picked from M
  (`gemm_config`) only where the device has been shown to give bit-equal rows for every tile shape
  tide picks at that K and dtype (`tile_shapes_agree`, checked once per process and device; on an
  H100, bf16, mma.sync and wgmma tiles from 16x16 to 128x256, loaded through pointers or TMA,
  agree). Where it has not, one tile shape per (N, K) serves every M (`fixed_config`). (cuBLAS is
  never used: it picks its algorithm and split-K from M.)
- `attention`: ONE kernel serves decode and extend. A program takes BLOCK_M (token, q head) rows of
  one request and one kv head. The keys are cut into splits at fixed positions (ATTN_SPLIT keys
  each, from position 0); within a split the keys stream in BLOCK_N-key blocks, in order, with the
  online softmax per row, and keys after a row's own position are masked to exact zeros (a no-op on
  its running max, sum and output); the splits' partials are merged in split order by `_fold`. A
  token's reduction order is therefore a function of its position only: the same in a decode step
  (one token), a prefill, any chunk of a chunked prefill and on top of a cached prefix, whatever
  else is in the batch. The decode call is the extend kernel with one new token per request (a
  runtime flag). Where `decode_tiles_agree` (checked once per shape and device before graph
  capture) it runs 16-row programs on one warp instead of 64 rows on four: every warp then holds
  its rows in the same layout, so the same instructions reduce a row in the same order; elsewhere
  it is extend's machine code itself. Small decode batches run a token's splits in parallel
  programs that write their partials, and `_combine_kernel` merges them with the same `_fold` in
  the same order (elementwise IEEE ops, no fusion: the same bits as the in-kernel merge); the
  split positions never depend on the batch, only which program computes a split does.
- `log_softmax`: one program per row, a fixed chunked pass over the vocabulary.
- `rms_norm`: one program per row (Gemma's fp32 form; the Llama-style RMSNorm in `triton_ops` is
  already one program per row with a block set by the hidden size only).

Elementwise float ops are compiled with `enable_fp_fusion=False`, so no multiply-add is contracted
differently in one context than in another. Every kernel keeps `tide.layers.pdl`'s contract (launch
dependents, then wait, before any load).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime import errors as _triton_errors

try:  # Triton >= 3.4; older ones load every tile through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from tide.layers import pdl
from tide.layers.triton_ops import INDEX_ARGS

logger = logging.getLogger(__name__)

_NO_FUSION = {"enable_fp_fusion": False}


# ---------------------------------------------------------------------------------------------- GEMM


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of `linear`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # Persistent programs per SM (the grid is this times the SM count, at most one per tile). Which
    # program computes a tile never changes the tile's bits, so this is free to tune.
    programs_per_sm: int = 1
    # Load the A and W tiles through TMA tensor descriptors (Hopper and later; `_tma_ok`) instead of
    # per-thread pointer loads. The same MMA steps in the same K order: the same bits (measured on
    # an H100 at every projection of Llama-3.1-8B and M = 1-8192, and checked at start-up by
    # `tile_shapes_agree` with the other shapes). Elsewhere the pointer kernel runs the same tiles.
    tma: bool = False


K_STEP = 64  # every tile's BLOCK_K: it fixes the order of a row's K reduction


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The tile shape for an [m, k] x [k, n] product where tile shapes agree (`tile_shapes_agree`).

    Measured on an H100 (bf16, Llama-3.1-8B projections, `python -m benchmarks.deterministic --only
    gemm` and sweeps over the decode graphs' batch sizes): up to 8 rows, 16-row mma tiles over 64
    columns spread the weight stream over every SM (at one row on 8 warps: 1.00-1.43x cuBLAS).
    Up to 64 rows: 64x128 tiles for wide outputs (N >= 16384), 64x32 (two programs per SM) for the
    others. 65-128 rows where N < 6144: 64x64 tiles on 8 warps, two programs per SM (o and down
    1.01-1.39x cuBLAS against 1.14-1.74x with 64x32). Those shapes and every shape up to 64 rows
    load through pointers; the rest load through TMA (cuBLAS ratio, pointer loads -> TMA, two sweeps
    on 2026-11-26, H100): 65-128 rows, 64x128 tiles on 6 stages (qkv at 96-128 rows 1.12-1.16 ->
    1.06-1.07), two programs per SM on 4 stages for wide outputs (gate_up 1.02-1.31 -> 1.00-1.03).
    129-256 rows: 64x128 tiles, two programs per SM on 4 stages (qkv at 192 rows 1.59 -> 1.25); on 6
    stages, one program per SM, where N < 6144 (o at 256 rows 1.42 -> 0.98, down 1.43 -> 1.04);
    128x256 on 4 stages for wide outputs from 193 rows (gate_up 1.17 -> 1.04). Beyond 256 rows,
    128x256 tiles on 4 stages (M = 8192: qkv 1.24 -> 1.06, gate_up 1.22 -> 0.93, down 1.36 -> 1.02),
    128x128 for narrow outputs up to 512 rows. Every shape steps K by `K_STEP`.
    """
    if m == 1:
        return GemmConfig(16, 64, K_STEP, num_warps=8, num_stages=6)
    if m <= 8:
        return GemmConfig(16, 64, K_STEP, num_warps=4, num_stages=8)
    wide = n >= 16384
    narrow = n < 6144
    if m <= 64:
        if wide:
            return GemmConfig(64, 128, K_STEP, num_warps=4, num_stages=4)
        return GemmConfig(64, 32, K_STEP, num_warps=4, num_stages=8, programs_per_sm=2)
    if narrow and m <= 256:
        if m <= 128:
            return GemmConfig(64, 64, K_STEP, num_warps=8, num_stages=6, programs_per_sm=2)
        return GemmConfig(64, 128, K_STEP, num_warps=4, num_stages=6, tma=True)
    if m <= 128:
        if wide:
            return GemmConfig(64, 128, K_STEP, num_warps=4, num_stages=4, programs_per_sm=2,
                              tma=True)
        return GemmConfig(64, 128, K_STEP, num_warps=4, num_stages=6, tma=True)
    if m <= 192 or (m <= 256 and not wide):
        return GemmConfig(64, 128, K_STEP, num_warps=4, num_stages=4, programs_per_sm=2, tma=True)
    if m > 512 or not narrow:
        return GemmConfig(128, 256, K_STEP, num_warps=8, num_stages=4, tma=True)
    return GemmConfig(128, 128, K_STEP, num_warps=8, num_stages=4, tma=True)


def fixed_config(n: int, k: int) -> GemmConfig:
    """The one tile shape that serves every M of an (n, k) product where tile shapes have not been
    shown to agree: 128-row tiles keep prefill compute-efficient; narrow outputs use 64-wide
    column tiles so a decode GEMM still spreads over enough SMs."""
    if n >= 8192:
        return GemmConfig(128, 128, K_STEP, num_warps=8, num_stages=3)
    return GemmConfig(128, 64, K_STEP, num_warps=4, num_stages=4)


# Every tile shape `gemm_config` or `fixed_config` can return: `tile_shapes_agree` checks them all,
# so a product run with any of them gives the bits of any other.
_PROBE_ROWS = (1, 8, 64, 128, 192, 256, 512, 1024)
_PROBE_COLS = (4096, 6144, 16384)


def _candidate_configs(k: int) -> list[GemmConfig]:
    configs = [gemm_config(m, n, k) for m in _PROBE_ROWS for n in _PROBE_COLS]
    configs += [fixed_config(n, k) for n in _PROBE_COLS]
    # A TMA shape runs the pointer kernel where TMA cannot carry the operands (`_tma_ok`).
    configs += [dataclasses.replace(c, tma=False) for c in configs if c.tma]
    return list(dict.fromkeys(configs))


_AGREE: dict[tuple[int, torch.dtype, torch.device], bool] = {}
# A tile shape the device cannot compile or run counts as disagreeing (PTXASError: newer Triton).
_CANNOT_RUN = tuple(e for e in (_triton_errors.OutOfResources,
                                getattr(_triton_errors, "PTXASError", None), CompilationError)
                    if e is not None)


def _device_key(device: torch.device | str) -> torch.device:
    """`device` with its index (the current CUDA device for a bare "cuda"), as tensors report it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def tile_shapes_agree(k: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether every tile shape tide may pick gives bit-equal rows for products of inner size `k`
    in `dtype` on `device`: a random [128, k] x [k, 256] product with a bias, one run per shape,
    compared bit for bit (a shape the device cannot compile or run counts as disagreeing). Checked
    once per (k, dtype, device) and remembered; `set_batch_invariant` checks every projection of a
    model before any CUDA graph is captured (a product first met during capture uses
    `fixed_config`)."""
    key = (k, dtype, _device_key(device))
    known = _AGREE.get(key)
    if known is not None:
        return known
    gen = torch.Generator(device="cpu").manual_seed(k)
    x = torch.randn(128, k, generator=gen).to(device=key[2], dtype=dtype)
    w = (torch.randn(256, k, generator=gen) * k**-0.5).to(device=key[2], dtype=dtype)
    bias = torch.randn(256, generator=gen).to(device=key[2], dtype=dtype)
    agree = True
    reason = "agree bit for bit: picked by M"
    ref = None
    for cfg in _candidate_configs(k):
        try:
            y = linear(x, w, bias, config=cfg)
        except _CANNOT_RUN as e:
            agree, reason = False, f"{cfg} cannot run here ({type(e).__name__}): one shape for every M"
            break
        if ref is None:
            ref = y
        elif not torch.equal(y, ref):
            agree, reason = False, f"{cfg} gives other bits: one shape for every M"
            break
    _AGREE[key] = agree
    logger.info("batch-invariant GEMM, K=%d %s on %s: tile shapes %s", k, dtype, key[2], reason)
    return agree


def _pick_config(m: int, n: int, k: int, x: torch.Tensor) -> GemmConfig:
    key = (k, x.dtype, x.device)
    agree = _AGREE.get(key)
    if agree is None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        agree = tile_shapes_agree(k, x.dtype, x.device)
    return gemm_config(m, n, k) if agree else fixed_config(n, k)


def _precision(x: torch.Tensor) -> str:
    """fp32 operands are multiplied in full fp32 ("ieee", as torch does by default), not TF32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of persistent tile number `tile`, in grouped order: GROUP_M row
    tiles walk the column tiles together (weight tiles stay in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_size, (tile % per_group) // group_size


# M, the program count and whether there is a bias are run-time values, so a kernel compiles once
# per tile shape (and K's evenness, dtype): `tile_shapes_agree` runs every shape tide may pick at
# start-up, and no batch size compiles anything later (a compile while serving stalls every
# request).
@triton.jit(do_not_specialize=["M", "num_progs", "has_bias"])
def _matmul_kernel(A, W, Bias, C, M, N, K, stride_am, stride_wn, stride_cm, num_progs, has_bias,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_m * num_n, num_progs):
        pm, pn = _tile_coords(tile, num_m, num_n, GROUP_M)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range rows/columns read a valid row (never stored), so the loads need no row mask.
        rm_load = (rm % M).to(tl.int64)
        rn_load = (rn % N).to(tl.int64)
        a_ptrs = A + rm_load[:, None] * stride_am + offs_k[None, :]
        w_ptrs = W + rn_load[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
                w = tl.load(w_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if has_bias != 0:
            acc += tl.load(Bias + rn_load).to(tl.float32)[None, :]
        c_ptrs = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M", "num_progs", "has_bias"])
def _matmul_tma_kernel(a_desc, w_desc, Bias, C, M, N, K, stride_cm, num_progs, has_bias,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr):
    """`_matmul_kernel` with its tiles loaded through TMA descriptors ([M, K] and [N, K], blocks of
    BLOCK_K columns). Rows and columns past the descriptors' shapes load as zeros (a ragged last
    K slice too, as the pointer kernel's mask) and are never stored."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, num_m * num_n, num_progs):
        pm, pn = _tile_coords(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pm * BLOCK_M, k0])
            w = w_desc.load([pn * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, input_precision=PRECISION)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        if has_bias != 0:
            acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA descriptors can carry x [M, K] and weight [N, K]: 16-byte aligned bases and row
    strides, on a Hopper or later GPU (or under Triton's CPU interpreter, for tests)."""
    if TensorDescriptor is None:
        return False
    if x.is_cuda:
        if not _has_tma(x.device.index or 0):
            return False
    elif os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    return weight.shape[0] > 0 and all(
        t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
        and t.stride(0) >= t.shape[1] for t in (x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemmConfig | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x [..., K], weight [N, K]; fp32 accumulation, rounded to x's dtype.
    Row-for-row equal whatever the number of rows (module doc). `config` overrides the pick
    (benchmarks and tests; its BLOCK_K decides the bits)."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features, x has {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    cfg = config or _pick_config(m, n, k, x2)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 2
    progs = min(tiles, sms * cfg.programs_per_sm)
    use_pdl = pdl.enabled(x)
    bias_arg = bias if bias is not None else weight
    if cfg.tma and _tma_ok(x2, weight):
        _matmul_tma_kernel[(progs,)](
            TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [cfg.block_m, cfg.block_k]),
            TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, cfg.block_k]),
            bias_arg, out, m, n, k, out.stride(0), progs, int(bias is not None),
            PRECISION=_precision(x), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, USE_PDL=use_pdl, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, launch_pdl=use_pdl,
        )
        return out.reshape(*lead, n)
    _matmul_kernel[(progs,)](
        x2, weight, bias_arg, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), progs, int(bias is not None),
        EVEN_K=k % cfg.block_k == 0, PRECISION=_precision(x),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        USE_PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl,
    )
    return out.reshape(*lead, n)


# ------------------------------------------------------------------------------- row-wise reductions


@triton.jit
def _log_softmax_kernel(X, Out, n_cols, stride_x, stride_o, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # Pass 1: per-lane running max and sum over BLOCK-wide chunks, then one fixed reduction.
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(X + row * stride_x + c0 + cols, mask=c0 + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane that has seen only -inf keeps sum 0 (and no NaN from -inf - -inf).
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    shift = row_max + tl.log(total)
    for c0 in range(0, n_cols, BLOCK):
        mask = c0 + cols < n_cols
        x = tl.load(X + row * stride_x + c0 + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + c0 + cols, x - shift, mask=mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the last dim of a 2-D tensor, one program per row."""
    if x.dim() != 2:
        raise ValueError(f"log_softmax takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(4096, triton.next_power_of_2(x.shape[1]))
    use_pdl = pdl.enabled(x)
    _log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=block,
                                       USE_PDL=use_pdl, num_warps=8 if block >= 2048 else 4,
                                       launch_pdl=use_pdl, **_NO_FUSION)
    return out


@triton.jit
def _rms_norm_kernel(X, W, Out, n_cols, stride_x, stride_o, eps, offset, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * (w + offset)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (weight + offset), all in fp32, rounded once to x's dtype (the
    Gemma form, offset 1.0), one program per row."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(shape)
    block = triton.next_power_of_2(shape[-1])
    use_pdl = pdl.enabled(x)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, shape[-1], x2.stride(0), out.stride(0), eps,
                                     offset, BLOCK=block, USE_PDL=use_pdl,
                                     num_warps=min(16, max(1, block // 256)), launch_pdl=use_pdl,
                                     **_NO_FUSION)
    return out.view(shape)


# ----------------------------------------------------------------------------------------- attention

ATTN_BLOCK_M = 64  # (token, q head) rows per program, on 4 warps (16 rows a warp)
# A decode step's programs (one token: its q heads of one kv head) where `decode_tiles_agree`: 16
# rows on one warp, a quarter of extend's softmax work on padding rows. Each warp of extend's
# programs holds 16 rows laid out as this one warp does, so a row's reductions run in the same
# order (measured on an H100: equal bits; 2, 4 warps or 32 rows differ). At head dim 256 one warp
# holds too much (slower than extend's programs, measured), so decode keeps extend's there.
ATTN_DECODE_BLOCK_M = 16
ATTN_DECODE_MAX_HEAD_DIM = 128
# The one-warp decode programs stream K/V through 3 stages (extend's 4-warp programs: 2). Measured
# on an H100, 256 requests of 100-1600 keys, 32/8 heads of 128, with int32 KV offsets: 318.5 us a
# layer on 2 stages, 308.0 on 3 (339.1 before either; the default kernel 299.6).
_DECODE_ROW_STAGES = 3
ATTN_BLOCK_N = 64  # keys per step of the online softmax
ATTN_SPLIT = 512  # keys per split: positions [s * ATTN_SPLIT, (s + 1) * ATTN_SPLIT) form split s


@triton.jit
def _fold(o, lse, o_s, lse_s):
    """Merge split partial (o_s, lse_s) into the running (o, lse). The one merge both the attention
    kernel and `_combine_kernel` use: elementwise only, so (without fp fusion) it gives the same bits
    in either kernel. Merging into the empty state (0, -inf) returns (o_s, lse_s) exactly."""
    m = tl.maximum(lse, lse_s)
    w_old = tl.exp(lse - m)
    w_new = tl.exp(lse_s - m)
    total = w_old + w_new
    o = (o * w_old[:, None] + o_s * w_new[:, None]) / total[:, None]
    return o, m + tl.log(total)


@triton.jit
def _first_split(q_pos, window, SPLIT: tl.constexpr):
    """The first split holding a key the query at q_pos sees (window 0: no window)."""
    lo = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)
    return lo // SPLIT


@triton.jit
def _soft_cap(x, cap):
    """cap * tanh(x / cap), with tanh(y) = 1 - 2 / (e^2y + 1): finite for every x."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (x / cap)) + 1.0))


@triton.jit(do_not_specialize=["is_decode", "write_partials", "split_progs", "window"],
            do_not_specialize_on_alignment=INDEX_ARGS)
def _attention_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, SeqLens, ExtendLens, ExtendStarts, MidO, MidLse, Order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    sm_scale, logit_cap, is_decode, write_partials, split_progs, window,
    HAS_CAP: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, ORDERED: tl.constexpr, HAS_WINDOW: tl.constexpr, IDX64: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    TOKENS: tl.constexpr = BLOCK_M // GROUP_P
    if ORDERED:
        # Grid (kv heads, requests): the SMs take programs in launch order, so the requests'
        # programs start longest first (Order) and the short ones fill the tail.
        kvh = tl.program_id(0)
        b = tl.load(Order + tl.program_id(1))
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    if is_decode != 0:
        ext_len = seq_len * 0 + 1
        q_start = (seq_len * 0 + b).to(tl.int64)
    else:
        ext_len = tl.load(ExtendLens + b)
        q_start = tl.load(ExtendStarts + b).to(tl.int64)
    # Either one block of tokens through every split (folded here), or, for a decode step with
    # `write_partials`, one token through splits first, first + split_progs, ... (partials to MidO).
    zero = b * 0
    if write_partials != 0:
        mblk = zero
        first = zero + tl.program_id(2)
        step = zero + split_progs
    else:
        mblk = zero + tl.program_id(2)
        first = zero
        step = zero + 1
    if mblk * TOKENS >= ext_len:
        return
    prefix = seq_len - ext_len
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    tok = mblk * TOKENS + rows // GROUP_P
    g = rows % GROUP_P
    mask_m = (tok < ext_len) & (g < GROUP)
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = prefix + tok
    kv_end = prefix + tl.minimum((mblk + 1) * TOKENS, ext_len)
    o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Splits wholly before the program's earliest window are skipped (they hold no visible key).
    if HAS_WINDOW:
        s_begin = _first_split(prefix + mblk * TOKENS, window, SPLIT)
    else:
        s_begin = zero
    # KV offsets in int32 where the buffers are small enough (IDX64 off): fewer address
    # instructions for the one-warp decode programs, the same values.
    if IDX64:
        k_head = K + kvh.to(tl.int64) * stride_kh
        v_head = V + kvh.to(tl.int64) * stride_vh
    else:
        k_head = K + kvh * stride_kh
        v_head = V + kvh * stride_vh
    for s in range(s_begin + first, tl.cdiv(kv_end, SPLIT), step):
        split_start = s * SPLIT
        split_end = tl.minimum(split_start + SPLIT, kv_end)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(split_start, split_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            slots = tl.load(ReqToToken + req * stride_r2t + offs_n, mask=mask_n, other=0)
            if IDX64:
                slots = slots.to(tl.int64)
            k = tl.load(k_head + slots[None, :] * stride_kt + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                keep &= offs_n[None, :] > q_pos[:, None] - window
            qk = tl.dot(q, k, input_precision=PRECISION) * sm_scale
            if HAS_CAP:
                qk = _soft_cap(qk, logit_cap)
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no visible key yet (window start further on) keeps its empty
            # state exactly: exp(-inf - 0) = 0 everywhere, no -inf - -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_head + slots[:, None] * stride_vt + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            # A row's sum runs over how the MMA layout spreads its columns within one warp: the
            # same for extend's 64 rows on 4 warps and decode's 16 rows on one (module doc).
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        # A row that sees no key of this split (its position is before the split) gets 0/0 here
        # and is left out of the merge below.
        o_s = acc / l_i[:, None]
        lse_s = m_i + tl.log(l_i)
        if write_partials != 0:
            tl.store(MidO + b * stride_mb + head[:, None] * stride_mh + s * stride_ms + offs_d[None, :],
                     o_s, mask=mask_m[:, None] & mask_d[None, :])
            tl.store(MidLse + b * stride_lb + head * stride_lh + s, lse_s, mask=mask_m)
        else:
            o_new, lse_new = _fold(o, lse, o_s, lse_s)
            sees = q_pos >= split_start
            if HAS_WINDOW:
                sees &= q_pos - window < split_start + SPLIT - 1
            o = tl.where(sees[:, None], o_new, o)
            lse = tl.where(sees, lse_new, lse)
    if write_partials == 0:
        tl.store(
            Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _combine_kernel(MidO, MidLse, Out, SeqLens, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                    stride_ot, stride_oh, window, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr):
    """A decode token's split partials merged in split order, as the attention kernel merges them."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    o = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    lse = tl.full([1], float("-inf"), dtype=tl.float32)
    for s in range(_first_split(seq_len - 1, window, SPLIT), tl.cdiv(seq_len, SPLIT)):
        o_s = tl.load(MidO + b * stride_mb + h * stride_mh + s * stride_ms + offs_d[None, :],
                      mask=mask_d[None, :], other=0.0)
        lse_s = tl.load(MidLse + b * stride_lb + h * stride_lh + s + tl.arange(0, 1))
        o, lse = _fold(o, lse, o_s, lse_s)
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d[None, :], o.to(Out.dtype.element_ty),
             mask=mask_d[None, :])


_DECODE_AGREE: dict[tuple[int, int, torch.dtype, torch.device], bool] = {}


def decode_tiles_agree(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> bool:
    """Whether a decode step run with `ATTN_DECODE_BLOCK_M` rows per program (one warp) gives the
    bits of the same tokens' extend (`ATTN_BLOCK_M` rows, 4 warps) on `device`: a random
    600-token request (two splits), four of its last tokens decoded as four requests (rows in each
    warp of extend's program), with and without a logit cap and a sliding window (80 keys: one of
    the tokens skips the first split, which extend's program still walks), each token's splits
    in one program and in parallel programs merged by `_combine_kernel`. Groups wider than the
    decode rows and head dims above `ATTN_DECODE_MAX_HEAD_DIM` are not checked: False.
    Checked once per (padded group, head_dim, dtype, device) and remembered; `attention` reads
    the answer (unchecked: extend's row count). The Triton backend checks at start-up, before any
    graph capture."""
    group_p = triton.next_power_of_2(num_heads // num_kv_heads)
    dev = _device_key(device)
    key = (group_p, head_dim, dtype, dev)
    known = _DECODE_AGREE.get(key)
    if known is not None:
        return known
    if group_p > ATTN_DECODE_BLOCK_M or head_dim > ATTN_DECODE_MAX_HEAD_DIM:
        _DECODE_AGREE[key] = False  # not worth it (see ATTN_DECODE_BLOCK_M): extend's rows
        return False
    n = 600
    # Tokens 587, 591, 595, 599: in extend's 16-token blocks at offsets 11, 15, 3, 7, so their
    # rows (4 a token at a group of 4) lie in each of its four warps.
    pos = torch.arange(n - 13, n, 4, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(head_dim)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    q, kb, vb = rand(n, num_heads, head_dim), rand(n, num_kv_heads, head_dim), rand(n, num_kv_heads,
                                                                                   head_dim)
    r2t = torch.arange(n, dtype=torch.int32, device=dev)[None]
    one_req = torch.zeros(1, dtype=torch.int64, device=dev)
    n_t = torch.full((1,), n, dtype=torch.int64, device=dev)
    reqs = torch.zeros(len(pos), dtype=torch.int64, device=dev)  # four queries of one request
    lens = pos + 1
    scratch = DecodeSplitScratch(len(pos), num_heads, head_dim, n, dev)
    agree = True
    for cap, window in ((None, None), (30.0, None), (None, 80), (30.0, 80)):
        full = torch.empty_like(q)
        attention(q, kb, vb, full, r2t, one_req, n_t, head_dim**-0.5,
                  extend=(n_t, torch.zeros_like(n_t), n), logit_cap=cap, sliding_window=window)
        for split_scratch in (None, scratch):
            out = torch.empty_like(q[pos])
            attention(q[pos], kb, vb, out, r2t, reqs, lens, head_dim**-0.5, scratch=split_scratch,
                      logit_cap=cap, sliding_window=window, decode_rows=ATTN_DECODE_BLOCK_M)
            agree &= torch.equal(out, full[pos])
    _DECODE_AGREE[key] = agree
    logger.info("batch-invariant decode attention, %d/%d heads of %d, %s on %s: %s", num_heads,
                num_kv_heads, head_dim, dtype, dev,
                f"{ATTN_DECODE_BLOCK_M} rows a program give extend's bits" if agree
                else "extend's row count (fewer rows change the bits)")
    return agree


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset from `t`'s first element to any of its elements."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


class DecodeSplitScratch:
    """fp32 partials for decode steps of at most `max_batch` requests whose splits run in parallel
    programs (`attention`): [max_batch, Hq, splits of the longest context, D] and the log-sum-exps.
    Allocated once, so CUDA graphs keep pointing at it."""

    # Device memory for the partials: at most this much, or one request's where that is more
    # (`scratch_batch`).
    MAX_BYTES = 512 << 20

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_context_len: int,
                 device: torch.device | str) -> None:
        splits = triton.cdiv(max_context_len, ATTN_SPLIT)
        self.max_batch = max_batch
        self.mid_o = torch.empty(max_batch, num_heads, splits, head_dim, dtype=torch.float32,
                                 device=device)
        self.mid_lse = torch.empty(max_batch, num_heads, splits, dtype=torch.float32, device=device)

    @staticmethod
    def parallel_batch_limit(num_kv_heads: int, device: torch.device | str) -> int:
        """Decode batches of at most this size (and `scratch_batch`) run their splits in parallel:
        up to about six (request, kv head) pairs an SM, a token's splits spread over programs
        beat one program walking them all (H100, 32/8 heads of 128, 100-1600 keys, a layer: 32
        requests 103 -> 60 us, 64 requests 116 -> 106, 96 requests 150 -> 145; 128 requests: no
        gain)."""
        device = torch.device(device)
        if device.type != "cuda":
            return 4
        return max(1, 6 * _num_sms(device.index or 0) // num_kv_heads)

    @classmethod
    def scratch_batch(cls, limit: int, num_heads: int, head_dim: int, max_context_len: int) -> int:
        """How many requests' partials to allocate for: `limit`, or fewer (at least one) where they
        would take more than `MAX_BYTES` (long contexts); batches above it run each token's splits
        in one program."""
        per_request = num_heads * triton.cdiv(max_context_len, ATTN_SPLIT) * (head_dim + 1) * 4
        return max(1, min(limit, cls.MAX_BYTES // per_request))


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 2 elsewhere (Triton's interpreter in tests)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 2


def decode_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """A decode batch's rows, longest sequence first (`attention`'s `longest_first`). Measured on
    an H100 (256 requests of 100-1600 keys, 32/8 heads of 128): 386 -> 341 us a layer, as the
    short requests' programs fill the SMs the long ones leave at the end; 128 requests: 230 ->
    202 us."""
    return torch.argsort(seq_lens, descending=True)


def attention(
    q: torch.Tensor,  # [T, Hq, D]: the batch's new tokens
    k_buffer: torch.Tensor,  # [S, Hk, D]
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]: tokens in the cache after this step's K/V is stored
    sm_scale: float,
    extend: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    scratch: DecodeSplitScratch | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    decode_rows: int | None = None,
    longest_first: torch.Tensor | None = None,
) -> None:
    """Causal attention of each request's new tokens over its whole cached sequence (new K/V already
    stored). `extend` = (extend_lens, extend_starts, max_extend_len) for an extend batch; None for a
    decode batch (one new token per request, at row b). `sliding_window`: a query at p sees keys
    p - sliding_window + 1 .. p; `logit_cap`: scores go through cap * tanh(score / cap) before the
    mask (`tide.layers.attention.layer.Attention`).

    A token's keys are cut into splits of ATTN_SPLIT positions, each reduced in ATTN_BLOCK_N-key
    blocks with an online softmax and merged in split order (`_fold`). Extend, and decode batches
    larger than `scratch.max_batch` (or without scratch), do all of it in one program per block of
    tokens; smaller decode batches run the splits in parallel programs and merge them in
    `_combine_kernel`. Same kernel, same splits, same merge order: a token's bits are the same in
    every case (module doc). A decode step takes `ATTN_DECODE_BLOCK_M` rows on one warp where
    `decode_tiles_agree` has shown that gives extend's bits, unless its splits run in parallel
    programs and it has fewer (request, kv head) pairs than SMs; else extend's `ATTN_BLOCK_M`
    rows on 4 warps; `decode_rows` forces a row count (the check itself, tests).
    `longest_first`: the decode batch's rows by descending `seq_lens` (`decode_order`); a decode
    step whose splits run in one program then starts its longest requests first, which changes
    only which program runs when, never a bit."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    if group_p > ATTN_BLOCK_M:
        raise ValueError(f"{group} q heads per kv head exceed the kernel's {ATTN_BLOCK_M} rows")
    batch = req_pool_indices.shape[0]
    if batch == 0:
        return
    parallel = extend is None and scratch is not None and batch <= scratch.max_batch
    block_m = ATTN_BLOCK_M
    if extend is None:
        if decode_rows is not None:
            if decode_rows < 16 or decode_rows & (decode_rows - 1) or decode_rows > ATTN_BLOCK_M:
                raise ValueError(f"decode_rows must be a power of two from 16 to {ATTN_BLOCK_M}, "
                                 f"got {decode_rows}")
            block_m = max(decode_rows, group_p)
        elif (_DECODE_AGREE.get((group_p, head_dim, q.dtype, q.device))
              and (not parallel or batch * num_kv_heads > _sm_count(q.device))):
            # Split-parallel batches with fewer (request, kv head) pairs than SMs are
            # latency-bound: 4 warps a program beat 1 there (bs1: 134 vs 102 tok/s,
            # Llama-3.1-8B, H100; 16 requests 40.7 vs 43.3 us a layer).
            block_m = ATTN_DECODE_BLOCK_M
    warps = block_m // 16  # 16 rows a warp: extend's 64 on 4, the decode's 16 on 1
    if extend is None:
        ext_lens = ext_starts = seq_lens  # not read
        is_decode = 1
        if parallel:
            assert scratch is not None
            # Programs per (request, kv head), each taking every split_progs-th split (splits
            # past the sequence exit at once). Four-warp programs (fewer pairs than SMs: small,
            # latency-bound batches): about two per SM. One-warp programs: about eight per SM,
            # at least two (H100, a layer, 32/8 heads of 128, 100-1600 keys: 32 requests 77 us
            # on 2, 60 on 4). A build that gave the four-warp sizes eight per SM too (at most 32
            # a pair) measured bs1 decode at 124 against 137 tok/s (Llama-3.1-8B, 128 tokens of
            # context, same process), though bs1's own launch barely changed: not understood.
            sms = _sm_count(q.device)
            pairs = batch * num_kv_heads
            split_progs = min(scratch.mid_o.shape[2],
                              max(2, 8 * sms // pairs) if warps == 1 else max(1, 2 * sms // pairs))
            blocks = split_progs
        else:
            split_progs, blocks = 1, 1
    else:
        ext_lens, ext_starts, max_len = extend
        split_progs, blocks, is_decode = 1, triton.cdiv(max_len, ATTN_BLOCK_M // group_p), 0
    mid_o, mid_lse = (scratch.mid_o, scratch.mid_lse) if parallel and scratch else (out, out)
    if longest_first is not None and (longest_first.shape != (batch,)
                                      or longest_first.dtype not in (torch.int32, torch.int64)
                                      or longest_first.device != q.device):
        raise ValueError(f"longest_first must hold the batch's {batch} row indices (int32/int64 "
                         f"on {q.device}), got {longest_first.dtype} of shape "
                         f"{tuple(longest_first.shape)} on {longest_first.device}")
    ordered = extend is None and not parallel and longest_first is not None
    use_pdl = pdl.enabled(q)
    block_d = triton.next_power_of_2(head_dim)
    grid = (num_kv_heads, batch, blocks) if ordered else (batch, num_kv_heads, blocks)
    _attention_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens, ext_lens, ext_starts,
        mid_o, mid_lse, longest_first if ordered else seq_lens,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        sm_scale, logit_cap or 0.0, is_decode, int(parallel), split_progs, sliding_window or 0,
        HAS_CAP=logit_cap is not None, GROUP=group, GROUP_P=group_p, BLOCK_M=block_m,
        BLOCK_N=ATTN_BLOCK_N, SPLIT=ATTN_SPLIT,
        BLOCK_D=block_d, HEAD_DIM=head_dim, PRECISION=_precision(q),
        USE_PDL=use_pdl, ORDERED=ordered, HAS_WINDOW=bool(sliding_window),
        IDX64=_max_offset(k_buffer) >= 2**31 or _max_offset(v_buffer) >= 2**31,
        num_warps=warps, num_stages=_DECODE_ROW_STAGES if warps == 1 else 2, launch_pdl=use_pdl,
        **_NO_FUSION,
    )
    if parallel:
        _combine_kernel[(batch, num_heads)](
            mid_o, mid_lse, out, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), sliding_window or 0,
            SPLIT=ATTN_SPLIT, BLOCK_D=block_d, HEAD_DIM=head_dim, USE_PDL=use_pdl,
            num_warps=4, launch_pdl=use_pdl, **_NO_FUSION,
        )
