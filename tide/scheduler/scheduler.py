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
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from tide.config import EngineConfig
from tide.detokenizer import IncrementalDetokenizer
from tide.executor.forward_batch import ForwardMode
from tide.layers.sampler import SampleOutput
from tide.memory.ledger import MemoryLedger
from tide.memory.radix_cache import RadixCache
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.scheduler.handover import Handover
from tide.scheduler.request import FinishReason, Req
from tide.scheduler.schedule_batch import ScheduleBatch, sampling_info
from tide.scheduler.worker import ModelWorker, TpModelWorker
from tide.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0  # prompt tokens actually computed (cache hits excluded)
    num_cached_tokens: int = 0  # prompt tokens served from the radix cache
    num_generated_tokens: int = 0
    num_retractions: int = 0
    num_forward_extend: int = 0
    num_forward_decode: int = 0


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
        self.tree_cache = RadixCache(
            self.req_to_token_pool, self.allocator, disable=config.disable_radix_cache
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        # KV slots allocated for the forward in progress, not yet owned by a request's kv_len.
        self._inflight_loc: torch.Tensor | None = None
        self.retired_trees: list[RadixCache] = []  # trees whose KV predates a weight update
        # Bumped by every flush after a weight update: KV of an older epoch is never cached.
        self.kv_epoch = 0
        self.handover = Handover(self, worker, ledger, config.enable_memory_saver, weight_version)

    # ---- public surface
    @property
    def max_total_tokens(self) -> int:
        return self.worker.max_total_tokens

    def server_info(self) -> dict[str, Any]:
        """The model, its limits and where it runs."""
        info: dict[str, Any] = {
            "model_path": self.config.model_path,
            "max_total_tokens": self.max_total_tokens,
            "context_length": self.worker.context_len,
            **self.worker.device_info(),
        }
        if self.model_config is not None:
            info.update(architecture=self.model_config.architecture,
                        vocab_size=self.model_config.vocab_size)
        return info

    def add_request(self, req: Req) -> None:
        """Queue `req` (finished at once if memory is released or it asks for no tokens)."""
        blocked = self.handover.memory_block_reason
        if blocked is not None:
            req.finished_reason = {"type": "abort", "message": blocked}
            return
        params = req.sampling_params
        if params.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return
        if params.stop_strs and self.tokenizer is not None and req.stop_detokenizer is None:
            req.stop_detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.origin_input_ids, params.skip_special_tokens, params.stop_strs)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def num_queued(self) -> int:
        return len(self.waiting)

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
        """A step would make progress."""
        return self.has_work() and not self.is_blocked()

    def step(self) -> list[Req]:
        """Run one forward; return the requests that got a token in it (finished ones included).
        Does nothing while paused or while memory is released.

        If the forward raises, the requests of that batch finish with an abort that carries the
        error, their KV is released, and the scheduler stays usable. A request whose own sampling
        fails is aborted alone (see `TpModelWorker.sample`); the rest go on.
        """
        if not self.handover.may_step():
            return []
        batch = self.schedule()
        if batch is None:
            return []
        try:
            self.prepare(batch)
            out = self.worker.forward(batch)
            return self.process_results(batch, out)
        except Exception as e:  # any failure must not leak KV or wedge the loop
            logger.exception("forward failed; aborting %d request(s)", len(batch.reqs))
            return self._fail(batch.reqs, f"internal error: {type(e).__name__}: {e}")

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
        aborted: list[Req] = []
        for req in list(self.waiting):
            if rid is None or req.rid == rid:
                self.waiting.remove(req)
                aborted.append(req)
        for req in list(self.running):
            if rid is None or req.rid == rid:
                self.running.remove(req)
                aborted.append(req)
        if self.chunked_req is not None and (rid is None or self.chunked_req.rid == rid):
            aborted.append(self.chunked_req)
            self.chunked_req = None
        for req in aborted:
            req.finished_reason = {"type": "abort", "message": message}
            req.weight_version = self.handover.weight_version
            if req.req_pool_idx is not None:
                self._release_kv(req)
        return aborted

    def flush_cache(self, empty_cache: bool = True) -> tuple[bool, str]:
        """Reset the radix cache, request slots and KV allocator; only when nothing is queued or
        running. Empties the device allocator cache only if `empty_cache`."""
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
                    self.tree_cache = RadixCache(
                        self.req_to_token_pool, self.allocator, disable=self.config.disable_radix_cache
                    )
        if torch_empty_cache:
            self.worker.empty_device_cache("weight_update")

    def check_invariants(self) -> None:
        """Every KV slot is free, in the radix cache, or held by a live request (raises otherwise)."""
        held = sum(r.kv_len - len(r.prefix_indices) for r in self._live_reqs())
        cached = self.tree_cache.total_size() + sum(t.total_size() for t in self.retired_trees)
        total = self.allocator.available_size() + cached + held
        if total != self.max_total_tokens:
            raise RuntimeError(
                f"KV slot leak: free {self.allocator.available_size()} + cached "
                f"{cached} + held {held} != {self.max_total_tokens}"
            )
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
        batch: list[tuple[Req, int]] = []
        used = 0
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
            fill_len = req.seq_len
            extend = fill_len - req.kv_len
            free = self.allocator.available_size() + self.tree_cache.evictable_size()
            room = free - reserved - used
            future = int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            nothing_else = not self.running and not batch
            chunk = min(extend, budget)
            if chunk < extend:
                # A chunk is admitted if it fits now; decode reservation is checked on the last chunk.
                fits = chunk <= room or (nothing_else and chunk <= free)
            else:
                fits = chunk + future <= room or (nothing_else and chunk <= free)
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
            budget -= chunk
            if chunk < extend:
                break  # a chunked request ends the batch
        return batch

    def _match_prefix(self, req: Req) -> None:
        key = req.all_token_ids()[: req.seq_len - 1]  # always compute at least one token
        indices, node = self.tree_cache.match_prefix(key)
        self.tree_cache.inc_lock_ref(node)
        req.tree = self.tree_cache
        req.kv_epoch = self.kv_epoch
        req.prefix_indices = indices
        req.last_node = node
        req.kv_len = len(indices)

    def _unmatch_prefix(self, req: Req) -> None:
        (req.tree or self.tree_cache).dec_lock_ref(req.last_node)
        req.tree = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None
        req.kv_len = 0

    def _alloc_kv(self, n: int) -> torch.Tensor:
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())
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
            return ScheduleBatch(ForwardMode.EXTEND, reqs, [n for _, n in picked])
        self._ensure_decode_room()
        if not self.running:
            return None
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

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
            if start + n == req.seq_len:  # its prompt completes: it gets a token
                sample_rows.append(i)
            offset += n
        sampled = reqs if len(sample_rows) == len(reqs) else [reqs[i] for i in sample_rows]
        batch.sample_rows = None if sampled is reqs else sample_rows
        batch.sampling = sampling_info(sampled)

    def process_results(self, batch: ScheduleBatch, out: SampleOutput) -> list[Req]:
        """Apply one forward's outcome: KV lengths grow, a chunked prompt is cached and waits for its
        next chunk, and every sampled request takes its token (and finishes, or runs on). Returns the
        requests that got a token."""
        self._inflight_loc = None
        if batch.is_decode:
            self.stats.num_forward_decode += 1
            for req in batch.reqs:
                req.kv_len += 1
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        else:
            self.stats.num_forward_extend += 1
            self.stats.num_prefill_tokens += len(batch.input_ids)
            for req, n in zip(batch.reqs, batch.extend_lens):
                req.kv_len += n
                if req.kv_len < req.seq_len:
                    if req.kv_epoch == self.kv_epoch:  # stale chunks stay private to the request
                        (req.tree or self.tree_cache).cache_unfinished_req(req)
                    self.chunked_req = req
        reqs = batch.sampled_reqs()
        newly_prefilled = not batch.is_decode
        failed = out.failed
        for i, req in enumerate(reqs):
            if failed and i in failed:  # this request alone ends; the rest of the batch goes on
                req.finished_reason = {"type": "abort", "message": failed[i]}
                req.weight_version = self.handover.weight_version
                if not newly_prefilled:
                    self.running.remove(req)
                self._release_kv(req)
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
                req.weight_version = self.handover.weight_version
                if not newly_prefilled:
                    self.running.remove(req)
                self._release_kv(req)
            elif newly_prefilled:
                self.running.append(req)
        return reqs

    def _ensure_decode_room(self) -> None:
        """Retract the newest running requests until every remaining one has a slot for its token."""
        while self.running:
            need = len(self.running)
            if self.allocator.available_size() + self.tree_cache.evictable_size() >= need:
                return
            req = self.running.pop()
            self._release_kv(req)
            req.reset_for_retract()
            self.waiting.appendleft(req)
            self.stats.num_retractions += 1
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            logger.info("retracted request %s (KV exhausted)", req.rid)

    def _check_finished(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:  # type: ignore[operator]
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


def create_scheduler(config: EngineConfig, weight_version: str | None = None) -> Scheduler:
    """The scheduler side of one engine, built from `config`: model (on an in-process worker, or
    on `tp_size` rank processes behind a `TpWorkerGroup`), KV pools, tokenizer (for stop strings), memory ledger, handover. Raises ValueError for a bad model
    directory or an unsupported architecture."""
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
