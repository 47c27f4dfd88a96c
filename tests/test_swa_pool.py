"""Two-pool KV cache for hybrid sliding-window models (CPU, fp32): the allocator and its full→SWA
map, the SWA-aware radix cache, the CUDA-graph input buffers, and engines on tiny Gemma-2/Gemma-3
checkpoints (window 8) checked against transformers while the SWA pool stays small."""

from __future__ import annotations

import pytest
import tide
import torch
from tide.config import EngineConfig
from tide.executor.cuda_graph_runner import DecodeInputBuffers
from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool
from tide.memory.radix_cache import RadixCache
from tide.memory.swa import SWAKVPool, SWATokenToKVPoolAllocator, swa_pool_sizes
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

from conftest import hf_greedy_scores, random_prompts
from test_swa_models import WINDOW, build_swa_checkpoint

TOL = 1e-4

# ---- allocator, sizes, map


def test_allocator_maps_frees_and_counts_both_pools():
    alloc = SWATokenToKVPoolAllocator(10, 4, "cpu")
    assert alloc.available_size() == 4 and alloc.full_available_size() == 10
    full = alloc.alloc(3)
    mapping = alloc.full_to_swa_index_mapping
    assert mapping.dtype == torch.int32 and mapping[0] == 0
    swa = mapping[full]
    assert (swa > 0).all() and len(set(swa.tolist())) == 3
    assert alloc.alloc(2) is None  # the SWA pool has one slot left
    alloc.free_swa(full[:2])
    assert alloc.swa_available_size() == 3 and alloc.full_available_size() == 7
    assert mapping[full[:2]].tolist() == [0, 0]
    alloc.check_consistency()
    alloc.free(full, swa_freed=2)  # full slots all back, and the one SWA slot still mapped
    assert alloc.full_available_size() == 10 and alloc.swa_available_size() == 4
    assert int(mapping.abs().sum()) == 0
    alloc.check_consistency()
    assert alloc.alloc(4) is not None and alloc.alloc(1) is None
    alloc.clear()
    assert alloc.available_size() == 4 and int(mapping.abs().sum()) == 0


def test_pool_sizes_split_the_budget_by_ratio():
    # Gemma-3-like: 1 full layer's bytes per token vs 5 sliding layers' bytes.
    full, swa = swa_pool_sizes(6_000_000, 1000, 5000, 0.2)
    assert full * 1000 + swa * 5000 <= 6_000_000
    assert full == 3000 and swa == 600
    one_pool = 6_000_000 // 6000
    assert full >= 2.9 * one_pool  # a small SWA ratio fits about 3x the full tokens
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        swa_pool_sizes(1e6, 10, 10, 0.0)
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        EngineConfig(load_format="dummy", swa_full_tokens_ratio=1.5)


# ---- SWA radix cache


def _tree(size=64, size_swa=64, window=4):
    alloc = SWATokenToKVPoolAllocator(size, size_swa, "cpu")
    pool = ReqToTokenPool(2, 64, "cpu")
    return RadixCache(pool, alloc, window=window), alloc


def test_match_is_shortened_to_an_intact_window():
    tree, alloc = _tree(window=4)
    key = list(range(100, 120))
    value = alloc.alloc(20)
    # Positions 0..9 lost their SWA K/V (a request decoded past them).
    alloc.free_swa(value[:10])
    assert tree.insert(key, value, swa_freed=10) == 0
    assert tree.swa_total_size() == 10 and tree.total_size() == 20
    for m in (20, 16, 13):  # the last 3 tokens before m all hold SWA slots
        got, _ = tree.match_prefix(key[:m])
        assert len(got) == m
    # A match ending at 12 would need position 9 (freed): it falls back to the start of the run,
    # and the recomputed tokens never read a freed SWA slot.
    got, node = tree.match_prefix(key[:12])
    assert len(got) == 0 and node is tree.root
    got, _ = tree.match_prefix(key)
    assert torch.equal(got, value)
    assert tree.swa_total_size() == 10  # splitting nodes kept the counts


def test_match_with_a_freed_run_in_the_middle():
    tree, alloc = _tree(window=4)
    a = alloc.alloc(12)
    tree.insert(list(range(12)), a)
    b = alloc.alloc(8)
    alloc.free_swa(b[:5])  # positions 12..16 freed, 17..19 kept
    tree.insert(list(range(20)), torch.cat([a, b]), swa_freed=17)
    got, _ = tree.match_prefix(list(range(20)))
    assert len(got) == 20  # needs 17..19: intact
    got, _ = tree.match_prefix(list(range(19)))
    assert len(got) == 12  # needs 16..18 (16 freed): back to 12, which needs 9..11 (intact)


def test_eviction_frees_swa_before_full_and_keeps_counts():
    tree, alloc = _tree(size=40, size_swa=40, window=4)
    key = list(range(30))
    value = alloc.alloc(30)
    tree.insert(key, value)
    assert alloc.swa_available_size() == 10 and alloc.full_available_size() == 10
    # The SWA pool is short: only tokens no match can need go (all but the node's last 3).
    assert tree.evict(0, swa_tokens=20) == 0
    assert alloc.swa_available_size() == 30 and alloc.full_available_size() == 10
    assert tree.swa_evictable_size() == 10 and tree.evictable_size() == 30
    got, _ = tree.match_prefix(key)
    assert len(got) == 30  # the full match still works: its window is intact
    # Short of full slots: whole leaves go, their remaining SWA slots with them.
    assert tree.evict(5) == 30
    assert alloc.full_available_size() == 40 and alloc.swa_available_size() == 40
    assert tree.total_size() == 0 and tree.swa_total_size() == 0


def test_locked_nodes_keep_their_swa_and_release_swa_before_spares_shared_nodes():
    tree, alloc = _tree(window=4)
    value = alloc.alloc(16)
    tree.insert(list(range(16)), value)
    _, shared = tree.match_prefix(list(range(8)))  # splits at 8
    _, leaf = tree.match_prefix(list(range(16)))
    tree.inc_lock_ref(leaf)  # request A: the whole path
    assert tree.evict_swa(100) == 0  # everything is locked
    tree.inc_lock_ref(shared)  # request B holds the first 8 tokens too
    tree.release_swa_before(leaf, 14)  # A only needs positions >= 14
    assert shared.swa_freed == 0  # B still holds it
    assert leaf.swa_freed == 6  # A's own node: positions 8..13 freed
    assert tree.swa_protected_size() == 10 and tree.swa_evictable_size() == 0
    tree.dec_lock_ref(shared)
    tree.dec_lock_ref(leaf)
    assert tree.swa_evictable_size() == 10


# ---- CUDA-graph input buffers (the logic is device independent)


def _decode_batch(n, full_loc, swa_loc):
    t = torch.arange(n, dtype=torch.int64)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=t + 5, positions=t + 7, req_pool_indices=t,
        seq_lens=t + 8, out_cache_loc=full_loc, req_to_token_pool=None, token_to_kv_pool=None,
        attn_backend=None, out_cache_loc_swa=swa_loc)


def test_decode_buffers_have_swa_slots_only_for_two_pools(monkeypatch):
    plain = DecodeInputBuffers.create(8, torch.device("cpu"), dummy_req_slot=3)
    assert plain.out_cache_loc_swa is None and len(plain.fields()) == 5
    bufs = DecodeInputBuffers.create(8, torch.device("cpu"), dummy_req_slot=3, swa=True)
    assert bufs.out_cache_loc_swa.dtype == torch.int32
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(len(d)), real(d, s)))
    big = _decode_batch(8, torch.arange(20, 28), torch.arange(40, 48, dtype=torch.int32))
    bufs.populate_from_forward_batch(big)
    assert calls == [5, 1]  # one grouped copy per dtype: five int64 inputs, the int32 SWA slots
    # A smaller batch padded to a 4-row bucket: its padded rows write the dummy slot (0) of both
    # pools; nothing of the larger batch's slots stays in the rows the bucket reads.
    small = _decode_batch(4, torch.tensor([30, 31, 0, 0]),
                          torch.tensor([50, 51, 0, 0], dtype=torch.int32))
    bufs.populate_from_forward_batch(small)
    assert bufs.out_cache_loc[:4].tolist() == [30, 31, 0, 0]
    assert bufs.out_cache_loc_swa[:4].tolist() == [50, 51, 0, 0]
    with pytest.raises(ValueError, match="out_cache_loc_swa"):
        bufs.populate_from_forward_batch(_decode_batch(2, torch.tensor([1, 2]), None))


# ---- engines


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("swapool")
    return {a: build_swa_checkpoint(root / a, a) for a in ("gemma2", "gemma3", "mistral")}


@pytest.fixture(scope="module")
def hf_models(ckpts):
    import transformers

    models = {}
    for arch in ("gemma2", "gemma3"):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpts[arch], dtype=torch.float32)
        m.generation_config.eos_token_id = None
        models[arch] = m.eval()
    return models


def _check_hf(hf, prompt, out, max_new):
    tokens, logp = hf_greedy_scores(hf, prompt, max_new)
    assert out["output_ids"] == tokens
    ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
    ref = logp[torch.arange(max_new), torch.tensor(tokens)]
    assert (ours - ref).abs().max().item() <= TOL


def _swa_used(engine) -> int:
    return engine.scheduler.kv_pools()["swa"]["used"]


def _poison_free_swa_slots(engine) -> None:
    pool = engine.model_runner.token_to_kv_pool
    free = engine.model_runner.token_to_kv_pool_allocator.swa.all_free_slots()
    for layer in pool.swa_layer_ids:
        pool.get_key_buffer(layer)[free] = float("nan")
        pool.get_value_buffer(layer)[free] = float("nan")


def _assert_empty_after_flush(engine):
    sched = engine.scheduler
    sched.check_invariants()
    assert engine.flush_cache() is True
    for name, pool in sched.kv_pools().items():
        assert pool["free"] == pool["capacity"], name


def test_only_hybrid_models_get_two_pools(ckpts):
    with tide.Engine(str(ckpts["gemma3"]), max_total_tokens=512,
                     swa_full_tokens_ratio=0.25) as g3:
        runner = g3.model_runner
        assert isinstance(runner.token_to_kv_pool, SWAKVPool)
        pool = runner.token_to_kv_pool
        assert pool.swa_layer_ids == (0, 1, 3, 4) and pool.full_layer_ids == (2, 5)
        assert pool.get_key_buffer(0).shape[0] == 128 + 1  # SWA pool: 0.25 x 512 (+ dummy)
        assert pool.get_key_buffer(2).shape[0] == 512 + 1
        layout = g3.get_server_info()["kv_cache_layout"]
        assert layout == {"type": "hybrid_swa", "full_tokens": 512, "swa_tokens": 128,
                          "full_layers": [2, 5], "swa_layers": [0, 1, 3, 4],
                          "sliding_window": WINDOW, "swa_full_tokens_ratio": 0.25,
                          "kv_cache_dtype": "float32"}
    with tide.Engine(str(ckpts["mistral"]), max_total_tokens=512) as mistral:
        # Every layer slides: no full layer to share a pool with, one pool as before.
        assert type(mistral.model_runner.token_to_kv_pool) is MHATokenToKVPool
        assert mistral.scheduler.swa_window is None
        assert mistral.get_server_info()["kv_cache_layout"]["type"] == "full"
        assert set(mistral.scheduler.kv_pools()) == {"full"}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_long_generation_keeps_the_swa_footprint_to_a_window(arch, ckpts, hf_models):
    """4 x window new tokens: after every step the request holds at most window + page SWA slots,
    the outputs equal transformers', and both pools are empty once it is flushed. Every free SWA
    slot is filled with NaN after each step, so giving back a slot still in the window (an
    off-by-one against transformers' window) would show in the logprobs."""
    engine = tide.Engine(str(ckpts[arch]), max_total_tokens=256, swa_full_tokens_ratio=0.25)
    sched = engine.scheduler
    page = sched.swa_page
    peaks: list[int] = []
    real = sched.process_results

    def spy(batch, out):
        done = real(batch, out)
        sched.check_invariants()
        peaks.append(_swa_used(engine))
        _poison_free_swa_slots(engine)
        return done

    sched.process_results = spy
    prompt = random_prompts(900, [6])[0]
    max_new = 4 * WINDOW
    out = engine.generate(input_ids=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}, return_logprob=True)
    assert len(peaks) == max_new
    # While running (all steps but the last, after which the request is cached and done).
    assert max(peaks[:-1]) <= WINDOW + page
    assert peaks[-2] >= WINDOW - 1  # it did hold its window
    _check_hf(hf_models[arch], prompt, out, max_new)
    _assert_empty_after_flush(engine)
    engine.shutdown()


def test_prefix_match_never_reads_freed_swa_slots(ckpts, hf_models):
    """Every SWA slot that is free when the second request runs (the first request's
    out-of-window ones among them), and the dummy slot of both pools, hold NaN: a shortened match
    recomputes what it must and the outputs stay exact."""
    engine = tide.Engine(str(ckpts["gemma2"]), max_total_tokens=256, swa_full_tokens_ratio=0.5)
    first, tail = random_prompts(901, [20, 5])
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    out1 = engine.generate(input_ids=first, sampling_params=greedy, return_logprob=True)
    alloc = engine.model_runner.token_to_kv_pool_allocator
    pool = engine.model_runner.token_to_kv_pool
    free_swa = alloc.swa.all_free_slots()
    assert free_swa.numel() > alloc.size_swa - 2 * WINDOW  # the first request's SWA mostly freed
    for layer in range(len(pool.k_buffer)):
        buf_k, buf_v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        buf_k[0] = buf_v[0] = float("nan")
        if pool.is_swa_layer(layer):
            buf_k[free_swa] = float("nan")
            buf_v[free_swa] = float("nan")
    follow = first + out1["output_ids"] + tail  # hits the whole first sequence
    second = first + tail  # the window before position 20 was freed: shortened match
    outs = engine.generate(input_ids=[follow, second], sampling_params=greedy, return_logprob=True)
    assert outs[0]["meta_info"]["cached_tokens"] >= len(first) + 11
    assert outs[1]["meta_info"]["cached_tokens"] < len(first) - WINDOW
    _check_hf(hf_models["gemma2"], first, out1, 12)
    _check_hf(hf_models["gemma2"], follow, outs[0], 12)
    _check_hf(hf_models["gemma2"], second, outs[1], 12)
    engine.scheduler.check_invariants()
    engine.shutdown()


def test_long_chunked_prompt_fits_a_small_swa_pool_without_retraction(ckpts, hf_models):
    """A 200-token prompt in 16-token chunks with a 40-slot SWA pool: each chunk gives back the
    SWA slots the next one cannot see, so the prompt never holds more than chunk + window of them
    and nothing is retracted while a second request decodes beside it."""
    engine = tide.Engine(str(ckpts["gemma3"]), max_total_tokens=400, swa_full_tokens_ratio=0.1,
                         chunked_prefill_size=16, max_prefill_tokens=16)
    sched = engine.scheduler
    assert sched.kv_pools()["swa"]["capacity"] == 40
    peaks: list[int] = []
    real = sched.process_results

    def spy(batch, out):
        done = real(batch, out)
        sched.check_invariants()
        peaks.append(_swa_used(engine))
        _poison_free_swa_slots(engine)
        return done

    sched.process_results = spy
    long_prompt, short = random_prompts(902, [200, 6])
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outs = engine.generate(input_ids=[long_prompt, short], sampling_params=greedy,
                           return_logprob=True)
    assert sched.stats.num_retractions == 0
    assert max(peaks) <= 16 + 2 * (WINDOW + sched.swa_page)
    _check_hf(hf_models["gemma3"], long_prompt, outs[0], 6)
    _check_hf(hf_models["gemma3"], short, outs[1], 6)
    _assert_empty_after_flush(engine)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("case", ["radix_off", "prompt_again"])
def test_chunked_prompt_longer_than_the_swa_pool_finishes_when_its_chunks_are_not_cached(
        ckpts, hf_models, arch, case):
    """A 100-token prompt in 16-token chunks, a 40-slot SWA pool: the chunks are not published in
    the radix tree (the cache is off; or the tree's copy of the prompt lost its out-of-window SWA
    K/V, so the request keeps its own), and each chunk must still give back the SWA slots the next
    one cannot see. Holding them, the prompt waited for SWA slots forever (generate hung)."""
    import threading

    engine = tide.Engine(str(ckpts[arch]), max_total_tokens=400, swa_full_tokens_ratio=0.1,
                         chunked_prefill_size=16, disable_radix_cache=case == "radix_off")
    assert engine.scheduler.kv_pools()["swa"]["capacity"] == 40
    prompt = random_prompts(21, [100])[0]
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outs: list = []

    def run() -> None:
        for _ in range(2 if case == "prompt_again" else 1):
            outs.append(engine.generate(input_ids=prompt, sampling_params=greedy,
                                        return_logprob=True))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), f"generate hung: {engine.scheduler.kv_pools()}"
    for out in outs:
        _check_hf(hf_models[arch], prompt, out, 4)
    _assert_empty_after_flush(engine)
    engine.shutdown()


def test_translation_runs_once_per_forward_not_per_layer(ckpts):
    """gemma3 has four sliding layers: one gather for the new tokens' SWA slots per forward; the
    sliding layers read SWA slots from `req_to_token_swa`, which mirrors the full table."""
    with tide.Engine(str(ckpts["gemma3"]), max_total_tokens=256) as engine:
        pool = engine.model_runner.token_to_kv_pool
        tables = engine.model_runner.req_to_token_pool
        alloc = engine.model_runner.token_to_kv_pool_allocator
        sched = engine.scheduler
        seen: list[torch.Tensor] = []
        real = sched.process_results

        def spy(batch, out):
            # Before the step's bookkeeping: every position of every running request has its SWA
            # slot in the SWA table wherever the full slot still has one.
            for req, n in zip(batch.reqs, batch.extend_lens):
                full = tables.req_to_token[req.req_pool_idx, : req.kv_len + n]
                mapped = alloc.full_to_swa_index_mapping[full.long()]
                swa = tables.req_to_token_swa[req.req_pool_idx, : full.numel()]
                live = mapped > 0
                seen.append(live)
                assert torch.equal(swa[live], mapped[live])
            return real(batch, out)

        sched.process_results = spy
        before = pool.num_translations
        engine.generate(input_ids=random_prompts(903, [12, 9]),
                        sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
        forwards = sched.stats.num_forward_decode + sched.stats.num_forward_extend
        assert pool.num_translations - before == forwards
        assert seen and all(s.any() for s in seen)


def _req(rid, prompt, max_new):
    return Req(rid, prompt, SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True))


@pytest.mark.parametrize("how", ["retract", "abort"])
def test_retract_and_abort_give_back_both_pools(ckpts, how):
    """Mid-decode (SWA slots partly given back already), retracting or aborting every request
    leaves no slot of either pool behind; retracted requests run again to the same output."""
    engine = tide.Engine(str(ckpts["gemma2"]), max_total_tokens=256, swa_full_tokens_ratio=0.5)
    sched = engine.scheduler
    prompts = random_prompts(904, [14, 5, 9])
    reqs = [_req(str(i), p, 20) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(14):
        sched.step()
        sched.check_invariants()
    assert all(r.swa_evicted_len > 0 for r in reqs)  # each gave SWA slots back while decoding
    if how == "retract":
        assert sched.retract_all() == 3
    else:
        assert len(sched.abort()) == 3
    sched.check_invariants()
    assert sched.kv_pools()["swa"]["used"] == sched.tree_cache.swa_total_size()
    assert sched.kv_pools()["full"]["used"] == sched.tree_cache.total_size()
    if how == "retract":
        while sched.has_work():
            sched.step()
            sched.check_invariants()
        fresh = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
        assert [r.output_ids for r in reqs] == [o["output_ids"] for o in fresh]
    _assert_empty_after_flush(engine)
    engine.shutdown()


def test_release_and_resume_kv_cache_covers_the_swa_pool(ckpts):
    engine = tide.Engine(str(ckpts["gemma3"]), max_total_tokens=256, enable_memory_saver=True)
    pool = engine.model_runner.token_to_kv_pool
    prompt = random_prompts(905, [20])[0]
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    before = engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
    kv_bytes = sum(b.untyped_storage().nbytes() for b in pool.k_buffer + pool.v_buffer)
    assert engine.release_memory_occupation(["kv_cache"])["success"]
    for layer in range(len(pool.k_buffer)):  # sliding layers' buffers too
        assert pool.get_key_buffer(layer).untyped_storage().nbytes() == 0
        assert pool.get_value_buffer(layer).untyped_storage().nbytes() == 0
    released = engine.handover.released_bytes()["kv_cache"]
    assert released >= kv_bytes
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    assert sum(b.untyped_storage().nbytes() for b in pool.k_buffer + pool.v_buffer) == kv_bytes
    assert engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"] == before
    _assert_empty_after_flush(engine)
    engine.shutdown()


def test_metrics_report_both_pools(ckpts):
    """`tide:kv_pool_slots{pool, state}` from the scheduler's load report of a hybrid engine."""
    from prometheus_client.parser import text_string_to_metric_families
    from tide.server.metrics import ServerMetrics

    with tide.Engine(str(ckpts["gemma2"]), max_total_tokens=256, swa_full_tokens_ratio=0.5) as eng:
        eng.generate(input_ids=random_prompts(906, [20])[0],
                     sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        pools = eng.scheduler.kv_pools()
    # 20 + 12 tokens, all but the last one computed, cached in the tree.
    assert pools["full"] == {"capacity": 256, "free": 256 - 31, "used": 31, "cached": 31,
                             "evictable": 31}
    # The cached sequence keeps SWA slots only for its last window (minus the one not yet run).
    assert pools["swa"]["capacity"] == 128 and pools["swa"]["used"] == pools["swa"]["cached"]
    assert WINDOW - 1 <= pools["swa"]["used"] <= WINDOW + 1
    m = ServerMetrics("m")
    m.set_load({"num_running_reqs": 0, "num_queued_reqs": 0, "kv_used_slots": 31,
                "kv_held_slots": 0, "max_total_tokens": 256, "num_cached_tokens": 0,
                "num_prefill_tokens": 0, "num_retractions": 0, "weight_version": "w",
                "paused": None, "num_pending_weight_updates": 0, "memory_ledger": {},
                "kv_pools": pools})
    got = {(s.labels["pool"], s.labels["state"]): s.value
           for fam in text_string_to_metric_families(m.render().decode())
           for s in fam.samples if s.name == "tide:kv_pool_slots"}
    assert got[("swa", "capacity")] == 128 and got[("full", "used")] == 31
    assert got[("swa", "evictable")] == pools["swa"]["evictable"]


def _held_swa(req) -> int:
    """SWA slots a live request holds itself (as `Scheduler.check_invariants` counts them)."""
    return req.kv_len - max(len(req.prefix_indices), req.swa_evicted_len) if req.kv_len else 0


def test_prefilled_requests_keep_only_their_window_so_prompts_do_not_cap_admission(ckpts,
                                                                                   hf_models):
    """Prefill runs first while requests wait, so requests are admitted one 40-token prompt per
    step before any decodes. Each keeps only its window of SWA slots once its prompt is in (not
    the whole prompt until its first decode step): all 8 run at once in a 160-slot SWA pool,
    where whole prompts would let 3 in. Free SWA slots hold NaN after every step, so giving back
    a slot still in the window would show in the logprobs."""
    engine = tide.Engine(str(ckpts["gemma3"]), max_total_tokens=1024,
                         swa_full_tokens_ratio=0.15625, chunked_prefill_size=40,
                         max_prefill_tokens=40)
    sched = engine.scheduler
    assert sched.kv_pools()["swa"]["capacity"] == 160
    page = sched.swa_page
    running: list[int] = []
    held: list[int] = []
    real = sched.process_results

    def spy(batch, out):
        done = real(batch, out)
        sched.check_invariants()
        running.append(len(sched.running))
        held.extend(_held_swa(r) for r in sched.running)
        _poison_free_swa_slots(engine)
        return done

    sched.process_results = spy
    prompts = random_prompts(903, [40] * 8)
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
    assert max(held) <= WINDOW + page
    assert max(running) == 8 and sched.stats.num_retractions == 0
    for prompt, out in zip(prompts[:3], outs[:3]):
        _check_hf(hf_models["gemma3"], prompt, out, 4)
    _assert_empty_after_flush(engine)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_overlapped_decode_keeps_the_swa_footprint_to_a_window(arch, ckpts, hf_models):
    """The overlap schedule (on CPU the same logic, run synchronously) gives back out-of-window
    SWA slots as a step at a time does: a request holds at most window + page + 1 (the token of
    the step in flight) of them, and the outputs equal transformers' with NaN in every free SWA
    slot."""
    engine = tide.Engine(str(ckpts[arch]), max_total_tokens=256, swa_full_tokens_ratio=0.25)
    sched = engine.scheduler
    sched.overlap = True
    page = sched.swa_page
    held: list[int] = []
    real = sched.step

    def step():
        done = real()
        sched.check_invariants()
        held.extend(_held_swa(r) for r in sched.running)
        _poison_free_swa_slots(engine)
        return done

    sched.step = step
    prompts = random_prompts(904, [6, 13])
    max_new = 4 * WINDOW
    outs = engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}, return_logprob=True)
    assert sched.stats.num_overlapped_decode > max_new // 2
    assert max(held) <= WINDOW + page + 1
    for prompt, out in zip(prompts, outs):
        _check_hf(hf_models[arch], prompt, out, max_new)
    sched.settle()
    _assert_empty_after_flush(engine)
    engine.shutdown()
