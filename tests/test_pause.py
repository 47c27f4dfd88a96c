"""Pause modes and weight updates with requests in flight (issue 5, CPU acceptance 4).

`generate()` runs in background threads while the test thread pauses, updates and continues. To make
"requests are in flight" exact rather than a race, a `StepGate` parks the generating threads at a step
boundary once their requests have produced some tokens: the parked thread waits on the engine's own
condition variable, which releases the engine lock, so the test thread acts between two steps exactly
as a trainer thread would. One test runs without the gate, to show a pause from another thread lands
mid-generation on its own.
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

import tide
from conftest import (
    InThread,
    hf_greedy_logprobs,
    named_weights,
    random_prompts,
    sgd_steps,
    wait_until,
)

MAX_NEW = 40
AFTER = 6  # tokens each request has when the gate parks the generating threads
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROB_TOL = 1e-4
PROMPTS = [[60 + 40 * i] + p for i, p in enumerate(random_prompts(77, [4, 8, 13, 19]))]
LATE = [[300 + 40 * i] + p for i, p in enumerate(random_prompts(78, [6, 11]))]
BASE_VERSION = "base"
NEW_VERSION = "v-new"


class StepGate:
    """Wraps `engine.scheduler.step`. Once `trigger(scheduler)` holds after a step run by a generating
    thread (named `gen*`), every generating thread parks before its next step until `release()`.
    Other threads (the test thread, an update thread draining the batch) step freely."""

    def __init__(self, engine, monkeypatch, trigger) -> None:
        self.engine = engine
        self.trigger = trigger
        self.reached = threading.Event()
        self.holding = False
        self.fired = False
        orig = engine.scheduler.step

        def step():
            self._park()
            out = orig()
            if not self.fired and _generating() and trigger(engine.scheduler):
                self.fired = True
                self.holding = True
                self.reached.set()
                self._park()
            return out

        monkeypatch.setattr(engine.scheduler, "step", step)

    def _park(self) -> None:
        # Called with the engine lock held (inside _run_until_finished); wait releases it.
        if (
            self.holding
            and _generating()
            and not self.engine._cond.wait_for(lambda: not self.holding, timeout=60)
        ):
            raise RuntimeError("step gate was never released")

    def wait_reached(self, timeout: float = 30.0) -> None:
        if not self.reached.wait(timeout):
            pytest.fail("generation never reached the gate")

    def release(self) -> None:
        with self.engine._cond:
            self.holding = False
            self.engine._cond.notify_all()


def _generating() -> bool:
    return threading.current_thread().name.startswith("gen")


def _has_tokens(n: int):
    return lambda sched: bool(sched.running) and all(len(r.output_ids) >= n for r in sched.running)


@pytest.fixture(scope="module")
def pe(checkpoints, hf_model_for):
    """A llama engine on its checkpoint weights, the greedy reference with those weights, and a
    trained copy of the model (the 'new weights') with its HF greedy reference."""
    engine = tide.Engine(str(checkpoints["llama"]))
    base = named_weights(hf_model_for("llama"))
    ref = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    late_ref = engine.generate(input_ids=LATE, sampling_params=GREEDY)
    new_model = copy.deepcopy(hf_model_for("llama"))
    sgd_steps(new_model, steps=2, lr=0.5, seed=21)
    new_ref = [hf_greedy_logprobs(new_model, p, MAX_NEW) for p in PROMPTS]
    assert [o["output_ids"] for o in ref] != [t for t, _ in new_ref], "new weights change nothing"
    yield SimpleNamespace(
        engine=engine,
        base=base,
        ref=[o["output_ids"] for o in ref],
        late_ref=[o["output_ids"] for o in late_ref],
        new=named_weights(new_model),
        new_model=new_model,
        new_ref=new_ref,
    )
    engine.shutdown()


@pytest.fixture
def env(pe, monkeypatch):
    """The shared engine, idle, on base weights with version `base` and an empty radix cache; after
    the test, gates are released, helper threads joined, and the engine restored the same way."""
    engine = pe.engine
    res = engine.update_weights_from_tensor(named_tensors=pe.base, weight_version=BASE_VERSION)
    assert res["success"], res["message"]
    gates: list[StepGate] = []
    threads: list[InThread] = []

    def gate(trigger=None) -> StepGate:
        g = StepGate(engine, monkeypatch, trigger or _has_tokens(AFTER))
        gates.append(g)
        return g

    def spawn(name, *args, **kwargs) -> InThread:
        t = InThread(engine.generate, *args, name=name, **kwargs)
        threads.append(t)
        return t

    yield SimpleNamespace(pe=pe, engine=engine, sched=engine.scheduler, gate=gate, spawn=spawn)
    for g in gates:
        g.release()
    if engine.handover.paused is not None:
        engine.continue_generation(torch_empty_cache=False)
    for t in threads:
        t.thread.join(30)
    monkeypatch.undo()
    res = engine.update_weights_from_tensor(
        named_tensors=pe.base, weight_version=BASE_VERSION, abort_all_requests=True
    )
    assert res["success"], res["message"]
    assert not engine.scheduler.has_work()
    engine.scheduler.check_invariants()


def _assert_no_kv_held(sched) -> None:
    assert sched.num_running() == 0
    sched.check_invariants()
    assert sched.tree_cache.protected_size() == 0
    assert sched.allocator.available_size() + sched.tree_cache.evictable_size() == sched.max_total_tokens
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


# ---- abort


def test_pause_abort_returns_partial_outputs(env):
    engine, sched = env.engine, env.sched
    gate = env.gate()
    gen = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    assert engine.flush_cache() is False  # busy: requests hold KV
    assert engine.flush_cache(empty_cache=False) is False

    res = engine.pause_generation("abort")
    assert res["success"] and res["num_paused_requests"] == len(PROMPTS)
    _assert_no_kv_held(sched)
    assert sched.num_queued() == 0
    gate.release()
    outs = gen.result()  # returns while still paused: aborted requests are finished
    for out, ref in zip(outs, env.pe.ref):
        n = len(out["output_ids"])
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert AFTER <= n < MAX_NEW
        assert out["meta_info"]["completion_tokens"] == n
        assert out["output_ids"] == ref[:n], "partial output is not the uninterrupted prefix"
        assert out["meta_info"]["weight_version"] == BASE_VERSION
    assert engine.flush_cache(empty_cache=False) is True  # idle now, even though paused
    engine.continue_generation(torch_empty_cache=False)


def test_pause_from_another_thread_lands_mid_generation(env):
    """No gate: a pause issued while another thread is generating takes effect within a few steps
    (control calls go ahead of the stepping thread), not after the whole batch."""
    engine = env.engine
    long = dict(GREEDY, max_new_tokens=400)
    gen = env.spawn("gen-long", input_ids=PROMPTS, sampling_params=long)
    wait_until(
        lambda: any(len(r.output_ids) >= 2 for r in list(engine.scheduler.running)),
        what="first tokens",
    )
    res = engine.pause_generation("abort")
    assert res["success"]
    outs = gen.result()
    assert res["num_paused_requests"] == len(PROMPTS)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 2 <= len(out["output_ids"]) < 400
    engine.continue_generation(torch_empty_cache=False)


# ---- retract


def test_pause_retract_frees_kv_and_resumes_identically(env):
    engine, sched = env.engine, env.sched
    retractions = sched.stats.num_retractions
    gate = env.gate()
    gen = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    held = list(sched.running)
    assert len(held) == len(PROMPTS)

    res = engine.pause_generation("retract")
    assert res["success"] and res["num_paused_requests"] == len(PROMPTS)
    _assert_no_kv_held(sched)
    assert sched.num_queued() == len(PROMPTS)  # re-queued, none lost
    assert sched.stats.num_retractions - retractions == len(PROMPTS)
    assert engine.flush_cache(empty_cache=False) is False  # queued requests: busy
    gate.release()
    assert not gen.done()

    engine.continue_generation(torch_empty_cache=False)
    outs = gen.result()
    assert [o["output_ids"] for o in outs] == env.pe.ref
    for out, req in zip(outs, held):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert req.num_retractions == 1
    sched.check_invariants()


def test_pause_retract_then_update_recomputes_with_new_weights(env):
    """Retracted requests are recomputed on continue with the then-current weights: their tokens
    before the pause are the old model's, the rest is the new model's greedy continuation."""
    engine, sched, pe = env.engine, env.sched, env.pe
    gate = env.gate()
    gen = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    partial = [list(r.output_ids) for r in sched.running]

    engine.pause_generation("retract")
    res = engine.update_weights_from_tensor(named_tensors=pe.new, weight_version=NEW_VERSION)
    assert res["success"], res["message"]
    assert res["num_paused_requests"] == len(PROMPTS)
    assert sched.tree_cache.total_size() == 0  # nothing held KV, so the flush reset everything
    _assert_no_kv_held(sched)
    gate.release()
    engine.continue_generation(torch_empty_cache=False)
    outs = gen.result()
    for i, (out, done) in enumerate(zip(outs, partial)):
        k = len(done)
        assert out["output_ids"][:k] == done
        assert out["output_ids"][:k] == pe.ref[i][:k]
        tail, _ = hf_greedy_logprobs(pe.new_model, PROMPTS[i] + done, MAX_NEW - k)
        assert out["output_ids"][k:] == tail, f"prompt {i}: not recomputed with the new weights"
        assert out["meta_info"]["weight_version"] == NEW_VERSION


# ---- in place


def _kv_state(sched, reqs):
    return [
        (r.req_pool_idx, r.kv_len, sched.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_len].clone())
        for r in reqs
    ]


def test_pause_in_place_keeps_kv_and_allows_update(env):
    engine, sched, pe = env.engine, env.sched, env.pe
    gate = env.gate()
    gen = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    held = list(sched.running)
    partial = [list(r.output_ids) for r in held]
    kv = _kv_state(sched, held)

    res = engine.pause_generation("in_place")
    assert res["success"] and res["num_paused_requests"] == len(PROMPTS)
    assert sched.num_running() == len(PROMPTS)
    assert engine.flush_cache() is False
    assert engine.flush_cache(empty_cache=False) is False

    res = engine.update_weights_from_tensor(named_tensors=pe.new, weight_version=NEW_VERSION)
    assert res["success"], res["message"]
    assert res["num_paused_requests"] == len(PROMPTS)
    # Held requests keep their KV exactly; every cached prefix they do not use is gone.
    assert sched.num_running() == len(PROMPTS)
    after = _kv_state(sched, held)
    for (slot, n, rows), (slot2, n2, rows2) in zip(kv, after):
        assert (slot, n) == (slot2, n2) and torch.equal(rows, rows2)
    assert sched.tree_cache.evictable_size() == 0
    sched.check_invariants()

    gate.release()
    assert not gen.done()
    engine.continue_generation(torch_empty_cache=False)
    outs = gen.result()
    for out, req, done in zip(outs, held, partial):
        assert out["meta_info"]["id"] == req.rid  # the same requests, completed
        assert out["output_ids"][: len(done)] == done
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert out["meta_info"]["weight_version"] == NEW_VERSION
        assert req.num_retractions == 0
    sched.check_invariants()


@pytest.mark.parametrize("when", ["after", "during"], ids=["after_finish", "while_running"])
@pytest.mark.parametrize("prefix_cached", [False, True], ids=["fresh", "prefix_hit"])
def test_in_place_update_leaves_no_stale_kv_for_later_requests(env, prefix_cached, when):
    """After an in-place update, the held requests' KV (their own slots and any cached prefix they
    locked) was computed with the old weights. A later request for the same prompt, arriving while
    they still run or after they finish, must not reuse it: its output must be the new model's."""
    engine, pe = env.engine, env.pe
    if prefix_cached:  # the in-flight requests will lock cached prefix nodes
        engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=2))
    gate = env.gate()
    gen = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    if prefix_cached:
        assert all(len(r.prefix_indices) > 0 for r in env.sched.running)
    engine.pause_generation("in_place")
    res = engine.update_weights_from_tensor(named_tensors=pe.new, weight_version=NEW_VERSION)
    assert res["success"], res["message"]
    if when == "after":
        gate.release()
        engine.continue_generation(torch_empty_cache=False)
        gen.result()
    else:
        engine.continue_generation(torch_empty_cache=False)
    later = InThread(
        engine.generate, input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True,
        name="late-b",  # not gated: steps (the held requests too) while gen-a stays parked
    )
    outs = later.result(30)
    if when == "during":
        assert not gen.done()
        gate.release()
        gen.result()
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, pe.new_ref)):
        ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
        err = (ours - torch.tensor(logprobs)).abs().max().item()
        assert out["output_ids"] == tokens and err <= LOGPROB_TOL, (
            f"prompt {i}: reused {out['meta_info']['cached_tokens']} cached tokens of KV computed "
            f"with the old weights (logprob error {err:.2e})"
        )
        assert out["meta_info"]["weight_version"] == NEW_VERSION
    env.sched.check_invariants()


# ---- requests arriving while paused


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_requests_submitted_while_paused_queue_and_complete(env, mode):
    engine, sched, pe = env.engine, env.sched, env.pe
    gate = env.gate()
    gen_a = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    engine.pause_generation(mode)
    gate.release()
    if mode == "abort":  # aborted requests are finished: generate returns while still paused
        outs_a = gen_a.result()
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs_a)
    forwards = (sched.stats.num_forward_extend, sched.stats.num_forward_decode)
    queued = sched.num_queued()
    assert queued == (len(PROMPTS) if mode == "retract" else 0)
    gen_b = env.spawn("gen-b", input_ids=LATE, sampling_params=GREEDY)
    wait_until(lambda: sched.num_queued() == queued + len(LATE), what="late requests to queue")
    assert (sched.stats.num_forward_extend, sched.stats.num_forward_decode) == forwards
    assert not gen_b.done()  # cannot finish while paused

    engine.continue_generation(torch_empty_cache=False)
    if mode != "abort":
        assert [o["output_ids"] for o in gen_a.result()] == pe.ref
    assert [o["output_ids"] for o in gen_b.result()] == pe.late_ref
    sched.check_invariants()


# ---- updates while not paused


def test_update_waits_for_in_flight_requests_and_queues_new_ones(env):
    engine, sched, pe = env.engine, env.sched, env.pe
    gate = env.gate()
    gen_a = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    # Same prompts again, arriving before the update: they must queue behind it and then be
    # served entirely by the new weights (not from the old requests' cached KV).
    gen_b = env.spawn("gen-b", input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    wait_until(lambda: sched.num_queued() == len(PROMPTS), what="second batch to queue")

    update = InThread(
        engine.update_weights_from_tensor, named_tensors=pe.new, weight_version=NEW_VERSION,
        name="update",
    )
    res = update.result(30)
    assert res["success"], res["message"]
    assert res["num_paused_requests"] == 0
    gate.release()

    for out, ref in zip(gen_a.result(), pe.ref):
        assert out["output_ids"] == ref  # finished in full, with the old weights
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert out["meta_info"]["weight_version"] == BASE_VERSION
    for i, (out, (tokens, logprobs)) in enumerate(zip(gen_b.result(), pe.new_ref)):
        assert out["meta_info"]["weight_version"] == NEW_VERSION
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == tokens, f"prompt {i}"
        ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
        assert (ours - torch.tensor(logprobs)).abs().max().item() <= LOGPROB_TOL
    sched.check_invariants()


def test_update_with_abort_all_requests_aborts_in_flight(env):
    engine, sched, pe = env.engine, env.sched, env.pe
    gate = env.gate()
    gen_a = env.spawn("gen-a", input_ids=PROMPTS, sampling_params=GREEDY)
    gate.wait_reached()
    res = InThread(
        engine.update_weights_from_tensor, named_tensors=pe.new, weight_version=NEW_VERSION,
        abort_all_requests=True, name="update",
    ).result(30)
    assert res["success"], res["message"]
    assert sched.handover.weight_version == NEW_VERSION
    gate.release()
    for out, ref in zip(gen_a.result(), pe.ref):
        n = len(out["output_ids"])
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert AFTER <= n < MAX_NEW and out["output_ids"] == ref[:n]
        assert out["meta_info"]["weight_version"] == BASE_VERSION
    _assert_no_kv_held(sched)


def test_update_waits_for_a_prompt_mid_chunked_prefill(checkpoints, pe, monkeypatch):
    """An update issued while a long prompt is between prefill chunks must let that prompt finish
    (or give its KV back) instead of waiting forever for it."""
    engine = tide.Engine(str(checkpoints["llama"]), chunked_prefill_size=8)
    prompt = random_prompts(79, [60])[0]
    gate = StepGate(engine, monkeypatch, lambda sched: sched.chunked_req is not None)
    gen = InThread(
        engine.generate, input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=8),
        name="gen-chunked",
    )
    gate.wait_reached()
    assert engine.scheduler.chunked_req is not None and not engine.scheduler.running
    update = InThread(engine.update_weights_from_tensor, named_tensors=pe.base, name="update")
    update.thread.join(10)
    stuck = update.thread.is_alive()
    if stuck:  # rescue the spinning update thread so the session can go on, then fail
        engine.handover.paused = "in_place"  # lets the waiting update apply at once
    res = update.result(30)
    gate.release()
    out = gen.result(30)
    assert not stuck, (
        "update_weights livelocked: it waits for the chunked request to stop holding KV, but "
        "admission_blocked keeps that request's next chunk from ever being scheduled"
    )
    assert res["success"], res["message"]
    assert len(out["output_ids"]) == 8
    engine.scheduler.check_invariants()
    engine.shutdown()
