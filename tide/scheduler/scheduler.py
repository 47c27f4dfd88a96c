"""The scheduling loop: admit requests, run prefill/extend or decode, finish or retract.

One `step()` runs at most one forward:

    batch = schedule()                  # a prefill batch if requests can be admitted, else decode
    prepare(batch)                      # KV slots, request table, model inputs
    out = worker.forward(batch)         # the model and the sampler (never called from here)
    process_results(batch, out)         # tokens, stop checks, finished requests give KV back

The scheduler owns requests and KV accounting; its `handover` owns pause, weight updates, versions
and memory release, and the scheduler only reads that state (`may_step`, `admission_blocked`).

KV accounting: a request is admitted when its new prompt tokens plus an estimate of its future decode
tokens (`remaining * new_token_ratio`) fit in free + evictable slots. The estimate is optimistic; when a
decode step finds no free slot, the newest requests are retracted (their KV goes to the radix cache or
back to the allocator, and they re-queue with their output so far) and the ratio rises again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any

import torch

from tide.config import EngineConfig
from tide.detokenizer import IncrementalDetokenizer
from tide.executor.forward_batch import ForwardMode
from tide.grammar import (
    COMPILE_TIMEOUT_S,
    MAX_ACCEPT_S,
    SLOW_ACCEPTS,
    GrammarBackend,
    grammar_of,
)
from tide.grammar import available as grammar_available
from tide.layers.sampler import PromptScoring, SampleOutput
from tide.memory.ledger import MemoryLedger
from tide.memory.radix_cache import RadixCache
from tide.memory.swa import SWATokenToKVPoolAllocator, swa_page
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.scheduler.handover import Handover
from tide.scheduler.profile import ProfileOptions
from tide.scheduler.request import FinishReason, Req
from tide.scheduler.schedule_batch import ScheduleBatch, sampling_info
from tide.scheduler.worker import ModelWorker, SampleFuture, TpModelWorker
from tide.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096
GRAMMAR_POLL_S = 0.005  # how long an otherwise idle step waits for a grammar to compile
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# A waiting prompt that shares at least this many more tokens with a prompt admitted in the same
# prefill batch than it finds in the cache waits one step and then reads them from the cache (GRPO:
# n samples of one prompt are prefilled once, not n times).
IN_BATCH_PREFIX_MIN = 32


@dataclass(slots=True, eq=False)
class LaunchedBatch:
    """A decode batch queued on the device whose tokens are not applied yet (overlap schedule).
    Its requests' `kv_len` already counts the step's token (its KV slot is recorded in req_to_token
    by the forward), so the KV accounting holds while it runs."""

    batch: ScheduleBatch
    future: SampleFuture


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0  # prompt tokens actually computed (cache hits excluded)
    num_cached_tokens: int = 0  # prompt tokens served from the radix cache
    num_generated_tokens: int = 0
    num_retractions: int = 0
    num_forward_extend: int = 0
    num_forward_decode: int = 0
    num_overlapped_decode: int = 0  # decode steps launched before the previous step's tokens landed
    num_mixed_decode: int = 0  # decode tokens that rode along with a prefill batch
    num_prefix_deferrals: int = 0  # prompts held back a step to reuse a prefix prefilled beside them


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        worker: ModelWorker,
        eos_token_ids: tuple[int, ...],
        tokenizer: Tokenizer | None,
        ledger: MemoryLedger,
        model_config: ModelConfig | None = None,
        weight_version: str = "default",
    ) -> None:
        """`tokenizer` (None: the model has none) decodes outputs to find stop strings; `ledger`
        records this engine's release points; `model_config` (None in unit tests) is reported by
        `server_info`."""
        self.config = config
        self.model_config = model_config
        self.ledger = ledger
        self.worker = worker
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.req_to_token_pool = worker.req_to_token_pool
        self.allocator = worker.token_to_kv_pool_allocator
        # Two-pool KV cache (hybrid sliding-window model): the window the SWA pool serves.
        self.swa_window: int | None = None
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            if model_config is None or model_config.sliding_window is None:
                raise ValueError("a two-pool KV cache needs the model's sliding window")
            self.swa_window = model_config.sliding_window
        self.tree_cache = self._new_tree()
        self.waiting: deque[Req] = deque()
        # Requests whose grammar is compiling (sglang's name); they join `waiting` when it is done.
        self.grammar_queue: list[Req] = []
        self._grammar_backend: GrammarBackend | None = None
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        # KV slots allocated for the forward in progress, not yet owned by a request's kv_len.
        self._inflight_loc: torch.Tensor | None = None
        self.retired_trees: list[RadixCache] = []  # trees whose KV predates a weight update
        # Bumped by every flush after a weight update: KV of an older epoch is never cached.
        self.kv_epoch = 0
        # Overlap schedule (docs/scheduler.md): decode step N+1 is prepared and launched before the
        # tokens of step N are applied. Only where the worker runs asynchronously (CUDA).
        self.overlap = not config.disable_overlap_schedule and worker.supports_overlap
        self._launched: LaunchedBatch | None = None
        # Requests that got a token while a launched batch was applied outside `step()` (an abort,
        # pause or update settles it first); the next `step()` returns them.
        self._ready: list[Req] = []
        self.handover = Handover(self, worker, ledger, config.enable_memory_saver, weight_version)
        # Forwards left before a running profile stops by itself (None: none, or at stop_profile).
        self._profile_steps_left: int | None = None

    def kv_pools_summary(self) -> str:
        """One log line's worth of `kv_pools()`: per pool used/capacity and evictable."""
        return ", ".join(f"{name} pool {p['used']}/{p['capacity']} used, {p['evictable']} evictable"
                         for name, p in self.kv_pools().items())

    def _new_tree(self) -> RadixCache:
        return RadixCache(self.req_to_token_pool, self.allocator,
                          disable=self.config.disable_radix_cache, window=self.swa_window)

    # ---- public surface
    @property
    def max_total_tokens(self) -> int:
        return self.worker.max_total_tokens

    @property
    def swa_page(self) -> int:
        """Two-pool cache: out-of-window SWA slots are given back in runs of this many tokens, so
        a request holds at most window + swa_page of them (0 for one pool)."""
        return 0 if self.swa_window is None else swa_page(self.swa_window)

    def kv_pools(self) -> dict[str, dict[str, int]]:
        """Capacity, free, used (held or cached), cached and evictable slots of each KV pool:
        `full`, and `swa` for a two-pool cache."""
        tree = self.tree_cache
        retired = self.retired_trees
        alloc = self.allocator
        if isinstance(alloc, SWATokenToKVPoolAllocator):
            full_free = alloc.full_available_size()
        else:
            full_free = alloc.available_size()
        total = self.max_total_tokens
        pools = {"full": {
            "capacity": total, "free": full_free, "used": total - full_free,
            "cached": tree.total_size() + sum(t.total_size() for t in retired),
            "evictable": tree.evictable_size()}}
        if isinstance(alloc, SWATokenToKVPoolAllocator):
            swa_free = alloc.swa_available_size()
            pools["swa"] = {
                "capacity": alloc.size_swa, "free": swa_free, "used": alloc.size_swa - swa_free,
                "cached": tree.swa_total_size() + sum(t.swa_total_size() for t in retired),
                "evictable": tree.swa_evictable_size()}
        return pools

    def server_info(self) -> dict[str, Any]:
        """The model, its limits and where it runs."""
        info: dict[str, Any] = {
            "model_path": self.config.model_path,
            "max_total_tokens": self.max_total_tokens,
            "context_length": self.worker.context_len,
            **self.worker.device_info(),
        }
        info["kv_cache_layout"] = self.worker.kv_layout()
        # "none" where constrained decoding cannot run (off, or no xgrammar installed)
        info["grammar_backend"] = (self.config.grammar_backend if grammar_available()
                                   else "none")
        if self.model_config is not None:
            info.update(architecture=self.model_config.architecture,
                        vocab_size=self.model_config.vocab_size)
        return info

    def add_request(self, req: Req) -> None:
        """Queue `req` (finished at once if memory is released or it asks for no tokens)."""
        blocked = self.handover.memory_block_reason
        if blocked is not None:
            req.finished_reason = {"type": "abort", "message": blocked}
            req.weight_version = self.handover.weight_version  # as every finished request
            return
        params = req.sampling_params
        if params.max_new_tokens == 0 and not req.wants_input_logprobs:
            req.finished_reason = {"type": "length", "length": 0}
            req.weight_version = self.handover.weight_version
            return
        if params.stop_strs and self.tokenizer is not None and req.stop_detokenizer is None:
            req.stop_detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.origin_input_ids, params.skip_special_tokens, params.stop_strs,
                min_new_tokens=params.min_new_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
        if params.min_new_tokens > 0:
            ending = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                ending |= self.eos_token_ids
            if self.model_config is not None:  # a config's eos id past the vocabulary is no token
                ending = {t for t in ending if t < self.model_config.vocab_size}
            if self.model_config is not None and len(ending) >= self.model_config.vocab_size:
                req.finished_reason = {
                    "type": "abort", "message": "min_new_tokens: every token of the vocabulary "
                    "would end the request (eos and stop_token_ids), so none could be sampled"}
                req.weight_version = self.handover.weight_version
                return
            req.ending_ids = tuple(sorted(ending))
        spec = grammar_of(params)
        if spec is not None:
            try:
                req.grammar_future = self._grammar_compiler().compile(*spec)
                req.grammar_deadline = time.monotonic() + COMPILE_TIMEOUT_S
            except ValueError as e:
                req.finished_reason = {"type": "abort", "message": str(e)}
                req.weight_version = self.handover.weight_version
                return
            self.grammar_queue.append(req)
            return
        self.waiting.append(req)

    def _grammar_compiler(self) -> GrammarBackend:
        """The grammar backend, made at the first constrained request (ValueError when this
        engine cannot constrain: no tokenizer, `grammar_backend` none, or no xgrammar)."""
        if self._grammar_backend is not None:
            return self._grammar_backend
        if self.config.grammar_backend == "none":
            raise ValueError("constrained decoding is off (grammar_backend is none)")
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer "
                             "(the engine runs with skip_tokenizer_init)")
        vocab = (self.model_config.vocab_size if self.model_config is not None
                 else len(self.tokenizer))  # type: ignore[arg-type]
        self._grammar_backend = GrammarBackend(self.tokenizer, vocab, sorted(self.eos_token_ids))
        return self._grammar_backend

    def grammar_cache_bytes(self) -> int:
        """Host bytes of compiled grammars the grammar cache holds (0 before the first)."""
        return 0 if self._grammar_backend is None else self._grammar_backend.cached_bytes

    def shutdown_grammar(self) -> None:
        """Stop the grammar compiler's thread (compiles not yet started are dropped)."""
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown()

    def _drop_compiles(self, gone: list[Req]) -> None:
        """Compiles that no queued request waits for any more are not started (a client that
        sends grammars and goes away leaves no work behind); one already running finishes and is
        cached."""
        waited = {id(r.grammar_future) for r in self.grammar_queue}
        for req in gone:
            if req.grammar_future is not None and id(req.grammar_future) not in waited:
                self._grammar_compiler().drop(req.grammar_future)
            req.grammar_future = None

    def _poll_grammars(self) -> list[Req]:
        """Requests whose grammar has compiled join `waiting` with their matcher; those whose
        grammar failed finish with an abort saying why (returned). With nothing else to do, waits
        a little for a compile rather than spin."""
        if not self.grammar_queue:
            return []
        if not (self.waiting or self.running or self.chunked_req or self._launched):
            pending = [r.grammar_future for r in self.grammar_queue if r.grammar_future is not None]
            wait(pending, timeout=GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)
        failed: list[Req] = []
        still: list[Req] = []
        now = time.monotonic()
        for req in self.grammar_queue:
            future = req.grammar_future
            if future is not None and not future.done() and now > req.grammar_deadline:
                field = (grammar_of(req.sampling_params) or ("grammar",))[0]
                req.finished_reason = {"type": "abort", "message": f"{field} did not compile "
                                       f"within {COMPILE_TIMEOUT_S:g} s"}
                req.weight_version = self.handover.weight_version
                failed.append(req)
                continue
            if future is None or not future.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = self._grammar_compiler().matcher(future.result())
                if not req.grammar.allows_any():  # the sampler would draw from all -inf
                    field = (grammar_of(req.sampling_params) or ("grammar",))[0]
                    raise ValueError(f"{field} matches no text: no output can follow it")
            except Exception as e:  # noqa: BLE001 - a failed compile ends this request only
                req.grammar = None
                req.finished_reason = {"type": "abort", "message": str(e) or type(e).__name__}
                req.weight_version = self.handover.weight_version
                failed.append(req)
                continue
            self.waiting.append(req)
        self.grammar_queue = still
        self._drop_compiles([r for r in failed if r.grammar_future is not None])
        return failed

    @property
    def launched(self) -> LaunchedBatch | None:
        """The decode step still on the device whose tokens are not applied (overlap schedule)."""
        return self._launched

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._launched
                    or self.grammar_queue)

    def num_queued(self) -> int:
        return len(self.waiting) + len(self.grammar_queue)

    def num_running(self) -> int:
        """Requests holding KV: running, or a prompt mid-chunk."""
        return len(self.running) + (1 if self.chunked_req else 0)

    def is_blocked(self) -> bool:
        """No step can run now: paused, memory released, or a weight update waits and no request
        holds KV (nothing may be admitted; a held request would drain)."""
        handover = self.handover
        if not handover.may_step():
            return True
        return handover.admission_blocked and self.num_running() == 0

    def can_step(self) -> bool:
        """A step would make progress (or has tokens to hand out)."""
        if self._ready or self._launched is not None:
            return True
        return self.has_work() and not self.is_blocked()

    def step(self) -> list[Req]:
        """Run one forward; return the requests that got a token in it (finished ones included).
        Does nothing while paused or while memory is released.

        If the forward raises, the requests of that batch finish with an abort that carries the
        error, their KV is released, and the scheduler stays usable. A request whose own sampling
        fails is aborted alone (see `TpModelWorker.sample`); the rest go on.
        """
        got, self._ready = self._ready, []
        got = _merge(got, self._poll_grammars())
        if not self.handover.may_step():
            return got  # a pause or a release settled any launched batch first
        if self._launched is not None:
            launched = self._step_overlapped()
            if launched is not None:
                return _merge(got, launched)
            got = _merge(got, self.finish_launched())  # the chain ends: back to one step at a time
        batch = self.schedule()
        if batch is None:
            return got
        if self.overlap and batch.is_decode and _may_overlap(batch.reqs):
            return _merge(got, self._launch(batch))
        try:
            self.prepare(batch)
            out = self.worker.forward(batch)
            self._profile_tick()
            return _merge(got, self.process_results(batch, out))
        except Exception as e:  # any failure must not leak KV or wedge the loop
            logger.exception("forward failed; aborting %d request(s)", len(batch.reqs))
            return _merge(got, self._fail(batch.reqs, f"internal error: {type(e).__name__}: {e}"))

    # ---- the overlap schedule
    def finish_launched(self) -> list[Req]:
        """Apply the tokens of the batch still on the device (waiting for it), leaving the scheduler
        exactly as the one-step-at-a-time schedule would after that step; returns the requests that
        got a token. Everything that changes requests or KV from outside `step()` calls
        `settle()`, which does this first."""
        launched, self._launched = self._launched, None
        if launched is None:
            return []
        return self._apply_launched(launched, None)

    def settle(self) -> None:
        """`finish_launched()`, keeping the requests that got a token for the next `step()`."""
        if self._launched is not None:
            self._ready = _merge(self._ready, self.finish_launched())

    def _launch(self, batch: ScheduleBatch) -> list[Req]:
        """Prepare and launch the first decode step of a chain; its tokens are applied next step."""
        try:
            self.prepare(batch)
            future = self.worker.forward_launch(batch)
        except Exception as e:  # as in step()
            logger.exception("forward failed; aborting %d request(s)", len(batch.reqs))
            return self._fail(batch.reqs, f"internal error: {type(e).__name__}: {e}")
        self._commit_launch(batch, future)
        if self.swa_window is not None:  # as process_results after the step (see _apply_launched)
            for req in batch.reqs:
                self._release_swa(req)
        return []

    def _commit_launch(self, batch: ScheduleBatch, future: SampleFuture) -> None:
        self._inflight_loc = None  # each new slot now belongs to its request
        for req in batch.reqs:
            req.kv_len += 1
        self._launched = LaunchedBatch(batch, future)
        self._profile_tick()

    # ---- profiling (sglang's start_profile / stop_profile; tide/scheduler/profile.py)
    def start_profile(self, options: ProfileOptions) -> None:
        """Profile the forwards of every rank from now on, until `stop_profile` or, with
        `options.num_steps`, until that many forwards have launched."""
        self.worker.start_profile(options)
        self._profile_steps_left = options.num_steps

    def stop_profile(self) -> list[str]:
        """Stop the running profile; the files every rank wrote."""
        self._profile_steps_left = None
        return self.worker.stop_profile()

    def _profile_tick(self) -> None:
        if self._profile_steps_left is None:
            return
        self._profile_steps_left -= 1
        if self._profile_steps_left == 0:
            try:  # a profile that cannot be written must not fail the batch
                paths = self.stop_profile()
            except Exception as e:  # noqa: BLE001 - logged; serving goes on
                logger.error("stopping the profile failed: %s: %s", type(e).__name__, e)
            else:
                logger.info("profile stopped after its forwards: %s", ", ".join(paths))

    def _step_overlapped(self) -> list[Req] | None:
        """Launch decode step N+1 on the tokens step N leaves on the device, then apply step N's
        tokens. None (nothing done) where step N+1 would not be the decode step the
        one-step-at-a-time schedule runs next: a prompt is mid-chunk, requests wait for admission
        while it may succeed, a request needs its tokens on the host (penalties), or KV is short
        (retraction decides)."""
        prev = self._launched
        assert prev is not None
        if not prev.batch.is_decode or self.chunked_req is not None:
            return None
        context_len = self.worker.context_len
        # Requests whose pending token surely ends them (length) are left out of step N+1; one that
        # stops on EOS or a stop string rides along and its token is dropped.
        reqs = [r for r in self.running
                if len(r.output_ids) + 1 < r.sampling_params.max_new_tokens
                and r.seq_len + 1 < context_len]
        if not reqs or not _may_overlap(reqs):
            return None
        # Waiting requests are only passed over while max_running_requests run and none is known to
        # end with step N (one that stops on EOS there lets the next be admitted a step later).
        if self.waiting and not (len(reqs) == len(self.running)
                                 and len(reqs) >= self.config.max_running_requests):
            return None
        rows = {id(r): i for i, r in enumerate(prev.batch.reqs)}
        if any(id(r) not in rows for r in reqs):
            return None
        if not self._decode_room(len(reqs)):
            return None
        batch = ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs))
        try:
            self._prepare_successor(batch, prev, [rows[id(r)] for r in reqs])
            future = self.worker.forward_launch(batch)
        except Exception as e:  # step N's tokens still count; step N+1's requests fail
            logger.exception("forward failed; aborting %d request(s)", len(reqs))
            if self._inflight_loc is not None:
                self.allocator.free(self._inflight_loc)
                self._inflight_loc = None
            got = self.finish_launched()
            failed = self._fail([r for r in reqs if not r.finished],
                                f"internal error: {type(e).__name__}: {e}")
            return _merge(got, failed)
        self._commit_launch(batch, future)
        self.stats.num_overlapped_decode += 1
        return self._apply_launched(prev, batch)

    def _prepare_successor(self, batch: ScheduleBatch, prev: LaunchedBatch, rows: list[int]) -> None:
        """`prepare()` for a decode step whose input tokens are row `rows[i]` of the launched
        step's output (on the device when the worker left them there)."""
        reqs = batch.reqs
        out_cache_loc = self._alloc_kv(len(reqs))
        self._inflight_loc = out_cache_loc
        batch.out_cache_loc = out_cache_loc
        batch.positions = [r.kv_len for r in reqs]  # kv_len already counts the pending token
        batch.req_pool_indices = [r.req_pool_idx for r in reqs]  # type: ignore[misc]
        batch.prefix_lens = batch.positions
        batch.sampling = sampling_info(reqs, output_offset=1)
        ids = prev.future.next_ids
        if ids is None:  # a worker that samples on the host
            host = prev.future.result().next_ids
            batch.input_ids = [host[i] for i in rows]
        elif rows == list(range(len(prev.batch.reqs))):
            batch.input_ids_device = ids
        else:
            index = torch.tensor(rows, dtype=torch.int64).to(ids.device, non_blocking=True)
            batch.input_ids_device = ids.index_select(0, index)

    def _apply_launched(self, launched: LaunchedBatch, successor: ScheduleBatch | None
                        ) -> list[Req]:
        """Apply a launched decode step's tokens (waits for them: the step's one host sync). A
        request that finished meanwhile (its previous token stopped it, or it was aborted) takes
        none. A request that finishes now while it rides in `successor` gives that step's KV slot
        back at once: its token will be dropped."""
        batch = launched.batch
        try:
            out = launched.future.result()
        except Exception as e:  # a device error surfaces here
            logger.exception("forward failed; aborting %d request(s)", len(batch.reqs))
            return self._fail([r for r in batch.reqs if not r.finished],
                              f"internal error: {type(e).__name__}: {e}")
        if all(r.finished for r in batch.reqs):
            return []  # every row was dropped: this step does not exist for the schedule
        self.stats.num_forward_decode += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        rides = {id(r): i for i, r in enumerate(successor.reqs)} if successor is not None else {}
        live = [i for i, r in enumerate(batch.reqs) if not r.finished]
        reqs = [batch.reqs[i] for i in live]

        def give_back_ride(req: Req) -> None:
            j = rides.get(id(req))
            if j is not None:
                assert successor is not None and successor.out_cache_loc is not None
                req.kv_len -= 1
                self.allocator.free(successor.out_cache_loc[j : j + 1])

        got = self._apply_tokens(reqs, out, live, newly_prefilled=False, on_finish=give_back_ride)
        if self.swa_window is not None and successor is not None:
            # The successor's tokens count in kv_len since its launch; its requests give back the
            # SWA slots out of their window now that they are known to go on, as process_results
            # does after a step (before the next step is prepared). A slot freed here may still be
            # read by the successor: the next forward that reuses it runs after it on the stream.
            for req in successor.reqs:
                if not req.finished:
                    self._release_swa(req)
        return got

    def _fail(self, reqs: list[Req], message: str) -> list[Req]:
        if self._inflight_loc is not None:
            self.allocator.free(self._inflight_loc)
            self._inflight_loc = None
        for req in reqs:
            if req in self.running:
                self.running.remove(req)
            if self.chunked_req is req:
                self.chunked_req = None
            if req.finished_reason is None or req.finished_reason.get("type") != "abort":
                req.finished_reason = {"type": "abort", "message": message}
            req.weight_version = self.handover.weight_version
            if req.req_pool_idx is not None:
                self._release_kv(req)
            elif req.last_node is not None:
                self._unmatch_prefix(req)
        return reqs

    def abort(self, rid: str | None = None, message: str = "aborted") -> list[Req]:
        """Finish the request `rid` (all requests if None) with finish_reason abort."""
        return self._abort_where(lambda req: rid is None or req.rid == rid, message)

    def abort_reqs(self, reqs: list[Req], message: str = "aborted") -> list[Req]:
        """Finish these very requests (not others that share their rids) with finish_reason
        abort, where they have not finished."""
        ids = set(map(id, reqs))
        return self._abort_where(lambda req: id(req) in ids, message)

    def _abort_where(self, chosen: Callable[[Req], bool], message: str) -> list[Req]:
        self.settle()
        aborted: list[Req] = [r for r in self.grammar_queue if chosen(r)]
        if aborted:
            self.grammar_queue = [r for r in self.grammar_queue if not chosen(r)]
            self._drop_compiles(aborted)
        for req in list(self.waiting):
            if chosen(req):
                self.waiting.remove(req)
                aborted.append(req)
        for req in list(self.running):
            if chosen(req):
                self.running.remove(req)
                aborted.append(req)
        if self.chunked_req is not None and chosen(self.chunked_req):
            aborted.append(self.chunked_req)
            self.chunked_req = None
        for req in aborted:
            req.finished_reason = {"type": "abort", "message": message}
            req.weight_version = self.handover.weight_version
            if req.req_pool_idx is not None:
                self._release_kv(req)
        if aborted and self._ready:  # reported once, with their whole output, by the caller
            gone = set(map(id, aborted))
            self._ready = [r for r in self._ready if id(r) not in gone]
        return aborted

    def flush_cache(self, empty_cache: bool = True) -> tuple[bool, str]:
        """Reset the radix cache, request slots and KV allocator; only when nothing is queued or
        running. Empties the device allocator cache only if `empty_cache`."""
        self.settle()
        if self.has_work():
            return False, (
                f"cannot flush cache: {self.num_queued()} queued and {self.num_running()} "
                "running requests"
            )
        self.reset_kv_state()
        if empty_cache:
            self.worker.empty_device_cache("flush_cache")
        self.ledger.mark("flush_cache", f"empty_cache={empty_cache}")
        return True, "cache flushed"

    def _release_kv(self, req: Req) -> None:
        """A finished, aborted or retracted request gives its KV to its tree (or frees it)."""
        tree = req.tree or self.tree_cache
        tree.cache_finished_req(req, insert=req.kv_epoch == self.kv_epoch)
        req.tree = None
        if tree.retired and tree.total_size() == 0 and tree in self.retired_trees:
            self.retired_trees.remove(tree)

    def reset_kv_state(self) -> None:
        """Reset radix cache, request slots and KV allocator (caller guarantees no request holds KV)."""
        self.retired_trees.clear()
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()

    # ---- what the handover asks of the requests and their KV
    def retract_all(self) -> int:
        """Every request holding KV gives it up and re-queues ahead of new arrivals, in admission
        order (recomputed when it runs again). Returns how many."""
        self.settle()
        held = list(self.running)
        if self.chunked_req is not None:
            held.append(self.chunked_req)
            self.chunked_req = None
        for req in reversed(held):
            if req in self.running:
                self.running.remove(req)
            self._release_kv(req)
            req.reset_for_retract()
            self.waiting.appendleft(req)
        self.stats.num_retractions += len(held)
        return len(held)

    def flush_cache_after_weight_update(self, flush_cache: bool, torch_empty_cache: bool) -> None:
        """After new weights: cached KV was computed with the old ones. With no request holding KV,
        reset every pool (queued requests hold none); paused in place, drop every cached prefix no
        held request uses and leave the held requests' KV alone."""
        self.settle()
        if flush_cache:
            self.kv_epoch += 1
            if self.num_running() == 0:
                self.reset_kv_state()
            else:
                # Held requests keep their (old-weight) KV; nothing new may match it.
                old = self.tree_cache
                old.evict(old.evictable_size())
                if old.total_size():
                    old.retired = True
                    self.retired_trees.append(old)
                    self.tree_cache = self._new_tree()
        if torch_empty_cache:
            self.worker.empty_device_cache("weight_update")

    def check_invariants(self) -> None:
        """Every KV slot is free, in the radix cache, or held by a live request (raises otherwise)."""
        held = sum(r.kv_len - len(r.prefix_indices) for r in self._live_reqs())
        cached = self.tree_cache.total_size() + sum(t.total_size() for t in self.retired_trees)
        free = self._free_full()
        if free + cached + held != self.max_total_tokens:
            raise RuntimeError(
                f"KV slot leak: free {free} + cached {cached} + held {held} != "
                f"{self.max_total_tokens}"
            )
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            held_swa = sum(r.kv_len - max(len(r.prefix_indices), r.swa_evicted_len)
                           for r in self._live_reqs() if r.kv_len)
            cached_swa = self.tree_cache.swa_total_size() + sum(
                t.swa_total_size() for t in self.retired_trees)
            free_swa = self.allocator.swa_available_size()
            if free_swa + cached_swa + held_swa != self.allocator.size_swa:
                raise RuntimeError(
                    f"SWA slot leak: free {free_swa} + cached {cached_swa} + held {held_swa} != "
                    f"{self.allocator.size_swa}")
        live_slots = sum(1 for r in self._live_reqs() if r.req_pool_idx is not None)
        if self.req_to_token_pool.available_size() + live_slots != self.req_to_token_pool.size:
            raise RuntimeError("request slot leak")

    def _live_reqs(self) -> list[Req]:
        live = list(self.running) + list(self.waiting)
        if self.chunked_req is not None:
            live.append(self.chunked_req)
        return live

    # ---- admission
    def _reserved_decode_tokens(self, reqs: list[Req]) -> int:
        return int(
            sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) for r in reqs)
            * self.new_token_ratio
        )

    def _get_prefill_batch(self) -> list[tuple[Req, int]]:
        """Pick (req, number of new tokens) to extend this step, locking their cached prefixes."""
        blocked = self.handover.admission_blocked
        if self.chunked_req is None and (not self.waiting or blocked):
            return []
        candidates: list[Req] = []
        if self.chunked_req is not None:
            candidates.append(self.chunked_req)
            self.chunked_req = None
        budget = min(self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        reserved = self._reserved_decode_tokens(self.running)
        swa_cap = (self.swa_window or 0) + self.swa_page  # most SWA slots a decoding request holds
        swa_reserved = sum(min(int(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
                                   * self.new_token_ratio), swa_cap) for r in self.running)
        batch: list[tuple[Req, int]] = []
        used = swa_used = 0
        # While a weight update waits, only a prompt already mid-chunk may go on.
        waiting_iter = iter([] if blocked else list(self.waiting))
        while True:
            req = candidates.pop() if candidates else next(waiting_iter, None)
            if req is None or budget <= 0:
                if req is not None and req.req_pool_idx is not None:
                    self.chunked_req = req  # not admitted this step; stays first in line
                break
            if req.req_pool_idx is None:
                if len(self.running) + len(batch) >= self.config.max_running_requests:
                    break
                if self.req_to_token_pool.available_size() <= len(batch):
                    break
                self._match_prefix(req)
                if self._shares_prefix_with(req, batch):
                    self._unmatch_prefix(req)  # stays waiting; next step the prefix is cached
                    self.stats.num_prefix_deferrals += 1
                    continue
            fill_len = req.seq_len
            extend = fill_len - req.kv_len
            free = self._free_full() + self.tree_cache.evictable_size()
            room = free - reserved - used
            future = int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            nothing_else = not self.running and not batch
            chunk = min(extend, budget)
            swa_free = 0
            if self.swa_window is not None:
                # Every new token takes an SWA slot for its forward; the window is kept after.
                swa_free = self._free_swa() + self.tree_cache.swa_evictable_size()
                if nothing_else:
                    chunk = max(1, min(chunk, swa_free))
            if chunk < extend:
                # A chunk is admitted if it fits now; decode reservation is checked on the last chunk.
                fits = chunk <= room or (nothing_else and chunk <= free)
            else:
                fits = chunk + future <= room or (nothing_else and chunk <= free)
            swa_future = min(future, swa_cap) if chunk == extend else 0
            if self.swa_window is not None and fits:
                swa_room = swa_free - swa_reserved - swa_used
                fits = chunk + swa_future <= swa_room or (nothing_else and chunk <= swa_free)
            if not fits:
                if req.req_pool_idx is None:
                    self._unmatch_prefix(req)
                else:
                    self.chunked_req = req
                break
            if req in self.waiting:
                self.waiting.remove(req)
            batch.append((req, chunk))
            used += chunk + (future if chunk == extend else 0)
            swa_used += chunk + swa_future
            budget -= chunk
            if chunk < extend:
                break  # a chunked request ends the batch
        return batch

    def _publishes_at_prefill(self, req: Req) -> bool:
        """Is `req`'s prompt put in the radix cache as soon as its prefill completes? Always with
        one pool; with two, only a prompt shorter than the window (it keeps every token's SWA K/V,
        so another prompt can be matched against all of it)."""
        return self.swa_window is None or req.seq_len < self.swa_window

    def _shares_prefix_with(self, req: Req, batch: list[tuple[Req, int]]) -> bool:
        """Does a request admitted in `batch`, whose prompt will be published at prefill, compute
        at least IN_BATCH_PREFIX_MIN tokens of `req`'s prompt beyond what `req` found cached?"""
        if self.tree_cache.disable or not batch:
            return False
        key = req.all_token_ids()[: req.seq_len - 1]
        first = req.input_score_first()
        if first is not None:  # as `_match_prefix`: no cached prefix past it is used
            key = key[:first]
        need = req.kv_len + IN_BATCH_PREFIX_MIN
        if len(key) < need:
            return False
        head = key[:need]
        return any(self._publishes_at_prefill(other) and other.all_token_ids()[:need] == head
                   for other, _ in batch)

    def _match_prefix(self, req: Req) -> None:
        key = req.all_token_ids()[: req.seq_len - 1]  # always compute at least one token
        first = req.input_score_first()
        if first is not None:  # the positions whose input logprobs are pending are computed
            key = key[:first]
        indices, node = self.tree_cache.match_prefix(key)
        self.tree_cache.inc_lock_ref(node)
        req.tree = self.tree_cache
        req.kv_epoch = self.kv_epoch
        req.prefix_indices = indices
        req.last_node = node
        req.kv_len = len(indices)
        req.swa_evicted_len = 0

    def _unmatch_prefix(self, req: Req) -> None:
        (req.tree or self.tree_cache).dec_lock_ref(req.last_node)
        req.tree = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None
        req.kv_len = 0

    def _free_full(self) -> int:
        alloc = self.allocator
        if isinstance(alloc, SWATokenToKVPoolAllocator):
            return alloc.full_available_size()
        return alloc.available_size()

    def _free_swa(self) -> int:
        """Free SWA slots (two-pool cache only)."""
        assert isinstance(self.allocator, SWATokenToKVPoolAllocator)
        return self.allocator.swa_available_size()

    def _decode_room(self, need: int) -> bool:
        """`need` tokens fit in free + evictable slots of every pool."""
        if self._free_full() + self.tree_cache.evictable_size() < need:
            return False
        return self.swa_window is None or (
            self._free_swa() + self.tree_cache.swa_evictable_size() >= need)

    def _alloc_kv(self, n: int) -> torch.Tensor:
        short = n - self._free_full()
        short_swa = n - self._free_swa() if self.swa_window is not None else 0
        if short > 0 or short_swa > 0:
            self.tree_cache.evict(short, short_swa)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"KV allocation of {n} slots failed after eviction")
        return slots

    # ---- one step: schedule -> prepare -> worker.forward -> process_results
    def schedule(self) -> ScheduleBatch | None:
        """The batch to run next: a prefill batch when waiting requests can be admitted (prefill
        first keeps time-to-first-token low), else one decode step over every running request
        (retracting the newest ones while KV is short). None when there is nothing to run."""
        picked = self._get_prefill_batch()
        if picked:
            reqs = [req for req, _ in picked]
            lens = [n for _, n in picked]
            riders = self._mixed_decode_riders(sum(lens))
            return ScheduleBatch(ForwardMode.EXTEND, reqs + riders, lens + [1] * len(riders),
                                 num_decode=len(riders))
        self._ensure_decode_room()
        if not self.running:
            return None
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def _mixed_decode_riders(self, prefill_tokens: int) -> list[Req]:
        """With `enable_mixed_chunk`, every running request decodes in the prefill batch (one
        token each, after the prefill rows) when KV has room for all of them; else none does."""
        if not self.config.enable_mixed_chunk or not self.running:
            return []
        if not self._decode_room(prefill_tokens + len(self.running)):
            return []
        return list(self.running)

    def prepare(self, batch: ScheduleBatch) -> None:
        """Give the batch's new tokens KV slots (evicting cached prefixes if needed), record them in
        the request table, and fill the worker's inputs."""
        out_cache_loc = self._alloc_kv(sum(batch.extend_lens))
        self._inflight_loc = out_cache_loc
        batch.out_cache_loc = out_cache_loc
        reqs = batch.reqs
        if batch.is_decode:
            # The worker records each new slot in req_to_token (inside the graph when captured).
            batch.input_ids = [r.output_ids[-1] for r in reqs]
            batch.positions = [r.kv_len for r in reqs]
            batch.req_pool_indices = [r.req_pool_idx for r in reqs]  # type: ignore[misc]
            batch.prefix_lens = batch.positions
            batch.sampling = sampling_info(reqs)
            return
        offset = 0
        sample_rows: list[int] = []
        score = PromptScoring([], [], [])
        for i, (req, n) in enumerate(zip(reqs, batch.extend_lens)):
            if req.req_pool_idx is None:
                slot = self.req_to_token_pool.alloc()
                if slot is None:
                    raise RuntimeError("no free request slot (admission checked there was one)")
                req.req_pool_idx = slot
                self.req_to_token_pool.write(slot, 0, req.prefix_indices)
                req.cached_tokens = max(req.cached_tokens, len(req.prefix_indices))
                self.stats.num_cached_tokens += len(req.prefix_indices)
            start = req.kv_len
            self.req_to_token_pool.write(req.req_pool_idx, start, out_cache_loc[offset : offset + n])
            batch.input_ids.extend(req.all_token_ids()[start : start + n])
            batch.positions.extend(range(start, start + n))
            batch.req_pool_indices.append(req.req_pool_idx)
            batch.prefix_lens.append(start)
            if start + n == req.seq_len and req.sampling_params.max_new_tokens > 0:
                sample_rows.append(i)  # its prompt completes: it gets a token
            batch.score_counts.append(self._add_scored_rows(score, req, offset, start, n))
            offset += n
        sampled = reqs if len(sample_rows) == len(reqs) else [reqs[i] for i in sample_rows]
        batch.sample_rows = None if sampled is reqs else sample_rows
        batch.sampling = sampling_info(sampled)
        if score.rows:
            score.top = max(r.top_logprobs_num for r, c in zip(reqs, batch.score_counts) if c)
            batch.score = score

    @staticmethod
    def _add_scored_rows(score: PromptScoring, req: Req, offset: int, start: int, n: int) -> int:
        """Add the rows of `req`'s new tokens [start, start + n) (flat from `offset`) whose input
        logprobs are pending to `score`; returns how many. Position p's row predicts the prompt
        token at p + 1; a prompt scored from position 0 gets its first entry (None) here."""
        first = req.input_score_first()
        if first is None:
            return 0
        prompt = req.origin_input_ids
        if first == 0 and not req.input_token_logprobs and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, prompt[0]))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
        if first < start:  # the prefix match stops at `first`, and chunks go in order
            raise RuntimeError(f"request {req.rid}: input logprobs pending from position {first} "
                               f"but its KV already reaches {start}")
        last = min(len(prompt) - 2, start + n - 1)
        temperature = req.sampling_params.temperature or 1.0
        for q in range(first, last + 1):
            score.rows.append(offset + q - start)
            score.targets.append(prompt[q + 1])
            score.temperatures.append(temperature)
        return max(last + 1 - first, 0)

    def process_results(self, batch: ScheduleBatch, out: SampleOutput) -> list[Req]:
        """Apply one forward's outcome: KV lengths grow, a chunked prompt is cached and waits for its
        next chunk, and every sampled request takes its token (and finishes, or runs on). Returns the
        requests that got a token."""
        self._inflight_loc = None
        if batch.is_decode:
            self.stats.num_forward_decode += 1
            for req in batch.reqs:
                req.kv_len += 1
                if self.swa_window is not None:
                    self._release_swa(req)
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        else:
            self.stats.num_forward_extend += 1
            self.stats.num_prefill_tokens += len(batch.input_ids) - batch.num_decode
            if batch.num_decode:
                self.stats.num_mixed_decode += batch.num_decode
                self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                           self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
            prefilled = len(batch.reqs) - batch.num_decode  # decode riders come last
            for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
                req.kv_len += n
                if req.kv_len < req.seq_len:
                    if req.kv_epoch == self.kv_epoch:  # stale chunks stay private to the request
                        (req.tree or self.tree_cache).cache_unfinished_req(req)
                    if self.swa_window is not None:
                        # The SWA slots the next chunk cannot see go back even when the chunk
                        # was not published (cache off or retired, a cached copy lacking SWA
                        # K/V, a stale chunk): held, a prompt longer than the SWA pool would
                        # wait for slots forever. A no-op after a publish (it released them).
                        self._release_swa(req)
                    self.chunked_req = req
                    continue
                if (i < prefilled and req.kv_epoch == self.kv_epoch
                        and self._publishes_at_prefill(req)):
                    # A completed prompt is published at once, not when the request finishes, so
                    # prompts admitted later (n samples of it, a retracted request coming back)
                    # read it from the cache.
                    (req.tree or self.tree_cache).cache_unfinished_req(req)
                elif self.swa_window is not None:
                    # A completed prompt (or a decode rider) keeps only its window: held until its
                    # first decode step, a whole prompt's SWA slots would cap admission at
                    # SWA slots / prompt length while prefills run first.
                    self._release_swa(req)
            self._apply_input_logprobs(batch, out)
        reqs = batch.sampled_reqs()
        riders = set(map(id, batch.reqs[len(batch.reqs) - batch.num_decode:]))
        got = self._apply_tokens(reqs, out, range(len(reqs)), newly_prefilled=not batch.is_decode,
                                 riders=riders)
        if not batch.is_decode:
            # A prompt scored for its input logprobs with max_new_tokens = 0 ends with its prefill.
            scored = [r for r in batch.reqs if r.kv_len == r.seq_len and not r.finished
                      and r.sampling_params.max_new_tokens == 0]
            for req in scored:
                req.finished_reason = {"type": "length", "length": 0}
                req.weight_version = self.handover.weight_version
                self._release_kv(req)
            got = _merge(got, scored)
        return got

    @staticmethod
    def _apply_input_logprobs(batch: ScheduleBatch, out: SampleOutput) -> None:
        """Each request takes its scored rows' input logprobs, in position order."""
        if batch.score is None:
            return
        if out.input_logprobs is None:
            raise RuntimeError("the worker returned no input logprobs for a scored batch")
        logprobs, top = out.input_logprobs
        row = 0
        for req, count in zip(batch.reqs, batch.score_counts):
            targets = batch.score.targets[row : row + count]
            req.input_token_logprobs.extend(zip(logprobs[row : row + count], targets))
            if req.top_logprobs_num > 0 and top is not None:
                req.input_top_logprobs.extend(t[: req.top_logprobs_num]
                                              for t in top[row : row + count])
            row += count

    def _apply_tokens(self, reqs: list[Req], out: SampleOutput, rows: Any, newly_prefilled: bool,
                      on_finish: Any = None, riders: set[int] | None = None) -> list[Req]:
        """Request `reqs[k]` takes the token of output row `rows[k]`; finished ones give their KV
        back (after `on_finish(req)`), newly prefilled ones that go on join `running`. `riders`:
        ids of running requests that decoded in a prefill batch (they are running already)."""
        failed = out.failed
        finished: list[Req] = []
        riders = riders or set()
        for req, i in zip(reqs, rows):
            if failed and i in failed:  # this request alone ends; the rest of the batch goes on
                req.finished_reason = {"type": "abort", "message": failed[i]}
                finished.append(req)
                continue
            token = out.next_ids[i]
            req.output_ids.append(token)
            self.stats.num_generated_tokens += 1
            if req.return_logprob and out.logprobs is not None:
                req.output_token_logprobs.append((out.logprobs[i], token))
                if req.top_logprobs_num > 0 and out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            req.finished_reason = self._check_finished(req, token)
            if req.finished_reason is not None:
                finished.append(req)
            elif newly_prefilled and id(req) not in riders:
                self.running.append(req)
        if finished:
            done = set(map(id, finished))
            if riders or not newly_prefilled:  # running requests among them leave `running`
                self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                req.weight_version = self.handover.weight_version
                if on_finish is not None:
                    on_finish(req)
                self._release_kv(req)
        return reqs

    def _ensure_decode_room(self) -> None:
        """Retract the newest running requests until every remaining one has a slot for its token."""
        while self.running:
            if self._decode_room(len(self.running)):
                return
            req = self.running.pop()
            self._release_kv(req)
            req.reset_for_retract()
            self.waiting.appendleft(req)
            self.stats.num_retractions += 1
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            logger.info("retracted request %s (KV exhausted; %s)", req.rid, self.kv_pools_summary())

    def _release_swa(self, req: Req) -> None:
        """Two-pool cache: give back the SWA slots of this request's tokens that no future query can
        see (positions < kv_len - window + 1), in runs of `swa_page`: its own tokens' slots, and
        those of cached-prefix nodes only it holds."""
        assert self.swa_window is not None and req.req_pool_idx is not None
        dead = req.kv_len - self.swa_window + 1
        if dead - req.swa_evicted_len < self.swa_page:
            return
        prefix_len = len(req.prefix_indices)
        if req.swa_evicted_len < prefix_len:
            (req.tree or self.tree_cache).release_swa_before(req.last_node, min(dead, prefix_len))
        own = max(req.swa_evicted_len, prefix_len)
        if dead > own:
            assert isinstance(self.allocator, SWATokenToKVPoolAllocator)
            self.allocator.free_swa(self.req_to_token_pool.req_to_token[req.req_pool_idx, own:dead])
        req.swa_evicted_len = dead

    def _check_finished(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        grammar = req.grammar
        if grammar is not None:
            if not grammar.accept(token):
                # The sampler lets only allowed tokens through, so none was: the output so far
                # leads nowhere in the grammar (a rule that never ends). The drawn token (from
                # all -inf logits) is not the request's: it is taken back.
                req.output_ids.pop()
                if req.return_logprob and req.output_token_logprobs:
                    req.output_token_logprobs.pop()
                    if req.top_logprobs_num > 0 and req.output_top_logprobs:
                        req.output_top_logprobs.pop()
                field = (grammar_of(params) or ("grammar",))[0]
                return {"type": "abort", "message": f"{field}: the grammar allows no token after "
                        "this output (no text it matches continues it)"}
            if grammar.terminated:
                return {"type": "stop", "matched": token}
            if grammar.slow_accepts >= SLOW_ACCEPTS:  # it would hold up every request's steps
                field = (grammar_of(params) or ("grammar",))[0]
                return {"type": "abort", "message": (
                    f"{field}: following the grammar took {grammar.last_accept_s * 1000:.0f} ms "
                    f"of CPU time for one token, over {MAX_ACCEPT_S * 1000:g} ms for "
                    f"{SLOW_ACCEPTS} tokens in a row: it is too ambiguous to follow at this length")}
        if not params.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_set:
            return {"type": "stop", "matched": token}
        detok = req.stop_detokenizer
        if detok is not None:  # decodes only the new token (with a little context)
            detok.add([token])
            if detok.stop_matched is not None:
                return {"type": "stop", "matched": detok.stop_matched}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.seq_len >= self.worker.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None


def _may_overlap(reqs: list[Req]) -> bool:
    """Their next step may run before their last token reaches the host: penalties read it, and
    a grammar's allowed tokens follow from it."""
    return not any(r.sampling_params.has_penalties or r.grammar is not None for r in reqs)


def _merge(first: list[Req], then: list[Req]) -> list[Req]:
    """Both lists, each request once, in order."""
    if not first:
        return then
    if not then:
        return first
    seen = set(map(id, first))
    return first + [r for r in then if id(r) not in seen]


def create_scheduler(config: EngineConfig, weight_version: str | None = None) -> Scheduler:
    """The scheduler side of one engine, built from `config`: model (on an in-process worker, or
    on `tp_size` rank processes behind a `TpWorkerGroup`), KV pools, tokenizer (for stop strings),
    memory ledger, handover. Raises ValueError for a bad model directory or an unsupported
    architecture."""
    torch.manual_seed(config.seed)
    model_config = ModelConfig.from_dir(config.model_path)
    get_model_class(model_config.architecture)  # unknown architecture -> ValueError early
    tokenizer = load_tokenizer(config)
    eos = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    ledger = MemoryLedger()
    worker: ModelWorker
    if config.tp_size > 1:
        from tide.scheduler.tp_worker import TpWorkerGroup

        worker = TpWorkerGroup(config, model_config, ledger)
    else:
        worker = TpModelWorker(config, model_config, ledger)
    scheduler = Scheduler(config, worker, tuple(sorted(eos)), tokenizer, ledger, model_config,
                          weight_version or "default")
    ledger.mark("engine_ready", f"{model_config.architecture} on {worker.device_info()['device']}")
    return scheduler
