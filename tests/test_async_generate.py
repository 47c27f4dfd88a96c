"""`Engine.async_generate` (sglang's name): concurrent coroutines' requests decode together on a
background stepping thread and give `generate`'s outputs; cancelling a call aborts its requests;
pause, control calls, sync callers and shutdown interleave with it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import tide
import torch

from conftest import random_prompts

PROMPTS = random_prompts(61, [5, 9, 14, 7, 20, 11, 6, 17])
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(llama_path):
    with tide.Engine(str(llama_path), max_total_tokens=4096) as eng:
        yield eng


def _idle(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work() or engine._async.running:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def test_concurrent_calls_decode_together_and_match_generate(engine):
    """Eight coroutines, one prompt each (one of them a list of two): the outputs are `generate`'s
    (greedy tokens and logprobs), and their decode steps are shared: far fewer than if each ran
    alone."""
    ref = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    _idle(engine)
    before = engine.scheduler.stats.num_forward_decode

    async def main() -> list:
        calls = [engine.async_generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
                 for p in PROMPTS[:6]]
        calls.append(engine.async_generate(input_ids=PROMPTS[6:], sampling_params=GREEDY,
                                           return_logprob=True))
        return await asyncio.gather(*calls)

    outs = asyncio.run(main())
    got = [*outs[:6], *outs[6]]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    for a, b in zip(got, ref):
        ours, theirs = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t for _, t in ours] == [t for _, t in theirs]
        assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
    steps = engine.scheduler.stats.num_forward_decode - before
    assert steps < 3 * GREEDY["max_new_tokens"], steps  # alone: 8 x 23 decode steps
    _idle(engine)  # the stepping thread exits once no call waits


def test_bad_input_raises_before_anything_runs(engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="temperature"):
            await engine.async_generate(input_ids=PROMPTS[0], sampling_params={"temperature": -1})

    asyncio.run(main())
    assert not engine.scheduler.has_work()


def test_cancelling_a_call_aborts_its_requests(engine):
    """A long call is cancelled mid-decode: its request is aborted (its KV back), while a call
    beside it runs to its end; the engine serves afterwards."""
    _idle(engine)
    steps_before = engine.scheduler.stats.num_forward_decode
    long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}

    async def main() -> dict:
        victim = asyncio.create_task(engine.async_generate(input_ids=PROMPTS[1],
                                                           sampling_params=long, rid="victim"))
        other = asyncio.create_task(engine.async_generate(input_ids=PROMPTS[2],
                                                          sampling_params=GREEDY))
        while engine.scheduler.stats.num_forward_decode == 0 or not engine.scheduler.running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await other

    out = asyncio.run(main())
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    _idle(engine)  # nothing queued or running: the victim is gone
    assert engine.scheduler.stats.num_forward_decode - steps_before < 200  # it wanted 399 more
    assert engine.scheduler.tree_cache.protected_size() == 0  # no KV left locked
    again = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    assert len(again["output_ids"]) == GREEDY["max_new_tokens"]


def test_pause_and_sync_callers_interleave(engine):
    """While calls wait: a thread's `generate` batches with them, a pause holds them (no step
    runs) and continue lets them finish with the tokens they would have had."""
    ref = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
    _idle(engine)
    sync_out: list = []

    async def main() -> list:
        for _ in range(4):
            tasks = [asyncio.create_task(engine.async_generate(input_ids=p, sampling_params=GREEDY))
                     for p in PROMPTS[:2]]
            while not engine.scheduler.running and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            paused = engine.pause_generation(mode="in_place")
            assert paused["success"]
            if paused["num_paused_requests"] == 2:
                break
            # A stalled host: a call finished before the pause. Let the rest finish; again.
            assert engine.continue_generation()["success"]
            await asyncio.gather(*tasks)
        else:
            raise AssertionError("the calls finished before the pause, four times")
        steps = engine.scheduler.stats.num_forward_decode
        thread = threading.Thread(target=lambda: sync_out.append(engine.generate(
            input_ids=PROMPTS[2], sampling_params=GREEDY)))
        thread.start()
        await asyncio.sleep(0.3)
        assert engine.scheduler.stats.num_forward_decode == steps  # paused: nothing stepped
        assert not any(t.done() for t in tasks)
        assert engine.continue_generation()["success"]
        outs = await asyncio.gather(*tasks)
        await asyncio.to_thread(thread.join, 60)
        return outs

    outs = asyncio.run(main())
    assert [o["output_ids"] for o in [*outs, *sync_out]] == [o["output_ids"] for o in ref]


def test_shutdown_answers_waiting_calls(llama_path):
    """A call waiting when the engine shuts down gets its aborted output, not a hang; later calls
    raise."""
    engine = tide.Engine(str(llama_path), max_total_tokens=2048)

    async def main() -> dict:
        task = asyncio.create_task(engine.async_generate(input_ids=PROMPTS[0], sampling_params={
            "temperature": 0, "max_new_tokens": 500, "ignore_eos": True}))
        while not engine.scheduler.running:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.wait_for(task, 30)

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY))


def test_cancelling_aborts_only_that_calls_requests(engine):
    """Two calls with one rid (rids are unique within a call only): cancelling one leaves the
    other's request running to its end."""
    long = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}

    async def main() -> dict:
        victim = asyncio.create_task(engine.async_generate(input_ids=PROMPTS[3],
                                                           sampling_params=long, rid="same"))
        other = asyncio.create_task(engine.async_generate(input_ids=PROMPTS[4],
                                                          sampling_params=long, rid="same"))
        while len(engine.scheduler.running) < 2:
            await asyncio.sleep(0.002)
        victim.cancel()
        return await other

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 60
    _idle(engine)


def test_a_failing_step_fails_its_calls_and_leaves_nothing_behind(engine, monkeypatch):
    """A step that raises fails the calls waiting then (their requests aborted, nothing left
    queued or holding KV); the next call runs."""
    real = engine.scheduler.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in step")
        return real()

    monkeypatch.setattr(engine.scheduler, "step", step)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="boom in step"):
            await asyncio.gather(*[engine.async_generate(input_ids=p, sampling_params=GREEDY)
                                   for p in PROMPTS[:3]])

    asyncio.run(main())
    _idle(engine)
    assert engine.flush_cache(empty_cache=False)
    out = asyncio.run(engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY))
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_no_call_waits_forever_after_a_defect(engine, monkeypatch):
    """Failures outside a step (a request that cannot be queued, an interrupt on the stepping
    thread) answer every waiting call with an error, leave nothing queued, and the next call runs
    on a new thread."""
    real_add, real_step = engine.scheduler.add_request, engine.scheduler.step
    added = {"n": 0}

    def add_request(req):
        added["n"] += 1
        if added["n"] == 2:
            raise RuntimeError("cannot queue")
        return real_add(req)

    async def three() -> list:
        return await asyncio.wait_for(asyncio.gather(
            *[engine.async_generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS[:3]],
            return_exceptions=True), 30)

    monkeypatch.setattr(engine.scheduler, "add_request", add_request)
    outs = asyncio.run(three())
    assert any(isinstance(o, RuntimeError) and "cannot queue" in str(o) for o in outs)
    monkeypatch.setattr(engine.scheduler, "add_request", real_add)
    _idle(engine)

    def interrupted():
        raise KeyboardInterrupt("simulated")

    monkeypatch.setattr(engine.scheduler, "step", interrupted)
    outs = asyncio.run(three())
    assert all(isinstance(o, RuntimeError) and "KeyboardInterrupt" in str(o) for o in outs)
    monkeypatch.setattr(engine.scheduler, "step", real_step)
    _idle(engine)
    assert engine.flush_cache(empty_cache=False)
    out = asyncio.run(engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY))
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_the_event_loop_never_waits_for_the_engine_lock(engine):
    """While another thread holds the engine lock (a control call, a weight update draining),
    making calls does not block the event loop: a 5 ms heartbeat keeps beating."""
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with engine._control():
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)

    async def main() -> tuple[float, list]:
        gaps: list[float] = []

        async def beat() -> None:
            last = time.monotonic()
            while not release.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beating = asyncio.create_task(beat())
        calls = [asyncio.create_task(engine.async_generate(input_ids=p, sampling_params=GREEDY))
                 for p in PROMPTS[:4]]
        await asyncio.sleep(0.4)  # the calls wait behind the lock; the loop does not
        release.set()
        outs = await asyncio.gather(*calls)
        await beating
        return max(gaps), outs

    worst, outs = asyncio.run(main())
    holder.join(10)
    assert worst < 0.2, worst
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)


def test_sglang_arguments_for_what_tide_lacks(engine):
    """sglang's generate arguments are taken at their defaults (as verl-style code passes them)
    and refused, naming them, otherwise; an unknown name is a TypeError."""
    kwargs = {"image_data": None, "lora_path": None, "return_hidden_states": False,
              "custom_logit_processor": None, "stream": False}
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **kwargs)
    same = asyncio.run(engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                                             **kwargs))
    assert out["output_ids"] == same["output_ids"]
    for name, value in (("image_data", "img.png"), ("stream", True), ("lora_path", "a")):
        with pytest.raises(ValueError, match=f"^{name} is not supported"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **{name: value})
    with pytest.raises(TypeError, match="no_such_argument"):
        engine.generate(input_ids=PROMPTS[0], no_such_argument=1)
    assert not engine.scheduler.has_work()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_concurrent_calls_on_a_cuda_engine(tmp_path):
    """A CUDA engine (graphs, overlap) stepped from the background thread: concurrent calls give
    the tokens one `generate` call gives, and share decode steps."""
    from conftest import build_checkpoint

    path = build_checkpoint(tmp_path / "llama", "llama")
    with tide.Engine(str(path), dtype="float32", max_total_tokens=8192) as engine:
        ref = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        before = engine.scheduler.stats.num_forward_decode

        async def main() -> list:
            return await asyncio.gather(*[engine.async_generate(input_ids=p, sampling_params=GREEDY)
                                          for p in PROMPTS])

        outs = asyncio.run(main())
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
        assert engine.scheduler.stats.num_forward_decode - before < 3 * GREEDY["max_new_tokens"]
