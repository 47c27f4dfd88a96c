"""GPU checks of the fp8 (e4m3) KV cache (marker `gpu`, run on a GPU host).

Triton logits against torch_native, both with `kv_cache_dtype="fp8_e4m3"` (the Triton rope-and-store
launch rounds K/V to fp8, the split-KV decode and extend kernels widen them back), for Llama and the
hybrid Gemma-2/Gemma-3/Mistral checkpoints, extend with a cached prefix and chunks, then decode. An
fp8 engine with CUDA graphs gives eager's greedy tokens, and holds about twice the KV tokens of a
bf16 cache in the same memory budget.
"""

from __future__ import annotations

import pytest
import torch

import tide
from test_gpu import _Driver
from test_gpu_swa import build_hybrid_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _assert_close(steps) -> None:
    """Twice the bf16 checks' bound: the two backends compute rope apart (fp32 in the fused Triton
    store, model-dtype ops on the torch path), so a key can differ by one bf16 ulp before the fp8
    rounding, and near an fp8 rounding edge that becomes one fp8 ulp (1/16 relative)."""
    for step, (a, b) in enumerate(steps):
        err = (a - b).abs().max().item()
        scale = a.abs().max().item()
        assert err <= 4e-2 * scale + 2e-2, f"step {step}: max |diff| {err} (logit scale {scale})"


def _runner(path, backend: str):
    engine = tide.Engine(str(path), dtype="bfloat16", attention_backend=backend,
                         disable_cuda_graph=True, max_total_tokens=65536, max_running_requests=64,
                         kv_cache_dtype="fp8_e4m3")
    assert engine.model_runner.token_to_kv_pool.k_buffer[0].dtype == torch.float8_e4m3fn
    return engine.model_runner


@pytest.fixture(scope="module")
def paths(checkpoints, tmp_path_factory):
    out = {"llama": checkpoints["llama"]}
    for arch in ("gemma2", "gemma3", "mistral"):
        out[arch] = build_hybrid_checkpoint(tmp_path_factory.mktemp(f"fp8-{arch}"), arch, 100)
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "mistral"])
def test_fp8_cache_triton_matches_torch_native(paths, arch):
    torch.manual_seed(1)
    prompts = [torch.randint(2, 500, (int(n),)).tolist() for n in torch.randint(88, 400, (5,))]
    ref = _Driver(_runner(paths[arch], "torch_native"), len(prompts))
    out = _Driver(_runner(paths[arch], "triton"), len(prompts))
    steps = []
    for lo, hi in ((0, 37), (37, 87), (87, None)):
        chunk = [p[lo:hi] for p in prompts]
        steps.append((ref.extend(chunk), out.extend(chunk)))
    for _ in range(4):
        next_ids = steps[-1][0].argmax(-1).tolist()
        steps.append((ref.decode(next_ids), out.decode(next_ids)))
    _assert_close(steps)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp8_cache_graphs_give_eager_tokens(paths, arch):
    prompts = [list(range(3, 3 + n)) for n in (5, 99, 250)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    tokens = []
    for graphs in (True, False):
        with tide.Engine(str(paths[arch]), dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                         disable_cuda_graph=not graphs, max_total_tokens=8192) as engine:
            assert (engine.model_runner.cuda_graph_runner is not None) == graphs
            tokens.append([o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                    sampling_params=params)])
    assert tokens[0] == tokens[1]


def test_fp8_cache_holds_twice_the_tokens(paths):
    sizes = []
    for dtype in ("auto", "fp8_e4m3"):
        with tide.Engine(str(paths["llama"]), dtype="bfloat16", kv_cache_dtype=dtype,
                         mem_fraction_static=0.3, disable_cuda_graph=True) as engine:
            sizes.append(engine.model_runner.max_total_tokens)
    assert 1.9 < sizes[1] / sizes[0] < 2.1, sizes


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("batch,max_splits", [(3, 16), (200, 16), (200, 1)])
@pytest.mark.parametrize("v_pairs", [False, True])
def test_fp8_decode_kernel_matches_widened_reference(head_dim, batch, max_splits, v_pairs,
                                                     monkeypatch):
    """Split-KV decode over an fp8 pool, values read as bytes and as int16 words (`v_pairs`, the
    default with few splits), against attention over the widened K/V in fp32: one split and four
    (200 requests), sixteen (3), a head dim below its block (96), launched as the engine launches it (PDL where enabled) and with the
    first key block loaded before the PDL wait (`prefetch`, not the default for fp8)."""
    from tide.layers.attention import split_kv, triton_kernels

    base = split_kv.decode_block_config
    monkeypatch.setattr(triton_kernels, "decode_block_config",
                        lambda *a, **k: base(*a, **k)._replace(v_pairs=v_pairs))
    gen = torch.Generator().manual_seed(head_dim + batch)
    hq, hk = 8, 2
    lens = torch.randint(1, 700, (batch,), generator=gen)
    lens[: min(batch, 4)] = torch.tensor([1, 63, 64, 129][: min(batch, 4)])
    total = int(lens.sum()) + 1
    k = (torch.randn(total, hk, head_dim, generator=gen) * 3).to("cuda", torch.float8_e4m3fn)
    v = (torch.randn(total, hk, head_dim, generator=gen) * 3).to("cuda", torch.float8_e4m3fn)
    slots = torch.randperm(total - 1, generator=gen) + 1
    table = torch.zeros(batch, int(lens.max()), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(lens.tolist()):
        table[i, :n] = slots[pos:pos + n]
        pos += n
    table = table.cuda()
    q = torch.randn(batch, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, hq, max_splits, head_dim, device="cuda")
    mid_lse = torch.empty(batch, hq, max_splits, device="cuda")
    seq = lens.cuda()
    refs = []
    for i, n in enumerate(lens.tolist()):
        rows = table[i, :n].long()
        kk, vv = k[rows].float(), v[rows].float()  # [n, hk, d]
        qq = q[i].float().view(hk, hq // hk, head_dim)
        w = torch.einsum("hgd,nhd->hgn", qq, kk).mul(head_dim**-0.5).softmax(-1)
        refs.append(torch.einsum("hgn,nhd->hgd", w, vv).reshape(hq, head_dim))
    for prefetch in (None, True):
        out.fill_(float("nan"))
        triton_kernels.decode_attention(q, k, v, out, table, torch.arange(batch, device="cuda"),
                                        seq, mid_o, mid_lse, head_dim**-0.5, prefetch=prefetch)
        torch.testing.assert_close(out.float(), torch.stack(refs), atol=3e-2, rtol=2e-2)
