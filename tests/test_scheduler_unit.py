"""The scheduler against a fake worker (no model): admission, chunked prefill, retraction, failures,
stop strings, pause modes and weight-update queueing, each checked batch by batch.

`FakeWorker` keeps real KV pools (small, on CPU) and does what the worker contract says a worker does
— decode batches record their new KV slots in `req_to_token` — then emits scripted tokens. It checks
on every forward that the scheduler prepared the batch consistently (slots recorded, inputs matching
each request's tokens), so the tests see every batch exactly as a model would.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tide.config import EngineConfig
from tide.io_struct import WeightUpdateOptions
from tide.layers.sampler import SampleOutput
from tide.memory.ledger import MemoryLedger
from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.sampling_params import SamplingParams
from tide.scheduler.handover import HandoverResult, WeightUpdate
from tide.scheduler.request import Req
from tide.scheduler.schedule_batch import ScheduleBatch
from tide.scheduler.scheduler import Scheduler
from tide.scheduler.worker import ModelWorker

CONTEXT = 256
EOS = 1


@dataclass
class Seen:
    """One forward as the worker saw it."""

    decode: bool
    rids: list[str]
    extend_lens: list[int]
    sampled: list[str]


class FakeOccupation:
    """Memory occupation of a worker whose memory is never released."""

    weights_need_refill = False

    def is_released(self, tag: str) -> bool:
        return False

    def released_bytes(self) -> dict[str, int]:
        return {"kv_cache": 0, "weights": 0, "cuda_graph": 0}


class FakeWorker(ModelWorker):
    """Real pools, no model: a request emits `next_token(its output so far)` (default: 100 + its
    output length)."""

    def __init__(self, max_total_tokens: int = 512, max_running: int = 16, next_token=None) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_running, CONTEXT, "cpu")
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, "cpu")
        self.max_total_tokens = max_total_tokens
        self.context_len = CONTEXT
        self.next_token = next_token or (lambda out: 100 + len(out))
        self.seen: list[Seen] = []
        self.fail_next = False
        self.memory_occupation = FakeOccupation()  # type: ignore[assignment]
        self.weight_updater = None  # type: ignore[assignment]  # FakeUpdate writes nothing

    def forward(self, batch: ScheduleBatch) -> SampleOutput:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fell over")
        table = self.req_to_token_pool.req_to_token
        loc = batch.out_cache_loc
        assert loc is not None and loc.numel() == sum(batch.extend_lens) == len(batch.input_ids)
        offset = 0
        for i, req in enumerate(batch.reqs):
            n, start = batch.extend_lens[i], batch.prefix_lens[i]
            assert batch.req_pool_indices[i] == req.req_pool_idx
            assert batch.input_ids[offset : offset + n] == req.all_token_ids()[start : start + n]
            assert batch.positions[offset : offset + n] == list(range(start, start + n))
            if batch.is_decode:  # the worker records decode slots (inside the CUDA graph)
                table[req.req_pool_idx, start] = loc[offset]
            assert table[req.req_pool_idx, start : start + n].tolist() == loc[offset : offset + n].tolist()
            offset += n
        sampled = batch.sampled_reqs()
        self.seen.append(Seen(batch.is_decode, [r.rid for r in batch.reqs], list(batch.extend_lens),
                              [r.rid for r in sampled]))
        return SampleOutput([self.next_token(r.output_ids) for r in sampled], None, None)

    def device_info(self) -> dict[str, str]:
        return {"device": "cpu", "dtype": "float32"}


class CharTokenizer:
    """Token t decodes to one letter; counts how many tokens it has decoded in all."""

    def __init__(self) -> None:
        self.decoded_tokens = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded_tokens += len(ids)
        return "".join(chr(ord("a") + t % 26) for t in ids)


def make_scheduler(worker: FakeWorker | None = None, tokenizer=None, **config) -> Scheduler:
    config.setdefault("max_running_requests", 16)
    return Scheduler(EngineConfig(**config), worker or FakeWorker(), (EOS,), tokenizer,
                     MemoryLedger())


def make_req(rid: str, prompt_len: int, max_new: int = 4, first_token: int = 2, **params) -> Req:
    """Prompts of the same length are the same tokens unless `first_token` differs."""
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0)
    sp = SamplingParams(max_new_tokens=max_new, **params)
    return Req(rid=rid, origin_input_ids=[first_token + (i % 50) for i in range(prompt_len)],
               sampling_params=sp)


def run(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        sched.step()
        sched.check_invariants()
    pytest.fail("the scheduler made no progress")


# ---------------------------------------------------------------- admission
def test_prefill_first_then_decode_over_every_running_request():
    sched = make_scheduler()
    reqs = [make_req("a", 5), make_req("b", 9, max_new=2)]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    seen = sched.worker.seen
    assert seen[0] == Seen(False, ["a", "b"], [5, 9], ["a", "b"])  # one prefill batch, both sampled
    assert seen[1] == Seen(True, ["a", "b"], [1, 1], ["a", "b"])
    assert [s.rids for s in seen[2:]] == [["a"], ["a"]]  # b finished after 2 tokens
    assert [r.output_ids for r in reqs] == [[100, 101, 102, 103], [100, 101]]
    assert [r.finished_reason for r in reqs] == [{"type": "length", "length": 4},
                                                 {"type": "length", "length": 2}]
    assert sched.allocator.available_size() + sched.tree_cache.evictable_size() == 512


def test_admission_caps_running_requests_and_queues_the_rest():
    sched = make_scheduler(max_running_requests=2)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 4, max_new=3))
    sched.step()
    assert sched.worker.seen[0].rids == ["r0", "r1"] and sched.num_queued() == 3
    run(sched)
    assert max(len(s.rids) for s in sched.worker.seen) == 2


def test_admission_waits_for_kv_room():
    # 40 slots: the first request (16 prompt + 16 to come, at ratio 0.7) leaves too little for another.
    sched = make_scheduler(FakeWorker(max_total_tokens=40))
    sched.add_request(make_req("big", 16, max_new=16))
    sched.add_request(make_req("next", 16, max_new=16, first_token=60))  # nothing to share
    sched.step()
    assert sched.worker.seen[0].rids == ["big"] and sched.num_queued() == 1
    run(sched)
    assert [s.rids for s in sched.worker.seen if not s.decode] == [["big"], ["next"]]


# ---------------------------------------------------------------- chunked prefill
def test_long_prompt_is_prefilled_in_chunks_and_sampled_once():
    sched = make_scheduler(chunked_prefill_size=8)
    req = make_req("long", 20, max_new=2)
    sched.add_request(req)
    sched.step()
    assert sched.chunked_req is req and req.kv_len == 8 and req.output_ids == []
    run(sched)
    extends = [s for s in sched.worker.seen if not s.decode]
    assert [s.extend_lens for s in extends] == [[8], [8], [4]]
    assert [s.sampled for s in extends] == [[], [], ["long"]]  # no token until the prompt is in
    assert req.output_ids == [100, 101]


def test_a_chunk_ends_the_batch_and_goes_first_next_step():
    sched = make_scheduler(chunked_prefill_size=8)
    sched.add_request(make_req("short", 3))
    sched.add_request(make_req("long", 12))
    sched.add_request(make_req("later", 2))
    sched.step()
    sched.step()
    first, second = sched.worker.seen[:2]
    assert first.rids == ["short", "long"] and first.extend_lens == [3, 5]
    assert second.rids == ["long", "later"] and second.extend_lens == [7, 1]
    run(sched)


# ---------------------------------------------------------------- retraction
def test_out_of_kv_retracts_the_newest_request_and_it_recomputes():
    # 32 slots hold both prompts but not both outputs: someone must give KV back mid-decode.
    sched = make_scheduler(FakeWorker(max_total_tokens=32), disable_radix_cache=True)
    reqs = [make_req("old", 8, max_new=12), make_req("new", 8, max_new=12)]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    assert sched.stats.num_retractions >= 1 and reqs[1].num_retractions >= 1
    assert reqs[0].num_retractions == 0  # the newest goes first
    assert [r.output_ids for r in reqs] == [[100 + i for i in range(12)]] * 2  # outputs kept
    # The retracted request came back as one extend over its prompt and its output so far.
    assert sched.worker.seen[0].rids == ["old", "new"]
    back = [s for s in sched.worker.seen[1:] if not s.decode]
    assert back and all(s.rids == ["new"] and s.extend_lens[0] > 8 for s in back)


# ---------------------------------------------------------------- failures
def test_a_failing_forward_aborts_its_batch_and_frees_its_kv():
    sched = make_scheduler()
    a, b = make_req("a", 6, max_new=8), make_req("b", 6, max_new=8)
    sched.add_request(a)
    sched.step()
    sched.add_request(b)
    sched.worker.fail_next = True
    failed = sched.step()  # b's prefill fails; a, running, is untouched
    assert failed == [b] and b.finished_reason["type"] == "abort"
    assert "device fell over" in b.finished_reason["message"]
    sched.check_invariants()
    run(sched)
    assert a.finished_reason == {"type": "length", "length": 8}


# ---------------------------------------------------------------- stop conditions
def test_stop_string_is_found_incrementally():
    """Each step decodes only the new token with a little context: the decoding work grows linearly
    with the output, not quadratically (the whole output is never decoded again)."""
    tok = CharTokenizer()
    # Token 100 + k decodes to letter (100 + k) % 26: 'w', 'x', 'y', 'z', 'a', 'b', ...
    sched = make_scheduler(tokenizer=tok)
    req = make_req("s", 3, max_new=200, stop=["zab"])
    long_req = make_req("n", 3, max_new=200, stop=["never"])
    sched.add_request(req)
    sched.add_request(long_req)
    run(sched)
    assert req.finished_reason == {"type": "stop", "matched": "zab"}
    assert len(req.output_ids) == 6  # w x y z a b: the token that completes the stop string
    assert long_req.finished_reason == {"type": "length", "length": 200}
    assert tok.decoded_tokens < 20 * 206, f"decoded {tok.decoded_tokens} tokens for 206 outputs"


def test_eos_and_stop_token_ids():
    sched = make_scheduler(FakeWorker(next_token=lambda out: EOS if len(out) == 2 else 7))
    eos = make_req("eos", 3, max_new=10, ignore_eos=False)
    ignored = make_req("ignored", 3, max_new=4)
    stop_id = make_req("stop-id", 3, max_new=10, stop_token_ids=[7])
    for r in (eos, ignored, stop_id):
        sched.add_request(r)
    run(sched)
    assert eos.finished_reason == {"type": "stop", "matched": EOS} and eos.output_ids == [7, 7, EOS]
    assert ignored.finished_reason["type"] == "length" and ignored.output_ids == [7, 7, EOS, 7]
    assert stop_id.finished_reason == {"type": "stop", "matched": 7} and stop_id.output_ids == [7]



# ---------------------------------------------------------------- pause modes
def _decoding(sched: Scheduler, *reqs: Req, steps: int = 2) -> None:
    for r in reqs:
        sched.add_request(r)
    for _ in range(steps):
        sched.step()
    assert all(len(r.output_ids) == steps for r in reqs) and sched.num_running() == len(reqs)


def test_pause_abort_finishes_everything_with_partial_output():
    sched = make_scheduler()
    a, b, queued = make_req("a", 4, max_new=9), make_req("b", 6, max_new=9), make_req("q", 3)
    _decoding(sched, a, b)
    sched.add_request(queued)
    result = sched.handover.pause_generation("abort")
    assert result == HandoverResult(True, "paused (abort); 3 request(s) affected", 3)
    for r in (a, b, queued):
        assert r.finished_reason == {"type": "abort", "message": "paused with mode=abort"}
    assert a.output_ids == [100, 101] and queued.output_ids == []
    assert not sched.has_work() and sched.tree_cache.protected_size() == 0
    sched.check_invariants()


def test_pause_retract_frees_kv_and_recomputes_on_continue():
    sched = make_scheduler(disable_radix_cache=True)
    a, b = make_req("a", 4, max_new=6), make_req("b", 6, max_new=6)
    _decoding(sched, a, b)
    assert sched.handover.pause_generation("retract").num_paused_requests == 2
    assert sched.num_running() == 0 and [r.rid for r in sched.waiting] == ["a", "b"]
    assert sched.allocator.available_size() == sched.max_total_tokens  # every slot given back
    assert sched.step() == [] and sched.is_blocked()
    sched.handover.continue_generation(torch_empty_cache=False)
    seen = len(sched.worker.seen)
    run(sched)
    redo = sched.worker.seen[seen]
    assert not redo.decode and redo.extend_lens == [4 + 2, 6 + 2]  # prompt + output so far
    assert [r.output_ids for r in (a, b)] == [[100 + i for i in range(6)]] * 2


def test_pause_in_place_keeps_kv_and_resumes_decoding():
    sched = make_scheduler()
    a = make_req("a", 5, max_new=6)
    _decoding(sched, a)
    free = sched.allocator.available_size()
    sched.handover.pause_generation("in_place")
    late = make_req("late", 3, max_new=2, first_token=60)
    sched.add_request(late)  # queues while paused
    assert sched.step() == [] and sched.allocator.available_size() == free
    assert a.kv_len == 6 and a.req_pool_idx is not None
    sched.handover.continue_generation(torch_empty_cache=False)
    sched.step()
    assert sched.worker.seen[-1] == Seen(False, ["late"], [3], ["late"])  # no re-prefill of a
    run(sched)
    assert a.output_ids == [100 + i for i in range(6)] and a.num_retractions == 0


def test_unknown_pause_mode_changes_nothing():
    sched = make_scheduler()
    result = sched.handover.pause_generation("sleep")
    assert not result.success and "mode" in result.message and sched.handover.paused is None


# ---------------------------------------------------------------- weight-update queueing
@dataclass(frozen=True)
class FakeUpdate(WeightUpdate):
    """Records when it is applied; `bad` fails validation."""

    log: list
    name: str
    bad: bool = False
    source = "fake"

    def prepare(self, updater):
        if self.bad:
            raise ValueError(f"{self.name}: weight 'x' has the wrong shape")
        return lambda: self.log.append(("apply", self.name)) or 3


def _submit(sched: Scheduler, log: list, name: str, **options) -> list[HandoverResult]:
    results: list[HandoverResult] = []
    sched.handover.submit_update(FakeUpdate(log, name, options.pop("bad", False)),
                                 WeightUpdateOptions(**options), results.append)
    return results


def test_an_update_waits_for_running_requests_and_blocks_admission():
    sched = make_scheduler()
    log: list = []
    running = make_req("running", 4, max_new=5)
    _decoding(sched, running)
    results = _submit(sched, log, "u1", weight_version="v1")
    late = make_req("late", 3, max_new=2)
    sched.add_request(late)
    assert sched.handover.admission_blocked and not sched.handover.update_ready()
    while sched.num_running():
        assert sched.handover.apply_ready_updates() == 0
        sched.step()  # the running request drains; the late one is not admitted
        assert late.req_pool_idx is None
    assert running.finished_reason["type"] == "length" and running.weight_version == "default"
    assert sched.handover.apply_ready_updates() == 1
    assert log == [("apply", "u1")] and results[0].success and "updated 3 tensors" in results[0].message
    assert sched.handover.weight_version == "v1" and not sched.handover.admission_blocked
    run(sched)
    assert late.finished_reason["type"] == "length" and late.weight_version == "v1"


def test_updates_apply_in_arrival_order_and_a_bad_one_changes_nothing():
    sched = make_scheduler()
    log: list = []
    running = make_req("running", 4, max_new=4)
    _decoding(sched, running)
    bad = _submit(sched, log, "bad", bad=True, abort_all_requests=True)
    assert bad == [HandoverResult(False, "bad: weight 'x' has the wrong shape", 0)]
    assert not running.finished and not sched.handover.pending_updates  # nothing aborted or queued
    first, second = _submit(sched, log, "u1"), _submit(sched, log, "u2", weight_version="v2")
    run(sched)
    assert sched.handover.apply_ready_updates() == 2
    assert log == [("apply", "u1"), ("apply", "u2")] and first[0].success and second[0].success
    assert sched.handover.weight_version == "v2"


def test_abort_all_requests_frees_the_way_at_once():
    sched = make_scheduler()
    log: list = []
    a = make_req("a", 4, max_new=8)
    _decoding(sched, a)
    results = _submit(sched, log, "u", abort_all_requests=True)
    assert a.finished_reason == {"type": "abort", "message": "aborted by weight update"}
    assert sched.handover.apply_ready_updates() == 1 and results[0].success
    sched.check_invariants()


def test_paused_in_place_an_update_goes_at_once_and_held_kv_is_never_matched_again():
    sched = make_scheduler()
    log: list = []
    a = make_req("a", 8, max_new=6)
    _decoding(sched, a)
    sched.handover.pause_generation("in_place")
    results = _submit(sched, log, "u", weight_version="v1")
    assert sched.handover.apply_ready_updates() == 1 and results[0].num_paused_requests == 1
    assert sched.kv_epoch == 1 and a.kv_epoch == 0  # a's KV predates the new weights
    sched.handover.continue_generation(torch_empty_cache=False)
    run(sched)
    assert a.finished_reason["type"] == "length" and a.weight_version == "v1"
    assert sched.tree_cache.total_size() == 0  # its stale KV was freed, not cached
    sched.check_invariants()


def test_an_update_that_refills_blocked_memory_goes_at_once():
    """While memory is blocked (weights released or awaiting a refill) nothing steps, so requests
    that hold KV can never drain: the update that unblocks must not wait for them."""
    sched = make_scheduler()
    log: list = []
    a = make_req("a", 4, max_new=6)
    _decoding(sched, a)
    sched.handover.memory_block_reason = "weights await a refill"
    results = _submit(sched, log, "refill")
    assert sched.step() == [] and sched.handover.update_ready()
    assert sched.handover.apply_ready_updates() == 1 and results[0].success
    assert a.kv_epoch == 0 and sched.kv_epoch == 1  # a keeps its KV, never matched again
