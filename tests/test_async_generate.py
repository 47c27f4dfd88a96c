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
    while engine.scheduler.has_work() or engine._stepper is not None:
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
        tasks = [asyncio.create_task(engine.async_generate(input_ids=p, sampling_params=GREEDY))
                 for p in PROMPTS[:2]]
        while not engine.scheduler.running:
            await asyncio.sleep(0.005)
        assert engine.pause_generation(mode="in_place")["success"]
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
