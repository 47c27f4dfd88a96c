"""Gemma's fused GPU kernels (`triton_ops.gemma_rmsnorm`, `triton_ops.gelu_tanh_and_mul`) and the
decode GEMV at Gemma's K (3840, 3584: one masked tile) against the torch references they replace,
run by Triton's interpreter on CPU tensors, and compiled for sm_90 without a GPU. Skipped where
triton is not installed.

The interpreter must be chosen before triton is imported, so a plain pytest run executes this file
again in a subprocess with `TRITON_INTERPRET=1` (`test_kernels_under_the_interpreter`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import INTERPRETED, interpreted, rerun_under_interpreter

triton = pytest.importorskip("triton")


def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__)


def test_kernels_compile_for_hopper():
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    from tide.layers import triton_ops as ops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int) -> None:
        sig = {n: types.get(n, "i32" if n.startswith("stride") or n == "n_cols" else "constexpr")
               for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    bf16 = {name: "*bf16" for name in ("X", "W", "R", "W2", "Out", "Out2")}
    for has_residual, has_next in ((False, False), (True, False), (True, True)):
        compile_sm90(ops._gemma_rmsnorm_kernel, {**bf16, "eps": "fp32"},
                     dict(HAS_RESIDUAL=has_residual, HAS_NEXT=has_next, BLOCK=4096, USE_PDL=True),
                     num_warps=16)
    rope = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Pos": "*i64", "Cos": "*fp32", "Sin": "*fp32",
            "Loc": "*i64", "KBuf": "*bf16", "VBuf": "*bf16", "QW": "*bf16", "KW": "*bf16",
            "norm_eps": "fp32"}
    compile_sm90(ops._rope_store_kernel, rope,
                 dict(NUM_Q_HEADS=16, NUM_KV_HEADS=8, QH_P2=16, KH_P2=8, HEAD_DIM=256, HALF=128,
                      HALF_P2=128, QK_NORM=True, GEMMA_NORM=True, USE_PDL=True),
                 num_warps=4)
    for act in ("silu", "gelu_tanh"):
        compile_sm90(ops._act_mul_kernel, {"X": "*bf16", "Out": "*bf16"},
                     dict(ACT=act, BLOCK=1024, USE_PDL=True), num_warps=4)
    from tide.layers import gemv

    for even_k, act in ((True, ""), (False, ""), (False, "gelu_tanh"), (True, "silu")):
        compile_sm90(gemv._gemv_kernel,
                     {"W": "*bf16", "X": "*bf16", "B": "*bf16", "Y": "*fp32", "N": "i32", "K": "i32"},
                     dict(HAS_BIAS=False, BLOCK_N=1, BLOCK_K=4096, EVEN_N=True, EVEN_K=even_k,
                          ACT=act, USE_PDL=True), num_warps=4)
    for act in ("", "silu"):  # fp8 weights with row scales (quantization="fp8")
        compile_sm90(gemv._gemv_kernel,
                     {"W": "*fp8e4nv", "X": "*bf16", "B": "*bf16", "Y": "*bf16", "S": "*fp32",
                      "N": "i32", "K": "i32"},
                     dict(HAS_BIAS=False, BLOCK_N=4, BLOCK_K=1024, EVEN_N=True, EVEN_K=True,
                          ACT=act, HAS_SCALE=True, USE_PDL=True), num_warps=4)
    from tide.layers import fp8_triton

    compile_sm90(fp8_triton._quantize_rows_kernel,
                 {"X": "*bf16", "Q": "*i16", "S": "*fp32", "fp8_max": "fp32", "min_amax": "fp32"},
                 dict(BLOCK=4096, ONE_BLOCK=False), num_warps=16)


def test_gemv_configs_cover_gemma_shapes():
    from tide.layers import gemv

    assert gemv.config_for(3840) == (1, 4096, 4)  # Gemma-3-12B hidden: one masked tile
    assert gemv.config_for(3584) == (1, 4096, 4)  # Gemma-2-9B hidden
    assert gemv.config_for(4096) == (1, 4096, 4)
    assert gemv.config_for(15360) == (1, 1024, 4)  # Gemma-3-12B intermediate
    assert gemv.config_for(14336) == (1, 2048, 8)
    assert gemv.config_for(100) is None and gemv.config_for(8200) is None
    assert gemv.config_for(4096, fp8=True) == (4, 1024, 4)  # fp8 rows: measured at K = 4096
    assert gemv.config_for(14336, fp8=True) == (1, 2048, 8)


def _gemma_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype)


def _ulps_close(a: torch.Tensor, b: torch.Tensor, ulps: int = 1, atol: float = 1e-6) -> None:
    """Equal up to `ulps` rounding steps of the dtype (the kernel's fp32 math runs in another
    order) or `atol`."""
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = ulps * torch.finfo(a.dtype).eps * b.float().abs() + atol
    assert ((a.float() - b.float()).abs() <= tol).all(), (a.float() - b.float()).abs().max()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [80, 256])  # a masked block, and Gemma's head_dim (q/k norm)
def test_gemma_rmsnorm_matches_the_reference_with_residual_and_next_norm(dtype, cols):
    from tide.layers import triton_ops as ops

    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(7, cols, generator=gen) * 3).to(dtype)
    r = torch.randn(7, cols, generator=gen).to(dtype)
    w = (torch.randn(cols, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(cols, generator=gen) * 0.2).to(dtype)
    eps = 1e-6
    _ulps_close(ops.gemma_rmsnorm(x, w, eps), _gemma_norm_ref(x, w, eps))
    heads = x.view(7, -1, 16)  # per-head rows (q/k norm): [T, H, D] in, same shape out
    got = ops.gemma_rmsnorm(heads, w[:16], eps)
    assert got.shape == heads.shape
    _ulps_close(got, _gemma_norm_ref(heads, w[:16], eps))
    total = r + _gemma_norm_ref(x, w, eps)
    _ulps_close(ops.gemma_rmsnorm(x, w, eps, r), total)
    got_total, got_next = ops.gemma_rmsnorm(x, w, eps, r, w2)
    _ulps_close(got_total, total)
    _ulps_close(got_next, _gemma_norm_ref(got_total, w2, eps))
    with pytest.raises(ValueError, match="residual"):
        ops.gemma_rmsnorm(x, w, eps, None, w2)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gelu_tanh_and_mul_matches_the_reference(dtype):
    from tide.layers import triton_ops as ops

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 2 * 1100, generator=gen) * 4).to(dtype)  # two column blocks, one masked
    x[0, :8] = torch.tensor([0.0, 1e-4, -1e-4, 20.0, -20.0, 60.0, -60.0, 3.0])  # tails saturate
    d = x.shape[-1] // 2
    ref = torch.nn.functional.gelu(x[..., :d].float(), approximate="tanh").to(dtype)
    ref = (ref.float() * x[..., d:].float()).to(dtype)
    got = ops.gelu_tanh_and_mul(x)
    assert torch.isfinite(got).all()
    # tanh(u) via exp differs from torch's tanh in the last fp32 bits; where gelu(gate) is ~1e-7
    # torch's 1 + tanh(u) cancels to 0 and the kernel's sigmoid form does not (atol).
    _ulps_close(got, ref, ulps=4, atol=1e-5)


@interpreted
@pytest.mark.parametrize("k,config", [(384, None), (640, (2, 256, 1)), (1280, (1, 512, 1))])
def test_gemv_with_uneven_k_matches_linear(k, config):
    """K not a multiple of the tile (the masked tail of the last tile); uneven N too."""
    from tide.layers import gemv

    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=gen) * 0.05).half()
    b = torch.randn(37, generator=gen).half()
    x = torch.randn(1, k, generator=gen).half()
    ref = (x.float() @ w.float().T + b.float()).half()
    _ulps_close(gemv.gemv(x, w, b, config=config), ref, ulps=2, atol=1e-3)


@interpreted
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("k,config", [(384, None), (640, (2, 256, 1)), (2048, (1, 512, 2))])
def test_gated_gemv_equals_the_projection_then_the_activation(act, k, config):
    """bs1's MLP input in one launch (`gemv(act=...)`: the gate and up rows of a [gate | up]
    weight in one program) gives the bits of the GEMV of the whole projection followed by the
    elementwise activation kernel, at one tile (384), in uneven multi-row tiles (640, N = 37)
    and in several K chunks (2048)."""
    from tide.layers import gemv
    from tide.layers import triton_ops as ops

    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(2 * 37, k, generator=gen) * 0.1).half()
    x = torch.randn(1, k, generator=gen).half()
    two_launches = getattr(ops, f"{act}_and_mul")(gemv.gemv(x, w, config=config))
    fused = gemv.gemv(x, w, config=config, act=act)
    assert fused.shape == (1, 37) and fused.dtype == torch.float16
    assert torch.equal(fused, two_launches)
    ref = x.float() @ w.float().T
    act_ref = torch.nn.functional.silu if act == "silu" else (
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    _ulps_close(fused, (act_ref(ref[:, :37]) * ref[:, 37:]).half(), ulps=8, atol=2e-3)
    with pytest.raises(ValueError, match="bias"):
        gemv.gemv(x, w, torch.zeros(74).half(), act=act)
    with pytest.raises(ValueError, match="even rows"):
        gemv.gemv(x, w[:73], config=config, act=act)
    with pytest.raises(ValueError, match="act must be"):
        gemv.gemv(x, w, config=config, act="gelu")  # exact GELU has no fused form


@interpreted
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("head_dim", [16, 80, 256])  # 80: half a head is not a power of two
def test_rope_store_with_qk_norm_equals_norm_then_rope(head_dim, gemma):
    """q/k norms (Gemma-3's (1 + w) form, Qwen3's plain one) fused into the rope-and-store launch.
    At position 0 RoPE is the identity, and inputs in eighths make every sum of squares exact, so
    the fused output must equal the norm modules' reference bit for bit (rounding included); at
    other positions it equals a separate norm launch followed by the plain launch."""
    from tide.layers import triton_ops as ops
    from tide.layers.norm import GemmaRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(head_dim)
    hq, hk, t, slots = 3, 1, 5, 12  # three q heads: a padded head row in the tile
    dtype = torch.float16
    qkv = (torch.randint(-24, 25, (t, (hq + 2 * hk) * head_dim), generator=gen) / 8).to(dtype)
    qw = (torch.randint(-8, 9, (head_dim,), generator=gen) / 16).to(dtype)
    kw = (torch.randint(-8, 9, (head_dim,), generator=gen) / 16).to(dtype)
    angles = torch.arange(64).float()[:, None] / 10000 ** (torch.arange(head_dim // 2) / (head_dim // 2))
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    loc = torch.tensor([3, 1, 7, 9, 11])
    eps = 1e-6
    norm_cls = GemmaRMSNorm if gemma else RMSNorm

    def module(w: torch.Tensor) -> torch.nn.Module:
        m = norm_cls(head_dim, eps)
        m.weight.data = w.clone()
        return m

    def run(positions: torch.Tensor, fused: bool):
        buf = qkv.clone()
        q, k, v = buf.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
        if not fused:
            norm = ops.gemma_rmsnorm if gemma else ops.rmsnorm
            q.copy_(norm(q.reshape(t, hq, head_dim), qw, eps).reshape(t, -1))
            k.copy_(norm(k.reshape(t, hk, head_dim), kw, eps).reshape(t, -1))
        kb = torch.zeros(slots, hk, head_dim, dtype=dtype)
        vb = torch.zeros(slots, hk, head_dim, dtype=dtype)
        ops.rope_and_store_kv(positions, q, k, v, cos, sin, hq, hk, head_dim, loc, kb, vb,
                              qk_norm=(qw, kw, eps, gemma) if fused else None)
        return q.clone(), kb, vb

    zero = torch.zeros(t, dtype=torch.int64)
    q, kb, vb = run(zero, fused=True)
    q_ref = module(qw)(qkv[:, : hq * head_dim].reshape(t, hq, head_dim)).reshape(t, -1)
    k_ref = module(kw)(qkv[:, hq * head_dim : (hq + hk) * head_dim].reshape(t, hk, head_dim))
    assert torch.equal(q, q_ref)
    assert torch.equal(kb[loc], k_ref)
    assert torch.equal(vb[loc].reshape(t, -1), qkv[:, (hq + hk) * head_dim :])
    positions = torch.tensor([0, 3, 7, 8, 30])
    for got, ref in zip(run(positions, fused=True), run(positions, fused=False)):
        _ulps_close(got, ref, ulps=1, atol=1e-3)
