"""The two-pool KV cache's decode path never waits for the device (CPU stand-in for the GPU check in
test_swa_nosync_gpu.py).

On CUDA, `.item()`, `.tolist()`, `.cpu()`, `nonzero`, `torch.unique`, a boolean-mask index and a
tensor used as a Python bool or int all wait for the GPU; the overlap schedule keeps the GPU one
decode step ahead only if the scheduler makes none of them on a steady step. A CPU run cannot see a
sync, so `SyncGuard` counts those calls instead, while the scheduler does its own work on steady
overlapped decode steps of a tiny hybrid model (Gemma-2 / Gemma-3, window 8, generations several
windows long): out-of-window SWA slots given back every step, cached-prefix nodes' SWA slots given
back, requests finishing mid-chain and handing their KV to the radix cache. The model's forward
and the one awaited result of the launched step are the worker's (the GPU test covers them).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import tide
import torch
from tide.memory.radix_cache import RadixCache
from tide.memory.swa import SWATokenToKVPoolAllocator
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.scheduler.worker import SampleFuture

from conftest import random_prompts
from test_swa_models import WINDOW, build_swa_checkpoint


def _is_mask(index: object) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncGuard:
    """Counts calls that synchronize with a CUDA device (wherever the tensor lives) made while
    `armed`; `paused()` lifts the count for code that may sync (the model's forward)."""

    _METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "masked_select",
                "__bool__", "__int__", "__float__", "__index__")
    _FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere", "unique_consecutive")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.calls: list[str] = []
        for name in self._METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in self._FUNCTIONS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        get, put = torch.Tensor.__getitem__, torch.Tensor.__setitem__
        monkeypatch.setattr(torch.Tensor, "__getitem__", self._wrap(
            get, "boolean-mask index", lambda args: _is_mask(args[1])))
        monkeypatch.setattr(torch.Tensor, "__setitem__", self._wrap(
            put, "boolean-mask assignment", lambda args: _is_mask(args[1])))

    def _wrap(self, real: Callable, name: str,
              applies: Callable[[tuple], bool] | None = None) -> Callable:
        guard = self

        def wrapper(*args, **kwargs):
            if guard.armed and (applies is None or applies(args)):
                guard.armed = False  # the stack formatting below may touch tensors
                try:
                    where = "".join(traceback.format_stack(limit=6)[:-1])
                    guard.calls.append(f"{name}\n{where}")
                finally:
                    guard.armed = True
            return real(*args, **kwargs)

        return wrapper

    @contextmanager
    def watching(self) -> Iterator[None]:
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def pausing(self, fn: Callable) -> Callable:
        """`fn`, run with the count lifted."""
        guard = self

        def run(*args, **kwargs):
            was, guard.armed = guard.armed, False
            try:
                return fn(*args, **kwargs)
            finally:
                guard.armed = was

        return run


def test_the_guard_sees_each_syncing_pattern(monkeypatch):
    """The guard itself: every pattern below waits for a CUDA device, and each is counted."""
    guard = SyncGuard(monkeypatch)
    t = torch.arange(6)
    patterns = [lambda: t[t > 2], lambda: t.nonzero(), lambda: torch.nonzero(t), lambda: t[0].item(),
                lambda: t.tolist(), lambda: torch.unique(t), lambda: bool(t[1]), lambda: int(t[1]),
                lambda: t.cpu()]

    def assign() -> None:
        t[t > 4] = 0

    for pattern in [*patterns, assign]:
        before = len(guard.calls)
        with guard.watching():
            pattern()
        assert len(guard.calls) == before + 1, guard.calls[before:]
    with guard.watching():  # indices known on the host or on the device: no sync
        _ = t[torch.tensor([1, 2])]
        _ = t[1:3]
        t[torch.tensor([0])] = 7
        _ = t.numel() + len(t)
    assert len(guard.calls) == len(patterns) + 1


@pytest.fixture(scope="module")
def swa_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("swa_nosync")
    return {a: build_swa_checkpoint(root / a, a) for a in ("gemma2", "gemma3")}


def _run(engine, warm: list[int], prompts: list[list[int]], max_new: list[int], overlap: bool,
         guard: SyncGuard | None) -> tuple[list[list[int]], int]:
    """From an empty cache, generate `warm` (its sequence stays cached), then step the requests
    to the end (all admitted at once), counting syncing calls on the steady overlapped decode
    steps when `guard` is given. Returns the tokens and the steps watched."""
    sched = engine.scheduler
    assert engine.flush_cache()
    engine.generate(input_ids=warm, sampling_params={"temperature": 0, "max_new_tokens": 2,
                                                     "ignore_eos": True})
    sched.overlap = overlap
    reqs = [Req(rid=f"r{i}", origin_input_ids=list(p), sampling_params=SamplingParams(
        temperature=0, max_new_tokens=n, ignore_eos=True)) for i, (p, n) in
        enumerate(zip(prompts, max_new))]
    for req in reqs:
        sched.add_request(req)
    watched = 0
    try:
        for _ in range(2000):
            if not sched.has_work():
                break
            # Steady: a step is on the device, nobody waits, and someone goes on past the tokens
            # in flight (the step launches the next one rather than ending the chain).
            steady = (guard is not None and sched.launched is not None and not sched.waiting
                      and any(len(r.output_ids) + 1 < r.sampling_params.max_new_tokens
                              for r in sched.running))
            ahead = sched.stats.num_overlapped_decode
            if steady:
                with guard.watching():
                    sched.step()
                assert sched.stats.num_overlapped_decode == ahead + 1
                watched += 1
            else:
                sched.step()
            sched.check_invariants()
            sched.allocator.check_consistency()  # slot by slot, on the device
        else:
            pytest.fail("no progress")
    finally:
        sched.overlap = False
    assert all(r.finished_reason["type"] == "length" for r in reqs)
    return [r.output_ids for r in reqs], watched


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_steady_overlapped_decode_of_a_hybrid_model_makes_no_syncing_call(arch, swa_ckpts,
                                                                        monkeypatch):
    """Prompts of 3..30 tokens generate 3 to 6 windows; one is a follow-up turn of a request that
    finished first (cached-prefix nodes whose SWA slots the decoding request gives back), and
    lengths differ so requests finish mid-chain. Same tokens as one step at a time, allocator
    consistent after every step, and no syncing call on any steady step."""
    engine = tide.Engine(str(swa_ckpts[arch]), max_total_tokens=1024, swa_full_tokens_ratio=0.5,
                         max_running_requests=16)
    try:
        sched = engine.scheduler
        assert sched.swa_window == WINDOW and isinstance(sched.allocator,
                                                         SWATokenToKVPoolAllocator)
        shared = random_prompts(7, [20])[0]
        turn = engine.generate(input_ids=shared, sampling_params={
            "temperature": 0, "max_new_tokens": 2, "ignore_eos": True})["output_ids"]
        others = random_prompts(8, [3, 9, 14, 30, 11])
        prompts = [shared + turn + [5, 6], *others]  # a follow-up turn: hits the cached sequence
        max_new = [6 * WINDOW, 3 * WINDOW + 5, 5 * WINDOW, 4 * WINDOW + 1, 6 * WINDOW - 3,
                   3 * WINDOW]
        base, _ = _run(engine, shared, prompts, max_new, overlap=False, guard=None)

        guard = SyncGuard(monkeypatch)
        worker = sched.worker
        monkeypatch.setattr(worker, "forward_launch", guard.pausing(worker.forward_launch))
        monkeypatch.setattr(worker, "forward", guard.pausing(worker.forward))
        monkeypatch.setattr(SampleFuture, "result", guard.pausing(SampleFuture.result))
        # What the watched steps must include, so that the check cannot pass vacuously.
        seen = {"free_swa": 0, "node_swa": 0, "finished": 0}

        def spy(key: str, real: Callable) -> Callable:
            def run(*args, **kwargs):
                seen[key] += guard.armed
                return real(*args, **kwargs)
            return run

        alloc = sched.allocator
        monkeypatch.setattr(alloc, "free_swa", spy("free_swa", alloc.free_swa))
        monkeypatch.setattr(RadixCache, "_free_node_swa", spy("node_swa",
                                                              RadixCache._free_node_swa))
        monkeypatch.setattr(RadixCache, "cache_finished_req", spy("finished",
                                                                  RadixCache.cache_finished_req))
        over, watched = _run(engine, shared, prompts, max_new, overlap=True, guard=guard)
    finally:
        engine.shutdown()
    assert over == base
    assert watched >= 4 * WINDOW
    assert seen["free_swa"] > 3 * WINDOW and seen["node_swa"] > 0 and seen["finished"] >= 4, seen
    assert not guard.calls, f"{len(guard.calls)} syncing call(s), the first:\n{guard.calls[0]}"


def test_consistency_check_catches_a_wrong_swa_freed_count():
    """Freeing trusts the caller's host-side count of slots whose SWA slot is gone; a wrong count
    (an SWA slot freed twice, or one never given back) is caught by `check_consistency`."""
    alloc = SWATokenToKVPoolAllocator(16, 8, "cpu")
    a = alloc.alloc(4)
    alloc.free_swa(a[:2])
    alloc.check_consistency()
    alloc.free(a, swa_freed=0)  # claims a[:2] still hold SWA slots: the dummy slot 0 is freed
    with pytest.raises(RuntimeError, match="swa free list holds a slot outside 1..8"):
        alloc.check_consistency()

    alloc = SWATokenToKVPoolAllocator(16, 8, "cpu")
    b = alloc.alloc(4)
    alloc.free_swa(b[:1])
    alloc.free(b, swa_freed=2)  # b[1]'s SWA slot is never given back (its full slot still maps)
    with pytest.raises(RuntimeError, match="a free full slot still maps to an SWA slot"):
        alloc.check_consistency()
    assert alloc.swa_available_size() == 7
