"""Sliding-window models against HF `transformers` on tiny random checkpoints (CPU, fp32).

gemma2: alternating sliding/full layers, attention and final logit soft-capping; gemma3: q/k norm,
two sliding layers per full one, a local rope base distinct from the global (linear-scaled) rope;
gemma3_mm: the text tower of a Gemma3ForConditionalGeneration checkpoint (vision weights on disk,
legacy `language_model.model.` names); qwen2_swa: `use_sliding_window` with `max_window_layers`;
mistral: a window on every layer. The window (8) is much smaller than the prompts (up to 40) and the
generations, so out-of-window keys would change every output if they leaked in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tide
from conftest import _tokenizer_files, hf_greedy_scores, random_prompts
from tide.layers.attention import torch_native
from tide.model_config import ModelConfig

WINDOW = 8
MAX_NEW = 24
LOGPROB_TOL = 1e-4
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# Shorter than, equal to, one past and several windows past the window.
LENGTHS = [5, 7, 8, 9, 20, 33, 40]
ARCHS = ["gemma2", "gemma3", "gemma3_mm", "qwen2_swa", "mistral"]

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
)


def _gemma3_text_config(transformers, **extra):
    return transformers.Gemma3TextConfig(
        **_COMMON,
        num_hidden_layers=6,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        query_pre_attn_scalar=24,
        final_logit_softcapping=1.5,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        **extra,
    )


def _hf_model(arch: str):
    import transformers

    if arch == "gemma2":
        config = transformers.Gemma2Config(
            **_COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
        )
        return transformers.Gemma2ForCausalLM(config)
    if arch == "gemma3":
        return transformers.Gemma3ForCausalLM(_gemma3_text_config(transformers))
    if arch == "gemma3_mm":
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )
        config = transformers.Gemma3Config(
            text_config=_gemma3_text_config(transformers).to_dict(), vision_config=vision.to_dict(),
            mm_tokens_per_image=4, image_token_index=509, boi_token_index=510, eoi_token_index=511,
            eos_token_id=0,
        )
        return transformers.Gemma3ForConditionalGeneration(config)
    if arch == "qwen2_swa":
        config = transformers.Qwen2Config(
            **_COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1,
        )
        return transformers.Qwen2ForCausalLM(config)
    if arch == "mistral":
        config = transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW)
        return transformers.MistralForCausalLM(config)
    raise ValueError(arch)


def build_swa_checkpoint(path: Path, arch: str) -> Path:
    torch.manual_seed(0)
    model = _hf_model(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma norms scale by (1 + w): keep them near 1 for both conventions.
                p.uniform_(-0.2, 0.2) if arch.startswith("gemma") else p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    _tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def swa_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swa")
    return {arch: build_swa_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_swa_model(swa_checkpoints):
    import transformers

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cls = (
                transformers.Gemma3ForConditionalGeneration
                if arch == "gemma3_mm"
                else transformers.AutoModelForCausalLM
            )
            model = cls.from_pretrained(swa_checkpoints[arch], dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            cache[arch] = model
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def hf_reference(hf_swa_model):
    """`hf_reference(arch, prompt)`: (greedy tokens, [steps, vocab] log-softmax), cached."""
    cache: dict[tuple[str, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}

    def get(arch: str, prompt: list[int]):
        key = (arch, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy_scores(hf_swa_model(arch), prompt, MAX_NEW)
        return cache[key]

    return get


def assert_matches_hf(arch: str, prompts, outs, hf_reference) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        hf_tokens, hf_logp = hf_reference(arch, prompt)
        assert out["output_ids"] == hf_tokens, f"{arch}: prompt {i} (len {len(prompt)}) diverges"
        pairs = out["meta_info"]["output_token_logprobs"]
        ours = torch.tensor([lp for lp, _ in pairs])
        ref = hf_logp[torch.arange(MAX_NEW), torch.tensor(hf_tokens)]
        err = (ours - ref).abs().max().item()
        assert err <= LOGPROB_TOL, f"{arch}: prompt {i} logprob error {err:.2e}"


def _assert_idle_and_flushable(engine) -> None:
    sched = engine.scheduler
    assert not sched.has_work()
    sched.check_invariants()
    assert engine.flush_cache() is True
    for name, pool in sched.kv_pools().items():
        assert pool["free"] == pool["capacity"], name


# ---- the checkpoints exercise what they claim to


def test_checkpoints_have_the_intended_layer_kinds(swa_checkpoints):
    kinds = {
        arch: [k.sliding_window for k in ModelConfig.from_dir(str(p)).layer_kinds]
        for arch, p in swa_checkpoints.items()
    }
    w = WINDOW
    assert kinds["gemma2"] == [w, None, w, None]
    assert kinds["gemma3"] == kinds["gemma3_mm"] == [w, w, None, w, w, None]
    assert kinds["qwen2_swa"] == [None, w, w]
    assert kinds["mistral"] == [w, w]
    g3 = ModelConfig.from_dir(str(swa_checkpoints["gemma3"]))
    assert g3.sliding_rope is not None and g3.sliding_rope.theta == 50.0
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert g3.final_logit_softcapping == 1.5
    mm = ModelConfig.from_dir(str(swa_checkpoints["gemma3_mm"]))
    assert mm.final_logit_softcapping is None  # transformers' multimodal head does not cap
    from safetensors import safe_open

    with safe_open(str(swa_checkpoints["gemma3_mm"] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names


def test_features_change_the_hf_output(hf_swa_model):
    """Soft-caps, the window and the local rope base each move HF's logits: parity below would
    catch tide leaving any of them out."""
    ids = torch.tensor([random_prompts(5, [40])[0]])

    def logits(model):
        with torch.no_grad():
            return model(ids).logits[0, -1]

    g2 = hf_swa_model("gemma2")
    base = logits(g2)
    attn_caps = [m for m in g2.modules() if hasattr(m, "attn_logit_softcapping")]
    try:
        for m in attn_caps:
            m.attn_logit_softcapping = None
        assert (logits(g2) - base).abs().max() > 1e-2
    finally:
        for m in attn_caps:
            m.attn_logit_softcapping = 2.0
    assert base.abs().max() < 1.5  # the final soft-cap bounds the logits...
    g2.config.final_logit_softcapping = None
    try:
        assert (logits(g2) - base).abs().max() > 1e-1  # ...and bites
    finally:
        g2.config.final_logit_softcapping = 1.5
    windows = [m for m in g2.modules() if getattr(m, "sliding_window", None) == WINDOW]
    assert windows
    g3 = hf_swa_model("gemma3")
    base3 = logits(g3)
    rope = g3.model.rotary_emb
    saved = rope.sliding_attention_inv_freq.clone()
    try:
        rope.sliding_attention_inv_freq.copy_(rope.full_attention_inv_freq)
        assert (logits(g3) - base3).abs().max() > 1e-2
    finally:
        rope.sliding_attention_inv_freq.copy_(saved)


# ---- parity: batched prefill + decode past the window


@pytest.fixture(scope="module")
def swa_engine(swa_checkpoints):
    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tide.Engine(str(swa_checkpoints[arch]))
        return cache[arch]

    yield get
    for engine in cache.values():
        engine.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_hf(arch, swa_engine, hf_reference):
    engine = swa_engine(arch)
    assert type(engine.model_runner.attn_backend).__name__ == "TorchNativeAttnBackend"
    prompts = random_prompts(200 + ARCHS.index(arch), LENGTHS)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_hf(arch, prompts, outs, hf_reference)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_prefix_cache_hit_on_windowed_prefix(arch, swa_engine, hf_reference):
    """A follow-up turn over prompt + completion (several windows long) reuses the cached KV and
    still matches HF exactly. A second request that shares only the first prompt: one pool
    (mistral) reuses all of it; two pools (gemma) dropped that prompt's last window from the SWA
    pool while the first request decoded, so the match is shortened to a point whose window is
    intact and the rest is recomputed, still exactly."""
    engine = swa_engine(arch)
    first, tail = random_prompts(300, [30, 7])
    second = first + tail
    out1 = engine.generate(input_ids=first, sampling_params=GREEDY, return_logprob=True)
    out2 = engine.generate(input_ids=second, sampling_params=GREEDY, return_logprob=True)
    if engine.scheduler.swa_window is None:
        assert out2["meta_info"]["cached_tokens"] >= len(first) - 1
    else:
        assert out2["meta_info"]["cached_tokens"] < len(first) - WINDOW
    assert_matches_hf(arch, [first, second], [out1, out2], hf_reference)
    follow = first + out1["output_ids"] + tail
    out3 = engine.generate(input_ids=follow, sampling_params=GREEDY, return_logprob=True)
    assert out3["meta_info"]["cached_tokens"] >= len(first) + MAX_NEW - 1
    assert_matches_hf(arch, [follow], [out3], hf_reference)
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_mm"])
def test_chunked_prefill_splits_inside_the_window(arch, swa_checkpoints, hf_reference):
    """Chunks of 5 tokens (window 8): every chunk boundary falls inside some query's window."""
    engine = tide.Engine(
        str(swa_checkpoints[arch]), chunked_prefill_size=5, max_prefill_tokens=5
    )
    prompts = random_prompts(400, [9, 23, 37])
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert engine.scheduler.stats.num_prefill_tokens >= sum(len(p) for p in prompts)
    assert_matches_hf(arch, prompts, outs, hf_reference)
    _assert_idle_and_flushable(engine)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_retraction_keeps_outputs(arch, swa_checkpoints, hf_reference):
    prompts = random_prompts(500, [6, 9, 12, 15, 18, 21, 24, 27])
    max_total_tokens = 72
    assert max(len(p) for p in prompts) + MAX_NEW < max_total_tokens  # each fits alone...
    assert sum(len(p) + MAX_NEW for p in prompts) > 2 * max_total_tokens  # ...not together
    engine = tide.Engine(str(swa_checkpoints[arch]), max_total_tokens=max_total_tokens)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert engine.scheduler.stats.num_retractions > 0
    assert_matches_hf(arch, prompts, outs, hf_reference)
    _assert_idle_and_flushable(engine)
    engine.shutdown()


# ---- the window itself


def _hf_sliding_mask(window: int, n: int) -> torch.Tensor:
    """transformers' sliding causal mask [n, n] (query rows, key columns) for positions 0..n-1."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    mask = fn(zero, zero, torch.arange(n).view(n, 1), torch.arange(n).view(1, n))
    return mask.expand(n, n).bool()


def test_window_mask_matches_transformers_at_the_boundary():
    """`visible_mask` equals transformers' sliding causal mask (which counts the query's own token
    inside the window), including blocks that start mid-sequence."""
    for window in (1, 2, 3, 8):
        n = 3 * window + 2
        ref = _hf_sliding_mask(window, n)
        assert torch.equal(torch_native.visible_mask(0, n, 0, n, window, torch.device("cpu")), ref)
        # The query at position p sees exactly p - window + 1 .. p.
        assert ref[n - 1].sum() == window and ref[n - 1, n - window] and not ref[n - 1, n - window - 1]
        for q0, kv0 in ((window, 1), (n - 2, n - 2 - window + 1), (5, 0)):
            rows, cols = n - q0, n - kv0
            got = torch_native.visible_mask(q0, rows, kv0, cols, window, torch.device("cpu"))
            assert torch.equal(got, ref[q0:, kv0:]), (window, q0, kv0)
    full = torch_native.visible_mask(0, 6, 0, 6, None, torch.device("cpu"))
    assert torch.equal(full, torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.mark.parametrize("logit_cap", [None, 2.0])
def test_windowed_attend_equals_masked_reference(logit_cap):
    """The gathered-window path equals full-length attention with transformers' window mask, and
    moving the window by one position changes the result (the boundary is exact)."""
    from tide.layers.attention.layer import Attention

    torch.manual_seed(0)
    heads, kv_heads, dim, n = 4, 2, 16, 20
    q = torch.randn(n, heads, dim)
    k = torch.randn(n, kv_heads, dim)
    v = torch.randn(n, kv_heads, dim)

    def reference(window: int) -> torch.Tensor:
        mask = _hf_sliding_mask(window, n)
        kr = k.repeat_interleave(heads // kv_heads, dim=1)
        vr = v.repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kr) * dim**-0.5
        if logit_cap is not None:
            s = torch.tanh(s / logit_cap) * logit_cap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr)

    layer = Attention(heads, kv_heads, dim, dim**-0.5, 0, sliding_window=WINDOW, logit_cap=logit_cap)
    rows = []
    for s in range(0, n, WINDOW):  # query blocks, keys gathered from the block's window start
        e = min(s + WINDOW, n)
        kv0 = max(0, s - WINDOW + 1)
        rows.append(torch_native.attend(q[s:e], k[kv0:e], v[kv0:e], s, kv0, layer))
    ours = torch.cat(rows)
    torch.testing.assert_close(ours, reference(WINDOW), atol=1e-5, rtol=1e-5)
    assert (ours - reference(WINDOW + 1)).abs().max() > 1e-3
    assert (ours - reference(WINDOW - 1)).abs().max() > 1e-3
    # Decode: one query over exactly its window of keys.
    one = torch_native.attend(q[n - 1 :], k[n - WINDOW :], v[n - WINDOW :], n - 1, n - WINDOW, layer)
    torch.testing.assert_close(one, reference(WINDOW)[n - 1 :], atol=1e-5, rtol=1e-5)


def test_sliding_layers_read_only_their_window(swa_engine, monkeypatch):
    """O(window) work per token: every attend() of a sliding layer reads at most
    2 * window - 1 keys (a block of `window` queries and the window before it), decode reads
    exactly min(window, seq_len), and full layers read the whole sequence."""
    engine = swa_engine("gemma2")
    calls: list[tuple[int | None, int, int]] = []
    real = torch_native.attend

    def spy(q, k, v, q_pos, kv_pos, layer):
        calls.append((layer.sliding_window, q.shape[0], k.shape[0]))
        return real(q, k, v, q_pos, kv_pos, layer)

    monkeypatch.setattr(torch_native, "attend", spy)
    prompt = random_prompts(600, [40])[0]
    engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=4))
    sliding = [(nq, nk) for w, nq, nk in calls if w == WINDOW]
    full = [(nq, nk) for w, nq, nk in calls if w is None]
    assert sliding and full
    assert max(nk for _, nk in sliding) <= 2 * WINDOW - 1
    assert all(nq <= WINDOW for nq, _ in sliding)
    assert [nk for nq, nk in sliding if nq == 1] and all(nk == WINDOW for nq, nk in sliding if nq == 1)
    assert max(nk for _, nk in full) >= len(prompt)  # full layers see everything


# ---- weight updates go through the same name mapping as the initial load


def test_multimodal_weight_updates_from_tensor_and_disk(swa_checkpoints, tmp_path):
    """The text tower takes updates under transformers' in-memory names (`model.language_model.`,
    vision weights included and ignored) and from a saved checkpoint (`language_model.model.`)."""
    import transformers

    from conftest import named_weights

    path = swa_checkpoints["gemma3_mm"]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(700, [9, 30])
    engine = tide.Engine(str(path))
    try:
        before = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        gen = torch.Generator().manual_seed(1)
        for step, source in enumerate(("tensor", "disk")):
            with torch.no_grad():
                for _, p in hf.named_parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            if source == "tensor":
                named = named_weights(hf)
                assert any(n.startswith("model.vision_tower.") for n, _ in named)
                assert any(n.startswith("model.language_model.") for n, _ in named)
                res = engine.update_weights_from_tensor(named_tensors=named)
            else:
                hf.save_pretrained(tmp_path / "updated")
                res = engine.update_weights_from_disk(str(tmp_path / "updated"))
            assert res["success"], res["message"]
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
            if step == 0:
                assert [o["output_ids"] for o in outs] != [o["output_ids"] for o in before]
            for prompt, out in zip(prompts, outs):
                tokens, logp = hf_greedy_scores(hf, prompt, MAX_NEW)
                assert out["output_ids"] == tokens, source
                ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
                ref = logp[torch.arange(MAX_NEW), torch.tensor(tokens)]
                assert (ours - ref).abs().max().item() <= LOGPROB_TOL, source
    finally:
        engine.shutdown()


# ---- CUDA: windowed models run on the triton backend (kernels with windows and soft-caps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_cuda_auto_backend_runs_windowed_models_exactly(arch, swa_checkpoints, hf_reference):
    import gc

    from tide.memory import MemoryLedger, empty_device_cache

    # Engines of earlier GPU tests may still hold (cached) device memory; the KV budget is sized
    # from what the device has free, so give it back first.
    gc.collect()
    empty_device_cache(reason="test_setup", ledger=MemoryLedger())
    engine = tide.Engine(str(swa_checkpoints[arch]), device="cuda", dtype="float32",
                         max_total_tokens=4096)
    try:
        assert type(engine.model_runner.attn_backend).__name__ == "TritonAttnBackend"
        assert engine.model_runner.cuda_graph_runner is not None
        prompts = random_prompts(800, [9, 33])
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        for prompt, out in zip(prompts, outs):
            tokens, logp = hf_reference(arch, prompt)
            assert out["output_ids"] == tokens
            ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
            ref = logp[torch.arange(MAX_NEW), torch.tensor(tokens)]
            # fp32 on the GPU vs transformers on the CPU (torch_native measured up to 3.6e-3 for
            # Gemma-2 after 24 decode steps; the kernels multiply in fp32, not TF32).
            assert (ours - ref).abs().max().item() <= 5e-3
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_final_soft_cap_is_the_same_into_the_graphs_logits_buffer(arch, swa_checkpoints, monkeypatch):
    """A CUDA-graph decode writes logits into a shared buffer (`logits_out`, of the model's dtype;
    an fp32 one must work too); the final soft-cap must round there as the eager path (and
    transformers) rounds it, in the model dtype, or greedy tokens of graph and eager decode part
    ways."""
    engine = tide.Engine(str(swa_checkpoints[arch]), dtype="bfloat16")
    try:
        model = engine.model_runner.model
        assert model.final_logit_cap is not None
        hidden = (torch.randn(6, _COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
                  * 4).to(torch.bfloat16)
        monkeypatch.setattr(model.model, "forward", lambda *args: hidden)

        class Batch:
            logits_out: torch.Tensor | None = None

            def last_token_indices(self) -> torch.Tensor:
                return torch.arange(hidden.shape[0])

            def keep_scored_hidden(self, hidden: torch.Tensor) -> None:
                pass

        eager = model(None, None, Batch())
        written = []
        for dtype in (torch.bfloat16, torch.float32):
            into = Batch()
            into.logits_out = torch.full((hidden.shape[0], _COMMON["vocab_size"]), float("nan"),
                                         dtype=dtype)
            written.append((into.logits_out, model(None, None, into)))
    finally:
        engine.shutdown()
    for buffer, graph_like in written:
        assert graph_like.data_ptr() == buffer.data_ptr()
        assert torch.equal(graph_like.float(), eager)


def test_n_copies_of_a_prompt_shorter_than_the_window_prefill_once(tmp_path):
    """Two-pool cache, prompts shorter than the window (every token keeps its SWA K/V): n copies
    submitted together prefill the prompt once and read it from the cache; tokens equal an engine
    without a prefix cache, both pools stay consistent, a longer prompt's copies are not held back."""
    path = build_swa_checkpoint(tmp_path / "gemma3", "gemma3")
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 64
    (path / "config.json").write_text(json.dumps(config))
    short, long = random_prompts(31, [50, 90])
    n = 4
    prompts = [short] * n + [long] * 2
    params = {"temperature": 0, "max_new_tokens": 80, "ignore_eos": True}
    ref = tide.Engine(str(path), disable_radix_cache=True)
    try:
        assert ref.scheduler.swa_window == 64
        expected = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    finally:
        ref.shutdown()
    engine = tide.Engine(str(path))
    try:
        stats = engine.scheduler.stats
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert [o["meta_info"]["cached_tokens"] for o in outs[:n]] == [0] + [len(short) - 1] * (n - 1)
        assert stats.num_prefix_deferrals == n - 1  # the 90-token prompt (> window) is not held back
        engine.scheduler.check_invariants()
        engine.scheduler.allocator.check_consistency()
        _assert_idle_and_flushable(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_input_applies_the_named_activation(bias):
    """The MLP input dispatcher off the fused path (CPU; on CUDA also with a bias, batch-invariant
    projections and exact GELU): act(gate) * up of the [gate | up] projection, for each name."""
    from tide.layers.activation import gated_mlp_input
    from tide.layers.linear import MergedLinear

    torch.manual_seed(0)
    proj = MergedLinear(24, {0: 10, 1: 10}, bias=bias)
    with torch.no_grad():
        proj.weight.normal_()
        if bias:
            proj.bias.normal_()
    x = torch.randn(3, 24)
    y = x @ proj.weight.T + (proj.bias if bias else 0)
    gate, up = y[:, :10], y[:, 10:]
    F = torch.nn.functional
    want = {"silu": F.silu(gate) * up, "gelu_tanh": F.gelu(gate, approximate="tanh") * up,
            "gelu": F.gelu(gate) * up}
    for act, ref in want.items():
        torch.testing.assert_close(gated_mlp_input(proj, x, act), ref, atol=1e-5, rtol=1e-5)
    assert (want["gelu"] - want["gelu_tanh"]).abs().max() > 1e-6  # the names differ in the math
    with pytest.raises(ValueError, match="act must be"):
        gated_mlp_input(proj, x, "relu")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_input_logprobs_match_hf(arch, swa_checkpoints, hf_swa_model):
    """Input logprobs of a prompt longer than the window, in chunks (two pools, a windowed
    prefix match, the final soft cap on the scored rows): transformers' full forward."""
    ids = random_prompts(31, [3 * WINDOW + 5])[0]
    with torch.no_grad():
        logits = hf_swa_model(arch)(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    with tide.Engine(str(swa_checkpoints[arch]), chunked_prefill_size=WINDOW,
                     max_prefill_tokens=WINDOW) as engine:
        engine.generate(input_ids=ids[:WINDOW + 3], sampling_params={"max_new_tokens": 1})
        out = engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=WINDOW,
                              sampling_params={"max_new_tokens": 1})
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t in entries] == ids[WINDOW:]
    want = [logp[p - 1, ids[p]].item() for p in range(WINDOW, len(ids))]
    assert [v for v, _ in entries] == pytest.approx(want, abs=2e-4)
