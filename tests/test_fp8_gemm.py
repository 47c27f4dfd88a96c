"""fp8 kernels: the W8A8 product at decode sizes (`tide.layers.fp8_triton.scaled_mm`: its tile
choice, its kernel run by Triton's interpreter on CPU tensors against the exact formula, its
compile for sm_90 with TMA loads and wgmma), and the compile of the norm and activation launches
that quantize their own output rows (`triton_ops.rmsnorm(quantize=True)`,
`triton_ops.act_and_mul_fp8`; their fp8 rounding is inline PTX, which the interpreter cannot run).
The GPU runs, bits included, are in `test_fp8_weights_gpu.py`.

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


def test_tiles_per_shape_and_row_count():
    from tide.layers.fp8_triton import MAX_ROWS, gemm_config

    # Llama-3.1-8B's down projection: swapped 64-row weight tiles with 16 token rows, then wider.
    assert gemm_config(1, 4096, 14336) == (1, 64, 16, 256, 4, 4)
    assert gemm_config(64, 4096, 14336) == (1, 64, 16, 256, 4, 4)
    assert gemm_config(65, 4096, 14336) == (1, 64, 32, 256, 4, 4)
    assert gemm_config(256, 4096, 14336) == (1, 64, 128, 256, 4, 4)
    # gate_up: token rows on the 64-row side at 33-64 rows; cuBLASLt where it measured as fast.
    assert gemm_config(48, 28672, 4096) == (0, 64, 128, 256, 4, 4)
    assert gemm_config(100, 28672, 4096) is None
    assert gemm_config(150, 28672, 4096) == (1, 128, 64, 128, 8, 4)
    assert gemm_config(MAX_ROWS, 28672, 4096) is None
    # More rows than the kernel is for, or none.
    assert gemm_config(MAX_ROWS + 1, 4096, 14336) is None
    assert gemm_config(0, 4096, 14336) is None
    # A shape not measured: swapped tiles up to 64 rows, cuBLASLt above.
    assert gemm_config(10, 5120, 5120) == (1, 64, 16, 256, 4, 4)
    assert gemm_config(64, 5120, 5120) == (1, 64, 32, 256, 4, 4)
    assert gemm_config(65, 5120, 5120) is None
    assert gemm_config(8, 512, 128) == (1, 64, 16, 128, 4, 4)


def test_cpu_tensors_stay_with_the_torch_formula():
    from tide.layers import fp8, fp8_triton

    xq, xs = fp8.quantize_rows(torch.randn(4, 256))
    wq, ws = fp8.quantize_rows(torch.randn(128, 256))
    assert fp8_triton.scaled_mm(xq, xs, wq, ws.view(1, -1), torch.float32) is None


@interpreted
@pytest.mark.parametrize("m,n,k,config", [
    (5, 128, 512, (1, 64, 16, 256, 4, 4)),     # swapped: few tokens, the weight on the 64-row side
    (3, 130, 160, (1, 64, 16, 128, 4, 4)),     # ragged N and K (TMA loads zeros past them)
    (40, 192, 256, (1, 128, 32, 128, 8, 4)),   # two token tiles, a ragged one
    (70, 96, 256, (0, 64, 32, 128, 4, 4)),     # tokens on the rows, ragged row tile
    (17, 64, 1024, (0, 64, 64, 256, 4, 4)),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_computes_the_scaled_product(m, n, k, config, with_bias):
    from tide.layers import fp8, fp8_triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    # Small integers as the fp8 values: every partial sum is exact in any accumulator (the
    # interpreter multiplies fp8 tiles in fp16), and an fp32 result (the interpreter's bf16 cast
    # truncates) leaves only the scales' two fp32 roundings.
    gen = torch.Generator().manual_seed(m + n + k)
    xq = torch.randint(-2, 3, (m, k), generator=gen).to(fp8.FP8)
    wq = torch.randint(-1, 2, (n, k), generator=gen).to(fp8.FP8)
    xs = torch.logspace(-3, 1, m).unsqueeze(1)
    ws = torch.rand(1, n, generator=gen) + 0.5
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double()
    bias = torch.linspace(-4, 4, n) if with_bias else None
    if bias is not None:
        exact = exact + bias.double()
    swap, block_r, block_q, block_k, _, _ = config
    x_rows, w_rows = (block_q, block_r) if swap else (block_r, block_q)
    tiles = (triton.cdiv(n, block_r) * triton.cdiv(m, block_q) if swap
             else triton.cdiv(m, block_r) * triton.cdiv(n, block_q))
    out = torch.full((m, n), float("nan"))
    fp8_triton._w8a8_kernel[(tiles,)](
        TensorDescriptor(xq, [m, k], [k, 1], [x_rows, block_k]),
        TensorDescriptor(wq, [n, k], [k, 1], [w_rows, block_k]),
        xs, ws, out, out if bias is None else bias, m, n, k, out.stride(0), BLOCK_R=block_r,
        BLOCK_Q=block_q, BLOCK_K=block_k, SWAP=bool(swap), HAS_BIAS=bias is not None)
    # Every element written once, with its row's and column's scales (and its column's bias).
    err = (out.double() - exact).abs()
    bound = (exact.abs() + (0 if bias is None else bias.double().abs())) * 2.0 ** -22
    bad = ~(err <= bound)
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {out[bad][:4]} for {exact[bad][:4]}"


def test_kernel_compiles_for_hopper():
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    from tide.layers import fp8_triton

    from test_batch_invariant_triton import _compile_sm90

    configs = {c for ranges in fp8_triton._TUNED.values() for _, c in ranges if c is not None}
    configs |= {fp8_triton.gemm_config(m, 5120, k) for m in (8, 64) for k in (5120, 128)}
    for swap, block_r, block_q, block_k, warps, stages in sorted(configs):
        x_rows, w_rows = (block_q, block_r) if swap else (block_r, block_q)
        kernel = _compile_sm90(
            fp8_triton._w8a8_kernel,
            {"x_desc": f"tensordesc<fp8e4nv[{x_rows},{block_k}]>",
             "w_desc": f"tensordesc<fp8e4nv[{w_rows},{block_k}]>", "SX": "*fp32", "SW": "*fp32",
             "C": "*bf16", "BIAS": "*bf16", "M": "i32", "N": "i32", "K": "i32",
             "stride_cm": "i32"},
            dict(BLOCK_R=block_r, BLOCK_Q=block_q, BLOCK_K=block_k, SWAP=bool(swap),
                 HAS_BIAS=swap == 1),
            num_warps=warps, num_stages=stages)
        ptx = kernel.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx, (swap, block_r, block_q, block_k)  # TMA loads
        assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx  # fp8 tensor cores of sm_90
        assert kernel.metadata.shared <= 227 * 1024  # an H100's shared memory per block


def test_quantizing_norm_and_activation_compile_for_hopper():
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    from tide.layers import triton_ops

    from test_batch_invariant_triton import _compile_sm90

    for residual in (False, True):
        _compile_sm90(triton_ops._rmsnorm_kernel,
                      {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Out": "*bf16", "ResOut": "*bf16",
                       "Q": "*i16", "S": "*fp32", "n_cols": "i32", "eps": "fp32"},
                      dict(HAS_RESIDUAL=residual, QUANT=True, BLOCK=4096, USE_PDL=True),
                      num_warps=16)
    for act in ("silu", "gelu_tanh"):
        _compile_sm90(triton_ops._act_mul_quant_kernel,
                      {"X": "*bf16", "Q": "*i16", "S": "*fp32", "n_cols": "i32"},
                      dict(ACT=act, BLOCK=2048, USE_PDL=True), num_warps=8)
