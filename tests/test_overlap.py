"""The overlap schedule and mixed batches give exactly the tokens of the one-step-at-a-time schedule.

On CPU nothing runs asynchronously, but the overlap logic is the same: decode step N+1 is prepared
and launched (its input ids are step N's sampled tokens, left in a tensor) before step N's tokens are
applied. Each test runs the same requests twice on one engine — `scheduler.overlap` (or
`enable_mixed_chunk`) off, then on — driving `Scheduler.step()` by hand, and compares every token,
logprob, finish reason and weight version. Events (abort, pause, weight update) fire when a request
has `k` tokens decided: applied, or sampled by a step still in flight; the event settles that step
first, so both runs see the same state.

Stops that cannot be foreseen (stop token ids, stop strings) let a finished request ride one extra
step in the overlap schedule, which changes the batch's row count; those tests use
`enable_deterministic_inference` (batch-invariant matmuls) so a row's result cannot depend on it.

Hybrid sliding-window models (tiny Gemma-2/Gemma-3, window 8, two-pool KV cache) run generations
several windows long, so out-of-window SWA slots are given back while a step is in flight; after
each run every slot of both pools is back exactly once.
"""

from __future__ import annotations

import dataclasses

import pytest
import tide
import torch
from tide.layers.sampler import Sampler
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.scheduler.scheduler import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO

from conftest import random_prompts

LENGTHS = [5, 9, 14, 21, 30, 41]


@pytest.fixture(scope="module")
def engine(llama_path):
    eng = tide.Engine(str(llama_path), max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def det_engine(llama_path):
    eng = tide.Engine(str(llama_path), max_total_tokens=4096, enable_deterministic_inference=True)
    yield eng
    eng.shutdown()


def _reqs(prompts, params: list[dict], tag: str = "r", logprobs: bool = False) -> list[Req]:
    return [Req(rid=f"{tag}{i}", origin_input_ids=list(p), sampling_params=SamplingParams(**sp),
                return_logprob=logprobs, top_logprobs_num=3 if logprobs else 0)
            for i, (p, sp) in enumerate(zip(prompts, params))]


def _decided(sched, req: Req) -> int:
    """Tokens of `req` applied, plus one if a launched step is still computing its next."""
    launched = sched.launched
    riding = launched is not None and not req.finished and any(r is req for r in launched.batch.reqs)
    return len(req.output_ids) + int(riding)


class Sender:
    """The scheduler process's bookkeeping (`_send_outputs`, `_report_finished`): what a client
    receives from step() returns, abort returns and handover calls."""

    def __init__(self, reqs: list[Req]) -> None:
        self.live = {r.rid: r for r in reqs}
        self.received: dict[str, list[int]] = {r.rid: [] for r in reqs}
        self.finishes: dict[str, int] = {r.rid: 0 for r in reqs}

    def send(self, reqs: list[Req], from_step: bool = False) -> None:
        for r in reqs:
            if from_step and self.live.get(r.rid) is not r:
                continue
            got = self.received[r.rid]
            got.extend(r.output_ids[len(got):])
            if r.finished:
                self.finishes[r.rid] += 1
                self.live.pop(r.rid, None)

    def report_finished(self) -> None:
        self.send([r for r in self.live.values() if r.finished])


def _run(engine, reqs: list[Req], overlap: bool, events=(), mixed: bool = False,
         chunk: int = 16, new_token_ratio: float = INIT_NEW_TOKEN_RATIO, **options) -> dict:
    """Step `reqs` to the end; `events`: (rid, k, action) — `action(engine)` runs once, as soon as
    request `rid` has k tokens decided. Small prefill chunks (`chunk`) keep a prompt mid-prefill
    while others decode (the mixed batches' case). Every run starts from the same admission
    estimate (`new_token_ratio`; a low one, as after a long run, admits more than may fit).
    Returns what each request produced."""
    sched = engine.scheduler
    assert engine.flush_cache()
    sched.overlap = overlap
    sched.new_token_ratio = new_token_ratio
    config = sched.config
    sched.config = dataclasses.replace(config, enable_mixed_chunk=mixed, chunked_prefill_size=chunk,
                                       **options)
    sched.stats.num_overlapped_decode = sched.stats.num_mixed_decode = 0
    sched.worker.sampler = Sampler(0)  # unseeded rows draw from the same generator state each run
    sched.handover.weight_version = "default"  # a previous run's updates leave theirs
    for req in reqs:
        sched.add_request(req)
    by_rid = {r.rid: r for r in reqs}
    sender = Sender(reqs)
    pending = list(events)
    ahead_while_waiting = 0
    try:
        for _ in range(5000):
            for ev in list(pending):
                rid, k, action = ev
                if _decided(sched, by_rid[rid]) >= k or by_rid[rid].finished:
                    pending.remove(ev)
                    sender.send(action(engine) or [])
                    sender.report_finished()
            if all(r.finished for r in reqs) and not sched.has_work():
                break
            assert not sched.is_blocked(), "the test left the engine paused"
            ahead = sched.stats.num_overlapped_decode
            sender.send(sched.step(), from_step=True)
            if sched.stats.num_overlapped_decode > ahead and sched.waiting:
                ahead_while_waiting += 1
            sched.check_invariants()
        else:
            pytest.fail("no progress")
    finally:
        overlapped, mixed_tokens = sched.stats.num_overlapped_decode, sched.stats.num_mixed_decode
        sched.overlap = False
        sched.config = config
    assert not pending, "an event never fired"
    # every token reached the client once, and every finish exactly once
    assert sender.received == {r.rid: r.output_ids for r in reqs}
    assert set(sender.finishes.values()) == {1}
    assert sched.tree_cache.protected_size() == 0
    out = {r.rid: (r.output_ids, r.finished_reason, r.weight_version, r.output_token_logprobs,
                   r.output_top_logprobs) for r in reqs}
    return {"overlapped": overlapped, "mixed": mixed_tokens, "out": out,
            "ahead_while_waiting": ahead_while_waiting}


def _same(engine, make, events=(), mixed_too: bool = False) -> dict:
    base = _run(engine, make(), overlap=False, events=events)
    over = _run(engine, make(), overlap=True, events=events)
    assert over["out"] == base["out"]
    assert over["overlapped"] > 0, "no decode step was launched ahead"
    if mixed_too:
        for overlap in (False, True):
            mixed = _run(engine, make(), overlap=overlap, events=events, mixed=True)
            assert mixed["out"] == base["out"]
            assert mixed["mixed"] > 0, "no decode rode along with a prefill"
    return base["out"]


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_greedy_and_sampled_with_logprobs(engine):
    prompts = random_prompts(1, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=n) for n in (3, 17, 8, 25, 1, 12)]
    _same(engine, lambda: _reqs(prompts, params), mixed_too=True)
    # temperature sampling, seeded and from the engine's generator, top-k / top-p, logprobs
    sampled = [{"temperature": 1.0, "seed": 7, "max_new_tokens": 20, "ignore_eos": True},
               {"temperature": 0.8, "top_k": 5, "max_new_tokens": 9, "ignore_eos": True},
               {"temperature": 1.0, "top_p": 0.9, "seed": 3, "max_new_tokens": 16, "ignore_eos": True},
               dict(GREEDY, max_new_tokens=11), {"temperature": 1.2, "seed": 1, "max_new_tokens": 6,
                                                 "ignore_eos": True},
               {"temperature": 0.5, "min_p": 0.1, "max_new_tokens": 14, "ignore_eos": True}]
    out = _same(engine, lambda: _reqs(prompts, sampled, logprobs=True))
    assert all(len(o[3]) == len(o[0]) and len(o[4]) == len(o[0]) for o in out.values())


def test_penalties_run_one_step_at_a_time_and_agree(engine):
    prompts = random_prompts(2, LENGTHS[:3])
    params = [dict(GREEDY, max_new_tokens=12, repetition_penalty=1.3),
              dict(GREEDY, max_new_tokens=10), dict(GREEDY, max_new_tokens=8, presence_penalty=0.5)]
    base = _run(engine, _reqs(prompts, params), overlap=False)
    over = _run(engine, _reqs(prompts, params), overlap=True)
    assert over["out"] == base["out"]
    assert over["overlapped"] == 0  # penalties read the previous token on the host
    alone = _run(engine, _reqs(prompts[1:2], params[1:2]), overlap=True)
    assert alone["overlapped"] > 0 and alone["out"]["r0"][0] == base["out"]["r1"][0]


def test_stop_token_ids_and_stop_strings(det_engine):
    prompts = random_prompts(3, LENGTHS)
    free = _run(det_engine, _reqs(prompts, [dict(GREEDY, max_new_tokens=24)] * len(prompts)),
                overlap=False)["out"]
    # Stop on a token each request produces mid-way (and one never produced), or on a stop string.
    params = []
    for i, rid in enumerate(sorted(free)):
        ids = free[rid][0]
        if i % 3 == 0:
            params.append({"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [ids[6 + i]]})
        elif i % 3 == 1:
            text = det_engine.tokenizer.decode(ids[4 + i : 6 + i])
            params.append({"temperature": 0, "max_new_tokens": 24, "stop": [text.strip() or text]})
        else:
            params.append({"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [1]})
    out = _same(det_engine, lambda: _reqs(prompts, params), mixed_too=True)
    assert sum(o[1]["type"] == "stop" for o in out.values()) >= 3


def test_abort_mid_flight(engine):
    prompts = random_prompts(4, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=20)] * len(prompts)
    events = [("r2", 6, lambda e: e.scheduler.abort("r2")),
              ("r4", 11, lambda e: e.scheduler.abort("r4"))]
    out = _same(engine, lambda: _reqs(prompts, params), events=events)
    assert out["r2"][1]["type"] == "abort" and len(out["r2"][0]) == 6
    assert out["r4"][1]["type"] == "abort" and len(out["r4"][0]) == 11
    assert all(len(out[f"r{i}"][0]) == 20 for i in (0, 1, 3, 5))


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(engine, mode):
    prompts = random_prompts(5, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=18)] * len(prompts)

    def pause(e):
        assert e.pause_generation(mode)["success"]
        assert e.scheduler.launched is None  # the step on the device landed before the pause
        assert e.continue_generation(torch_empty_cache=False)["success"]

    out = _same(engine, lambda: _reqs(prompts, params), events=[("r1", 7, pause)])
    if mode == "abort":
        assert all(o[1]["type"] == "abort" for o in out.values())
        assert len(out["r1"][0]) == 7
    else:
        assert all(len(o[0]) == 18 for o in out.values())


def test_weight_update_between_steps(engine):
    """Paused in place, new weights: the tokens after the update come from them, and the version
    each request finishes with is the one in force at its finish."""
    sched = engine.scheduler
    base = [(n, p.detach().clone()) for n, p in engine.model_runner.model.named_parameters()]
    new = [(n, t * 1.5 if "mlp" in n else t) for n, t in base]
    prompts = random_prompts(6, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=n) for n in (6, 16, 9, 20, 4, 14)]

    def update(version, weights):
        def act(e):
            assert e.pause_generation("in_place")["success"]
            res = e.update_weights_from_tensor(named_tensors=weights, weight_version=version)
            assert res["success"], res["message"]
            assert e.continue_generation(torch_empty_cache=False)["success"]
        return act

    try:
        out = _same(engine, lambda: _reqs(prompts, params),
                    events=[("r1", 8, update("v2", new)), ("r3", 15, update("v3", base))])
    finally:
        res = engine.update_weights_from_tensor(named_tensors=base, weight_version="default")
        assert res["success"]
    versions = {rid: o[2] for rid, o in out.items()}
    assert versions["r0"] == versions["r4"] == "default"  # finished before the first update
    # all decode in step: the k-th tokens of all requests land together
    assert versions["r2"] == versions["r5"] == "v2" and versions["r1"] == versions["r3"] == "v3"
    # r1's tokens after the update differ from a run without it (the new weights are used)
    plain = _run(engine, _reqs(prompts, params), overlap=True)["out"]
    assert plain["r1"][0][:8] == out["r1"][0][:8] and plain["r1"][0][8:] != out["r1"][0][8:]
    assert sched.handover.weight_version == "default"


def test_retraction_under_memory_pressure(llama_path):
    engine = tide.Engine(str(llama_path), max_total_tokens=200)
    try:
        prompts = random_prompts(7, [20, 24, 28, 32, 36])
        params = [dict(GREEDY, max_new_tokens=n) for n in (30, 34, 28, 36, 32)]
        base = _run(engine, _reqs(prompts, params), overlap=False)
        retractions = engine.scheduler.stats.num_retractions
        assert retractions > 0, "the pool was meant to run short"
        over = _run(engine, _reqs(prompts, params), overlap=True)
        assert over["out"] == base["out"] and over["overlapped"] > 0
        assert engine.scheduler.stats.num_retractions > retractions
        mixed = _run(engine, _reqs(prompts, params), overlap=True, mixed=True)
        assert mixed["out"] == base["out"] and mixed["mixed"] > 0
    finally:
        engine.shutdown()


def test_requests_waiting_for_a_running_slot(engine):
    """More requests than max_running_requests: decode steps go on overlapped while the rest wait
    for a slot, and each is admitted at the step it would be without the overlap."""
    prompts = random_prompts(9, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=n) for n in (12, 5, 9, 14, 3, 8)]
    base = _run(engine, _reqs(prompts, params), overlap=False, max_running_requests=2)
    over = _run(engine, _reqs(prompts, params), overlap=True, max_running_requests=2)
    assert over["out"] == base["out"] and over["ahead_while_waiting"] > 0


def test_engine_generate_with_overlap(engine):
    """Through `Engine.generate` (the loop every caller uses)."""
    prompts = random_prompts(8, LENGTHS)
    params = [dict(GREEDY, max_new_tokens=n) for n in (7, 3, 19, 10, 2, 13)]
    ref = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.scheduler.overlap = True
    try:
        got = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.scheduler.overlap = False
    assert [o["output_ids"] for o in got] == ref
    assert [o["meta_info"]["completion_tokens"] for o in got] == [7, 3, 19, 10, 2, 13]
    assert not engine.scheduler.has_work() and engine.flush_cache()
    assert torch.equal(engine.scheduler.allocator.all_free_slots().sort().values,
                       torch.arange(1, engine.scheduler.max_total_tokens + 1))


# ---- hybrid sliding-window models (two-pool KV cache, window 8)


@pytest.fixture(scope="module")
def swa_ckpts(tmp_path_factory):
    from test_swa_models import build_swa_checkpoint

    root = tmp_path_factory.mktemp("overlap_swa")
    return {a: build_swa_checkpoint(root / a, a) for a in ("gemma2", "gemma3")}


def _assert_pools_whole(engine) -> None:
    """Once no request runs: evicting the whole radix cache gives back every slot of both pools,
    each exactly once (a leaked slot is missing, a double-freed one appears twice), and after
    flush_cache both pools are empty."""
    sched = engine.scheduler
    assert not sched.has_work()
    sched.check_invariants()
    alloc = sched.allocator
    tree = sched.tree_cache
    tree.evict(tree.total_size(), tree.swa_total_size())
    assert tree.total_size() == 0 and tree.swa_total_size() == 0
    for name, pool, size in (("full", alloc.full, alloc.size), ("swa", alloc.swa, alloc.size_swa)):
        got = pool.all_free_slots().sort().values
        assert torch.equal(got, torch.arange(1, size + 1)), name
    assert int(alloc.full_to_swa_index_mapping.abs().sum()) == 0
    assert engine.flush_cache()
    for name, pool in sched.kv_pools().items():
        assert pool["free"] == pool["capacity"], name


def _swa_spy(sched) -> list[int]:
    """Record, after every applied step, how many SWA slots each running request that has decoded
    holds (right after its prefill it holds its whole prompt's)."""
    held: list[int] = []
    real = sched._apply_tokens

    def spy(reqs, *args, **kwargs):
        done = real(reqs, *args, **kwargs)
        held.extend(r.kv_len - max(len(r.prefix_indices), r.swa_evicted_len) for r in sched.running
                    if r.kv_len > len(r.origin_input_ids))
        return done

    sched._apply_tokens = spy
    return held


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_model_overlap_matches(arch, swa_ckpts):
    """Generations four windows long and more: out-of-window SWA slots are given back while the
    next step is on the device. Six requests, three running at a time, sampled and greedy, with
    logprobs; one aborted while a step is in flight; one whose prompt extends a finished request's
    whole sequence (a follow-up turn: a prefix-cache hit on a sequence whose SWA slots before its
    last window are freed). Same tokens, logprobs, finish reasons as one step at a time, each
    request holds about a window of SWA slots, and no slot of either pool leaks."""
    from test_swa_models import WINDOW

    engine = tide.Engine(str(swa_ckpts[arch]), max_total_tokens=512, swa_full_tokens_ratio=0.5)
    try:
        sched = engine.scheduler
        assert sched.swa_window == WINDOW
        shared, a, b, c, d, tail = random_prompts(20, [18, 11, 6, 25, 9, 4])
        turn = engine.generate(input_ids=shared, sampling_params=dict(GREEDY, max_new_tokens=12))
        follow_up = shared + turn["output_ids"] + tail
        prompts = [shared, a, b, c, d, follow_up]
        params = [dict(GREEDY, max_new_tokens=12), dict(GREEDY, max_new_tokens=4 * WINDOW + 3),
                  {"temperature": 1.0, "seed": 5, "max_new_tokens": 5 * WINDOW, "ignore_eos": True},
                  {"temperature": 0.7, "top_k": 8, "max_new_tokens": 4 * WINDOW, "ignore_eos": True},
                  dict(GREEDY, max_new_tokens=3 * WINDOW), dict(GREEDY, max_new_tokens=4 * WINDOW)]
        events = [("r2", 2 * WINDOW + 3, lambda e: e.scheduler.abort("r2"))]
        runs = {}
        for overlap in (False, True):
            reqs = _reqs(prompts, params, logprobs=True)
            held = _swa_spy(sched)
            try:
                runs[overlap] = _run(engine, reqs, overlap=overlap, events=events,
                                     max_running_requests=3)
            finally:
                del sched._apply_tokens
            assert reqs[5].cached_tokens >= len(shared) + 11  # r5 reused r0's whole sequence
            assert max(held) <= WINDOW + sched.swa_page, (overlap, held)  # given back while decoding
            _assert_pools_whole(engine)
        base, over = runs[False], runs[True]
        assert over["out"] == base["out"]
        assert over["overlapped"] > 3 * WINDOW and over["ahead_while_waiting"] > 0
        out = base["out"]
        assert out["r2"][1]["type"] == "abort" and len(out["r2"][0]) == 2 * WINDOW + 3
        for i in (0, 1, 3, 4, 5):
            assert out[f"r{i}"][1]["type"] == "length"
            assert len(out[f"r{i}"][0]) == params[i]["max_new_tokens"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_model_retraction_when_the_swa_pool_runs_short(arch, swa_ckpts):
    """A 40-slot SWA pool beside a full pool that cannot run short: after a long run (a low
    admission estimate) more short prompts are admitted than can each keep a window of SWA slots,
    so decoding retracts requests for SWA slots. The overlap schedule retracts the same requests
    at the same steps and gives the same tokens; mixed batches too; no slot of either pool leaks."""
    engine = tide.Engine(str(swa_ckpts[arch]), max_total_tokens=400, swa_full_tokens_ratio=0.1)
    try:
        sched = engine.scheduler
        assert sched.kv_pools()["swa"]["capacity"] == 40
        lens = [3, 4, 2, 5, 3, 4, 2, 3]
        prompts = random_prompts(30, lens)
        params = [dict(GREEDY, max_new_tokens=30 + 2 * i) for i in range(len(lens))]
        # Every request's whole sequence fits the full pool at once: retraction is the SWA pool's.
        assert sum(lens) + sum(p["max_new_tokens"] for p in params) < sched.max_total_tokens
        runs = {}
        for mixed in (False, True):
            for overlap in (False, True):
                before = sched.stats.num_retractions
                run = _run(engine, _reqs(prompts, params, logprobs=True), overlap=overlap,
                           mixed=mixed, new_token_ratio=MIN_NEW_TOKEN_RATIO)
                run["retractions"] = sched.stats.num_retractions - before
                runs[overlap, mixed] = run
                _assert_pools_whole(engine)
        base = runs[False, False]
        assert base["retractions"] > 0, "the SWA pool was meant to run short"
        for mixed in (False, True):
            one, over = runs[False, mixed], runs[True, mixed]
            assert over["out"] == one["out"], mixed
            assert over["retractions"] == one["retractions"] == base["retractions"], mixed
            assert over["overlapped"] > 0, mixed
        assert runs[True, True]["mixed"] > 0
        # A decode row of a mixed batch runs the extend kernels: the same tokens, logprobs equal
        # to the last bits (sliding-window extend attention sums in another order on CPU).
        for rid, got in runs[True, True]["out"].items():
            want = base["out"][rid]
            assert got[0] == want[0] and got[1] == want[1]
            assert max(abs(a[0] - b[0]) for a, b in zip(got[3], want[3])) < 1e-5
        assert all(o[1]["type"] == "length" for o in base["out"].values())
    finally:
        engine.shutdown()


def test_sliding_window_overlap_chain_ends_when_only_the_swa_pool_is_short(swa_ckpts):
    """Eight requests decode in an overlap chain while the radix cache holds a finished sequence
    (31 full slots, only its last window of SWA slots) and no SWA slot is free: the full pool has
    room but the SWA pool does not, so the chain ends and the newest request is retracted, as one
    step at a time would; no step is launched that eviction cannot give slots to (its requests
    would be aborted)."""
    engine = tide.Engine(str(swa_ckpts["gemma2"]), max_total_tokens=400, swa_full_tokens_ratio=0.25)
    try:
        sched = engine.scheduler
        alloc = sched.allocator
        prompts = random_prompts(41, [3, 4, 2, 5, 3, 4, 2, 3])
        params = dict(GREEDY, max_new_tokens=20)
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert engine.flush_cache()
        engine.generate(input_ids=random_prompts(40, [20])[0],
                        sampling_params=dict(GREEDY, max_new_tokens=12))
        assert sched.tree_cache.evictable_size() == 31 and sched.tree_cache.swa_evictable_size() < 8
        reqs = _reqs(prompts, [params] * len(prompts))
        sched.overlap = True
        try:
            for req in reqs:
                sched.add_request(req)
            while not (len(sched.running) == 8 and sched.stats.num_overlapped_decode > 2):
                sched.step()
            stolen = alloc.swa.alloc(alloc.swa_available_size())  # the SWA pool runs dry
            assert sched.launched is not None and alloc.full_available_size() > 8
            retractions = sched.stats.num_retractions
            sched.step()
            assert sched.stats.num_retractions == retractions + 1 and len(sched.running) == 7
            assert not any(r.finished for r in reqs)  # nothing was aborted
            alloc.swa.free(stolen)
            while sched.has_work():
                sched.step()
                sched.check_invariants()
        finally:
            sched.overlap = False
        assert [r.output_ids for r in reqs] == want
        assert all(r.finished_reason["type"] == "length" for r in reqs)
        _assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_sliding_window_mixed_batch_needs_room_in_both_pools(swa_ckpts):
    """Seven requests near their end decode beside a cached sequence (31 full slots, only its last
    window of SWA slots) with no SWA slot free; a short prompt is admitted. The full pool could
    take the prompt and every decode row, the SWA pool could not: the prompt runs alone and the
    decoding requests wait (then the newest are retracted), rather than a mixed batch whose slots
    eviction cannot provide (all its requests would be aborted)."""
    engine = tide.Engine(str(swa_ckpts["gemma2"]), max_total_tokens=400, swa_full_tokens_ratio=0.25)
    try:
        sched = engine.scheduler
        alloc = sched.allocator
        engine.generate(input_ids=random_prompts(42, [20])[0],
                        sampling_params=dict(GREEDY, max_new_tokens=12))
        assert sched.tree_cache.evictable_size() == 31 and sched.tree_cache.swa_evictable_size() < 8
        reqs = _reqs(random_prompts(43, [3, 4, 2, 5, 3, 4, 2]), [dict(GREEDY, max_new_tokens=16)] * 7)
        late = _reqs(random_prompts(44, [3]), [dict(GREEDY, max_new_tokens=4)], tag="late")[0]
        config = sched.config
        sched.config = dataclasses.replace(config, enable_mixed_chunk=True)
        try:
            for req in reqs:
                sched.add_request(req)
            while min(len(r.output_ids) for r in reqs) < 8:
                sched.step()
            assert len(sched.running) == 7 and sched.stats.num_retractions == 0
            sched.new_token_ratio = MIN_NEW_TOKEN_RATIO  # little is reserved for them now
            sched.add_request(late)
            stolen = alloc.swa.alloc(alloc.swa_available_size())  # the SWA pool runs dry
            before = {r.rid: len(r.output_ids) for r in reqs}
            sched.step()
            assert len(late.output_ids) == 1  # admitted and prefilled
            assert not any(r.finished for r in reqs)  # nothing was aborted
            assert {r.rid: len(r.output_ids) for r in reqs} == before  # no decode row rode along
            alloc.swa.free(stolen)
            while sched.has_work():
                sched.step()
                sched.check_invariants()
        finally:
            sched.config = config
        assert all(r.finished_reason["type"] == "length" for r in reqs + [late])
        _assert_pools_whole(engine)
    finally:
        engine.shutdown()
