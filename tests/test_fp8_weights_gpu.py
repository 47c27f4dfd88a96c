"""GPU checks of fp8 projections (`quantization="fp8"`, marker `gpu`, run on a GPU host).

The Triton row quantization gives the CPU reference's bits; `torch._scaled_mm` computes the CPU
formula, and tide's decode-size product lies as close to it; the norm and activation launches
that quantize their own rows give `quantize_rows`' bits; an fp8 engine's CUDA graphs give eager's tokens; an update through captured graphs and a
release/resume with a CPU backup leave the fp8 copies matching their weights.
"""

from __future__ import annotations

import pytest
import tide
import torch
from tide.layers import fp8
from tide.layers.linear import Linear

from conftest import build_checkpoint
from test_gpu import _Driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with fp8 tensor cores"),
]
PROMPTS = [list(range(3, 3 + n)) for n in (5, 99, 250)]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("fp8w_gpu"), "llama", hidden_size=512,
                            intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=2048)


@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (3, 14336), (256, 1024), (5, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantization_gives_the_reference_bits(shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(*shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)).to(dtype)
    x[0, : shape[1] // 2] = 0
    if shape[0] > 2:
        x[2] = 0
    q, s = fp8.quantize_rows(x.cuda())
    ref_q, ref_s = fp8.quantize_rows(x)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s.cpu(), ref_s)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_scaled_mm_computes_the_cpu_formula(rows):
    torch.manual_seed(1)
    x = torch.randn(rows, 1024, dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, dtype=torch.bfloat16) * 0.02
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_rows(w)
    ref = fp8.scaled_product(xq, xs, wq, ws.t().contiguous(), torch.float32)
    got = fp8.scaled_product(xq.cuda(), xs.cuda(), wq.cuda(), ws.t().contiguous().cuda(),
                             torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # The bf16 rounding of the result (2^-9 relative), and the fp8 tensor cores' accumulation,
    # which keeps fewer bits than fp32 between its promotions.
    err = (got.float().cpu() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-2 * scale, f"max |diff| {err} against a result scale {scale}"


@pytest.mark.parametrize("cols", [64, 1000, 1024, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_hands_over_the_bits_of_quantizing_its_output(cols, with_residual):
    from tide.layers import triton_ops

    torch.manual_seed(cols)
    x = (torch.randn(5, cols) * torch.logspace(-2, 2, 5).unsqueeze(1)).to(torch.bfloat16).cuda()
    x[3] = 0  # an all-zero row (with a zero residual below)
    r = torch.randn(5, cols).to(torch.bfloat16).cuda() if with_residual else None
    if r is not None:
        r[3] = 0
    w = (torch.rand(cols) + 0.5).to(torch.bfloat16).cuda()
    want = triton_ops.rmsnorm(x, w, 1e-6, r)
    got = triton_ops.rmsnorm(x, w, 1e-6, r, quantize=True)
    if r is not None:
        (want, want_res), (got, got_res) = want, got
        assert torch.equal(got_res, want_res)
    q, s = fp8.quantize_rows(want)
    assert isinstance(got, fp8.QuantizedRows) and got.dtype == torch.bfloat16
    assert torch.equal(got.values.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, s)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("d", [96, 3072, 5000, 14336])
def test_activation_hands_over_the_bits_of_quantizing_its_output(act, d):
    from tide.layers import triton_ops

    torch.manual_seed(d)
    x = (torch.randn(4, 2 * d) * 3).to(torch.bfloat16).cuda()
    x[1] = 0
    want = triton_ops.silu_and_mul(x) if act == "silu" else triton_ops.gelu_tanh_and_mul(x)
    got = triton_ops.act_and_mul_fp8(x, act)
    q, s = fp8.quantize_rows(want)
    assert torch.equal(got.values.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, s)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                                 (640, 5120)])
@pytest.mark.parametrize("rows", [2, 16, 48, 100, 144, 200, 256])
def test_decode_size_products_are_as_close_to_the_formula_as_scaled_mm(n, k, rows):
    """`scaled_product` at decode sizes (tide's kernel on sm_90 where `gemm_config` gives tiles)
    lies as close to the exact formula as `torch._scaled_mm` does."""
    from tide.layers import fp8_triton

    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_rows(w)
    ws = ws.t().contiguous()
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double()
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    got = fp8.scaled_product(xq, xs, wq, ws, torch.bfloat16)
    ours = fp8_triton.scaled_mm(xq, xs, wq, ws, torch.bfloat16)
    on_sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert (ours is not None) == (on_sm90 and fp8_triton.gemm_config(rows, n, k) is not None)
    if ours is not None:
        assert torch.equal(got, ours)  # the product took the kernel
    scale = exact.abs().max().item()
    err = (got.double() - exact).abs().max().item() / scale
    err_cublas = (cublas.double() - exact).abs().max().item() / scale
    assert err <= max(1.25 * err_cublas, 2.0 ** -8), (err, err_cublas)


@pytest.mark.parametrize("rows", [16, 300])  # tide's kernel on sm_90; torch._scaled_mm
def test_bias_is_added_before_the_one_rounding(rows):
    """With a bias the product rounds once, after adding it in fp32 (as the CPU formula does), on
    both GPU paths."""
    from tide.layers import fp8_triton

    torch.manual_seed(rows)
    x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda") * 0.02
    bias = torch.randn(2048, dtype=torch.bfloat16, device="cuda") * 3
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_rows(w)
    ws = ws.t().contiguous()
    on_sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert (fp8_triton.scaled_mm(xq, xs, wq, ws, torch.bfloat16, bias) is not None) == (
        on_sm90 and rows <= fp8_triton.MAX_ROWS)
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double() + bias.double()
    once = exact.to(torch.bfloat16)
    got = fp8.scaled_product(xq, xs, wq, ws, torch.bfloat16, bias)
    twice = fp8.scaled_product(xq, xs, wq, ws, torch.bfloat16) + bias
    # Within the accumulation's error of the single rounding, and closer to it than two roundings.
    assert (got.double() - exact).abs().max().item() <= 2.0 ** -7 * exact.abs().max().item()
    assert (got != once).sum().item() < (twice != once).sum().item()


@pytest.mark.parametrize("n,k,act", [(2048, 1024, ""), (4096, 14336, ""), (6144, 4096, "silu"),
                                      (4096, 3840, "")])
def test_one_row_gemv_streams_the_fp8_weight_with_its_scales(n, k, act):
    """At one row the fp8 weight goes through the decode GEMV (the row itself not rounded to fp8):
    the sum over fp8 values times the row scale, rounded to the row's dtype, then the activation
    as the two-launch path applies it."""
    from tide.layers import gemv
    from tide.layers.activation import silu_and_mul

    torch.manual_seed(2)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    wq, ws = fp8.quantize_rows(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02)
    scale = ws.t().contiguous()
    got = gemv.gemv(x, wq, act=act, scale=scale)
    full = ((x.double() @ wq.double().t()) * scale.double()).to(torch.bfloat16)
    want = silu_and_mul(full) if act else full
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # fp32 accumulation in another order: at most a bf16 ulp or two apart.
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    with pytest.raises(ValueError, match="row scales"):
        gemv.gemv(x, wq)


def test_fp8_one_request_graphs_give_eager_tokens(checkpoint):
    tokens = []
    for graphs in (True, False):
        with tide.Engine(str(checkpoint), dtype="bfloat16", quantization="fp8",
                         disable_cuda_graph=not graphs, max_total_tokens=8192) as engine:
            tokens.append(engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
                          ["output_ids"])
    assert tokens[0] == tokens[1]


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _assert_copies_match(engine) -> None:
    for m in engine.model_runner.model.modules():
        if isinstance(m, Linear) and m.weight_fp8 is not None:
            q, s = fp8.quantize_rows(m.weight.data)
            assert torch.equal(m.weight_fp8.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(m.weight_scale.view(-1), s.view(-1))


def test_fp8_graphs_give_eager_tokens(checkpoint):
    tokens = []
    for graphs in (True, False):
        with tide.Engine(str(checkpoint), dtype="bfloat16", quantization="fp8",
                         disable_cuda_graph=not graphs, max_total_tokens=8192) as engine:
            assert (engine.model_runner.cuda_graph_runner is not None) == graphs
            tokens.append(_greedy(engine))
    assert tokens[0] == tokens[1]


def _logits(checkpoint, device: str, dtype: str, quantization: str | None) -> torch.Tensor:
    """Logits of an extend of three prompts and three decode steps (the same tokens fed to every
    engine), eager."""
    prompts = [list(range(3, 3 + n)) for n in (5, 99, 250)]
    with tide.Engine(str(checkpoint), device=device, dtype=dtype, quantization=quantization,
                     disable_cuda_graph=True, max_total_tokens=8192) as engine:
        driver = _Driver(engine.model_runner, len(prompts))
        steps = [driver.extend(prompts)]
        steps += [driver.decode([40 + step] * len(prompts)) for step in range(3)]
        return torch.cat([s.float().cpu() for s in steps])


def test_fp8_moves_logits_on_the_gpu_as_on_the_cpu(checkpoint):
    """This random checkpoint is sensitive to rounding: fp8 moves its logits by ~24% (relative L2)
    where bf16 moves them by 3%. The GPU's fp8 path (Triton quantization, `torch._scaled_mm`)
    must move them as much as the CPU's exact formula does: a wrong scale or a skipped
    quantization would show as far more, or as bf16's 3%."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    gpu = rel(_logits(checkpoint, "cuda", "bfloat16", "fp8"),
              _logits(checkpoint, "cuda", "bfloat16", None))
    cpu = rel(_logits(checkpoint, "cpu", "float32", "fp8"),
              _logits(checkpoint, "cpu", "float32", None))
    assert cpu > 0.1 and abs(gpu - cpu) < 0.05, (gpu, cpu)


def test_fp8_update_through_graphs_and_release_resume(checkpoint):
    engine = tide.Engine(str(checkpoint), dtype="bfloat16", quantization="fp8",
                         enable_memory_saver=True, enable_cpu_backup=True, max_total_tokens=100_000)
    _assert_copies_match(engine)
    before = _greedy(engine)
    name = "model.layers.0.mlp.down_proj.weight"
    param = dict(engine.model_runner.model.named_parameters())[name]
    updates = [(name, (param.detach().float() * -0.5).to(torch.bfloat16).cpu())]
    assert engine.update_weights_from_tensor(named_tensors=updates)["success"]
    _assert_copies_match(engine)
    updated = _greedy(engine)
    assert updated != before
    assert engine.release_memory_occupation()["success"]
    params = list(engine.model_runner.model.parameters())
    sizes = [(p.numel() * p.element_size(), getattr(p, "derived", False)) for p in params]
    masters = sum(n for n, derived in sizes if not derived)
    copies = sum(n for n, derived in sizes if derived)
    # The backup holds the checkpoint parameters (region alignment aside), not the fp8 copies.
    assert masters <= engine.worker.memory_occupation.backup.host_bytes < masters + copies
    assert engine.resume_memory_occupation()["success"]
    _assert_copies_match(engine)
    assert _greedy(engine) == updated
    engine.shutdown()


def test_fp8_needs_bf16_on_cuda_and_names_the_fields(checkpoint):
    with pytest.raises(ValueError, match="quantization fp8 on CUDA needs dtype bfloat16"):
        tide.Engine(str(checkpoint), dtype="float16", quantization="fp8")


def test_fp8_rows_handed_over_by_the_norms_change_no_token(checkpoint, monkeypatch):
    """The norms and the activation that quantize their own rows (graphs and eager) give the
    tokens and logprobs of the path that quantizes inside each projection."""
    def run():
        with tide.Engine(str(checkpoint), quantization="fp8", dtype="bfloat16",
                         max_total_tokens=8192) as engine:
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]])
                for o in outs]

    fused = run()
    monkeypatch.setattr(Linear, "takes_fp8_rows", lambda self, x: False)
    assert run() == fused
