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
from tide.layers.sampler import SampleOutput
from tide.memory.ledger import MemoryLedger
from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.sampling_params import SamplingParams
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


class FakeWorker(ModelWorker):
    """Real pools, no model: request `r` emits `next_token(r)` (default: 100 + its output length)."""

    def __init__(self, max_total_tokens: int = 512, max_running: int = 16, next_token=None) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_running, CONTEXT, "cpu")
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, "cpu")
        self.max_total_tokens = max_total_tokens
        self.context_len = CONTEXT
        self.next_token = next_token or (lambda out: 100 + len(out))
        self.seen: list[Seen] = []
        self.fail_next = False

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


def make_req(rid: str, prompt_len: int, max_new: int = 4, **params) -> Req:
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0)
    sp = SamplingParams(max_new_tokens=max_new, **params)
    return Req(rid=rid, origin_input_ids=[2 + (i % 50) for i in range(prompt_len)], sampling_params=sp)


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
    sched.add_request(make_req("next", 16, max_new=16))
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

