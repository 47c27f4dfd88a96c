"""GPU checks for sliding-window models on the Triton backend (marker `gpu`, run on a GPU host).

Tiny Gemma-2 (alternating window / full layers, attention and final soft-caps), Gemma-3 (two sliding
layers per full one, q/k norm, local rope base) and Mistral (a window on every layer, RoPE fused into
the KV store): Triton logits against torch_native for extend (with a cached prefix and in chunks) and
decode, bf16, with the tolerance of the Llama checks in test_gpu.py. Windows of 8 (below one key
block), 100 (across block edges) and 700 (several decode splits inside the window). Then the kernels
alone: NaN in every slot no query may see stays out, the extend kernel's tiles at head dims 128 and
256 match torch_native for bf16, fp16 and fp8 caches, and a sliding layer's decode time does not
grow with the context.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tide
from conftest import _tokenizer_files
from test_gpu import _Driver, _runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHS = ["gemma2", "gemma3", "mistral"]


def build_hybrid_checkpoint(path: Path, arch: str, window: int) -> Path:
    import transformers

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=16384, eos_token_id=0,
                  bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    if arch == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, num_hidden_layers=4, sliding_window=window, query_pre_attn_scalar=64,
            attn_logit_softcapping=2.0, final_logit_softcapping=30.0))
    elif arch == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_hidden_layers=6, sliding_window=window, sliding_window_pattern=3,
            query_pre_attn_scalar=64, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            **common, num_hidden_layers=2, sliding_window=window))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.2, 0.2) if arch.startswith("gemma") else p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    _tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    cache: dict[tuple[str, int], Path] = {}

    def get(arch: str, window: int) -> Path:
        if (arch, window) not in cache:
            cache[(arch, window)] = build_hybrid_checkpoint(
                tmp_path_factory.mktemp(f"{arch}-w{window}"), arch, window)
        return cache[(arch, window)]

    return get


def _assert_close(steps) -> None:
    for step, (a, b) in enumerate(steps):
        err = (a - b).abs().max().item()
        scale = a.abs().max().item()
        assert err <= 2e-2 * scale + 1e-2, f"step {step}: max |diff| {err} (logit scale {scale})"


@pytest.mark.parametrize("window", [8, 100, 700])
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_triton_matches_torch_native(hybrid_checkpoint, arch, window):
    """7 requests of 88..900 tokens: a cached prefix of 37, the rest in two chunks (the first of
    50 tokens, so chunk edges fall inside windows), then 4 decode steps."""
    path = hybrid_checkpoint(arch, window)
    torch.manual_seed(window)
    prompts = [torch.randint(2, 500, (int(n),)).tolist() for n in torch.randint(88, 900, (7,))]
    ref = _Driver(_runner(path, "torch_native"), len(prompts))
    out = _Driver(_runner(path, "triton"), len(prompts))
    assert type(out.runner.attn_backend).__name__ == "TritonAttnBackend"
    steps = []
    for lo, hi in ((0, 37), (37, 87), (87, None)):
        chunk = [p[lo:hi] for p in prompts]
        steps.append((ref.extend(chunk), out.extend(chunk)))
    for _ in range(4):
        next_ids = steps[-1][0].argmax(-1).tolist()
        steps.append((ref.decode(next_ids), out.decode(next_ids)))
    _assert_close(steps)


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_hybrid_long_context_decode_matches_torch_native(hybrid_checkpoint, arch):
    """Split-KV decode thousands of tokens past a 700-token window, against the reference."""
    path = hybrid_checkpoint(arch, 700)
    torch.manual_seed(0)
    prompts = [torch.randint(2, 500, (n,)).tolist() for n in (9000, 3000, 701)]
    ref = _Driver(_runner(path, "torch_native"), 3)
    out = _Driver(_runner(path, "triton"), 3)
    steps = [(ref.extend(prompts), out.extend(prompts))]
    for _ in range(3):
        next_ids = steps[-1][0].argmax(-1).tolist()
        steps.append((ref.decode(next_ids), out.decode(next_ids)))
    _assert_close(steps)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_hybrid_cuda_graph_greedy_equals_eager(hybrid_checkpoint, arch):
    """`auto` runs windowed models on triton with CUDA graphs; graphs and eager give the same tokens,
    past the window."""
    path = hybrid_checkpoint(arch, 100)
    prompts = [list(range(3, 3 + n)) for n in (5, 99, 100, 101, 250)]
    params = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}
    outs = {}
    for graphs in (False, True):
        engine = tide.Engine(str(path), dtype="bfloat16", disable_cuda_graph=not graphs,
                             max_total_tokens=65536, max_running_requests=64)
        try:
            assert type(engine.model_runner.attn_backend).__name__ == "TritonAttnBackend"
            assert (engine.model_runner.cuda_graph_runner is not None) == graphs
            outs[graphs] = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                    sampling_params=params)]
        finally:
            engine.shutdown()
    assert outs[True] == outs[False]


# ---- the kernels alone


def _poisoned_pool(lens, visible_ranges, heads_kv, dim, dtype):
    """A shuffled pool (slot of request i's position p: table[i, p]) with NaN in every slot outside
    `visible_ranges` [(req, lo, hi)]."""
    total = sum(lens)
    k = torch.randn(total + 8, heads_kv, dim, device="cuda").to(dtype)
    v = torch.randn(total + 8, heads_kv, dim, device="cuda").to(dtype)
    perm = torch.randperm(total, device="cuda") + 4
    table = torch.zeros(len(lens), max(lens) + 5, dtype=torch.int32, device="cuda")
    off = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[off : off + n].to(torch.int32)
        off += n
    hidden = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    for i, lo, hi in visible_ranges:
        hidden[table[i, lo:hi].long()] = False
    clean = (k.clone(), v.clone())
    if dtype == torch.float8_e4m3fn:  # e4m3's NaN, written as bytes
        k.view(torch.uint8)[hidden] = 0x7F
        v.view(torch.uint8)[hidden] = 0x7F
    else:
        k[hidden] = float("nan")
        v[hidden] = float("nan")
    return table, k, v, clean


@pytest.mark.parametrize("window,cap", [(100, 50.0), (700, None), (None, 2.0)])
def test_kernels_never_read_hidden_slots(window, cap):
    from tide.layers.attention import split_kv, torch_native, triton_kernels
    from tide.layers.attention.layer import Attention

    torch.manual_seed(0)
    hq, hk, d = 8, 2, 128
    layer = Attention(hq, hk, d, d**-0.5, 0, sliding_window=window, logit_cap=cap)
    # Decode.
    lens = [1, 99, 100, 101, 5000]
    vis = [(i, split_kv.decode_visible_start(n, window), n) for i, n in enumerate(lens)]
    table, k, v, (k0, v0) = _poisoned_pool(lens, vis, hk, d, torch.bfloat16)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    splits = triton_kernels.num_kv_splits(len(lens) * hk, 128)
    out = torch.empty_like(q)
    triton_kernels.decode_attention(
        q, k, v, out, table, torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"),
        torch.empty(len(lens), hq, splits, d, device="cuda"), torch.empty(len(lens), hq, splits,
                                                                           device="cuda"),
        layer.scaling, window, cap)
    ref = torch.cat([torch_native.attend(q[i : i + 1].float(), k0[table[i, lo:hi].long()].float(),
                                         v0[table[i, lo:hi].long()].float(), hi - 1, lo, layer)
                     for i, lo, hi in vis])
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # Extend: new tokens on a cached prefix.
    prefix, ext = [0, 37, 1000], [300, 64, 129]
    lens = [p + e for p, e in zip(prefix, ext)]
    vis = [(i, 0 if window is None else max(prefix[i] - window + 1, 0), lens[i]) for i in range(3)]
    table, k, v, (k0, v0) = _poisoned_pool(lens, vis, hk, d, torch.bfloat16)
    q = torch.randn(sum(ext), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    starts = [0, ext[0], ext[0] + ext[1]]
    triton_kernels.extend_attention(
        q, k, v, out, table, torch.arange(3, device="cuda"), torch.tensor(prefix, device="cuda"),
        torch.tensor(ext, device="cuda"), torch.tensor(starts, device="cuda"), max(ext),
        layer.scaling, window, cap)
    assert out.isfinite().all()
    for i in range(3):
        for r in (0, 1, ext[i] // 2, ext[i] - 1):
            pos = prefix[i] + r
            lo = 0 if window is None else max(pos - window + 1, 0)
            slots = table[i, lo : pos + 1].long()
            want = torch_native.attend(q[starts[i] + r : starts[i] + r + 1].float(), k0[slots].float(),
                                       v0[slots].float(), pos, lo, layer)
            torch.testing.assert_close(out[starts[i] + r : starts[i] + r + 1].float(), want,
                                       atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window,cap", [(None, None), (100, 50.0), (700, None)])
def test_extend_tiles_match_torch_native(head_dim, kv_dtype, window, cap):
    """The extend kernel on the tiles `split_kv.extend_block_config` picks for real heads (Llama's
    32/8 at 128, Gemma's 16/8 at 256: 128 x 32 and 128 x 64 on 8 warps; with fp8 128 x 128 on 8
    warps and 64 x 64), every query row of prompts, a cached prefix and a 1,500-token prompt (many
    diagonal and off-diagonal key blocks, windows across them) against torch_native over the same
    cache, NaN in every slot no query may see. fp8 caches are widened for the reference; queries
    are in the model dtype."""
    from tide.layers.attention import torch_native, triton_kernels
    from tide.layers.attention.layer import Attention

    torch.manual_seed(head_dim)
    hq, hk = (32, 8) if head_dim == 128 else (16, 8)
    q_dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    layer = Attention(hq, hk, head_dim, head_dim**-0.5, 0, sliding_window=window, logit_cap=cap)
    prefix, ext = [0, 37, 1000, 0], [300, 64, 129, 1500]
    lens = [p + e for p, e in zip(prefix, ext)]
    vis = [(i, 0 if window is None else max(prefix[i] - window + 1, 0), lens[i])
           for i in range(len(lens))]
    table, k, v, (k0, v0) = _poisoned_pool(lens, vis, hk, head_dim, kv_dtype)
    q = torch.randn(sum(ext), hq, head_dim, device="cuda", dtype=q_dtype)
    out = torch.empty_like(q)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    triton_kernels.extend_attention(
        q, k, v, out, table, torch.arange(len(lens), device="cuda"),
        torch.tensor(prefix, device="cuda"), torch.tensor(ext, device="cuda"),
        torch.tensor(starts, device="cuda"), max(ext), layer.scaling, window, cap)
    assert out.isfinite().all(), "a hidden slot was read"
    # fp8 rounds the query and the weights to fp16 for the dots, as decode does.
    tol = 3e-2 if kv_dtype == torch.float8_e4m3fn else 2e-2
    for i in range(len(lens)):
        slots = table[i, : lens[i]].long()
        want = torch_native.attend(q[starts[i] : starts[i] + ext[i]].float(), k0[slots].float(),
                                   v0[slots].float(), prefix[i], 0, layer)
        torch.testing.assert_close(out[starts[i] : starts[i] + ext[i]].float(), want,
                                   atol=tol, rtol=tol)


def test_sliding_decode_time_does_not_grow_with_context():
    """bs1 decode attention, Gemma-3-12B-like heads (16 q, 8 kv, dim 256), window 1024: the same
    time at 2k and 64k context (split-KV splits the visible 1024 keys only), while full attention
    at 64k takes several times longer."""
    from benchmarks.timing import capture, replay_seconds
    from tide.layers.attention import triton_kernels

    hq, hk, d, window = 16, 8, 256, 1024
    size = 65536 + 16
    k = torch.randn(size, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(size, hk, d, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(size, device="cuda", dtype=torch.int32).view(1, size)
    req = torch.zeros(1, dtype=torch.int64, device="cuda")
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits = triton_kernels.num_kv_splits(hk, 128)
    mid_o = torch.empty(1, hq, splits, d, device="cuda")
    mid_lse = torch.empty(1, hq, splits, device="cuda")

    def seconds(ctx: int, win: int | None) -> float:
        seq = torch.full((1,), ctx, dtype=torch.int64, device="cuda")

        def run() -> None:
            for _ in range(20):  # 20 layers per replay: launch overhead amortised
                triton_kernels.decode_attention(q, k, v, out, table, req, seq, mid_o, mid_lse,
                                                d**-0.5, win, 50.0)

        graph = capture(run)
        return min(replay_seconds(graph, reps=20) for _ in range(3))

    short, long = seconds(2048, window), seconds(65536, window)
    full = seconds(65536, None)
    assert long <= 1.25 * short, f"window 1024: {short * 1e6:.1f} us at 2k, {long * 1e6:.1f} us at 64k"
    assert full >= 3 * long, f"full attention at 64k {full * 1e6:.1f} us vs window {long * 1e6:.1f} us"


def test_decode_reads_the_newest_keys_the_previous_launch_stores():
    """With PDL the decode kernel loads its first block of keys before it waits on the kernel
    before it; the newest token's K/V, which that kernel (rope-and-store) writes, must still be
    read after the wait. Here the writer is long (8,192 filler tokens, the decode batch's newest
    tokens last), the newest slots hold NaN until it writes them, and both run 20 times eagerly and
    20 times from a CUDA graph. Lengths put the newest token first, inside and past the first key
    block of its split (32 and 96: in its last slot)."""
    from tide.layers import pdl, triton_ops
    from tide.layers.attention import torch_native, triton_kernels
    from tide.layers.attention.layer import Attention

    if not pdl.enabled(torch.empty(1, device="cuda")):
        pytest.skip("the race needs programmatic dependent launch (sm90+, TIDE_PDL not 0)")
    torch.manual_seed(0)
    hq, hk, d, filler, width = 16, 8, 256, 8192, 2048
    lens = [1, 2, 32, 33, 64, 65, 96, 1000, 1024, 1025]
    bs = len(lens)
    layer = Attention(hq, hk, d, d**-0.5, 0)
    k = torch.randn(bs * width + filler, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(bs * width, device="cuda", dtype=torch.int32).view(bs, width)
    seq = torch.tensor(lens, device="cuda")
    newest = table[torch.arange(bs, device="cuda"), seq - 1].long()
    loc = torch.cat([torch.arange(bs * width, bs * width + filler, device="cuda"), newest])
    positions = torch.cat([torch.arange(filler, device="cuda") % 1000, seq - 1])
    angles = torch.rand(2048, d, device="cuda") * 6.28
    cos, sin = angles.cos(), angles.sin()
    q_new = torch.randn(filler + bs, hq * d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(filler + bs, hk * d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    q = torch.empty_like(q_new)
    out = torch.empty(bs, hq, d, device="cuda", dtype=torch.bfloat16)
    splits = triton_kernels.num_kv_splits(bs * hk, 128)
    mid_o = torch.empty(bs, hq, splits, d, device="cuda")
    mid_lse = torch.empty(bs, hq, splits, device="cuda")
    req = torch.arange(bs, device="cuda")
    poison = torch.full((bs, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        k[newest] = poison
        v[newest] = poison
        q.copy_(q_new)
        triton_ops.rope_and_store_kv(positions, q, k_new, v_new, cos, sin, hq, hk, d, loc, k, v)
        triton_kernels.decode_attention(q[filler:].view(bs, hq, d), k, v, out, table, req, seq,
                                        mid_o, mid_lse, layer.scaling)

    def check() -> None:
        torch.cuda.synchronize()
        qd = q[filler:].view(bs, hq, d)
        ref = torch.cat([torch_native.attend(qd[i : i + 1].float(), k[table[i, :n].long()].float(),
                                             v[table[i, :n].long()].float(), n - 1, 0, layer)
                         for i, n in enumerate(lens)])
        assert out.isfinite().all(), "a newest key was read before its store"
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

    for _ in range(20):
        step()
        check()
    graph = torch.cuda.CUDAGraph()
    step()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
        check()
