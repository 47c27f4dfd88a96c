"""The scheduling loop: admit requests, run prefill/extend or decode, sample, finish or retract.

One `step()` runs at most one forward: a prefill batch when waiting requests can be admitted (prefill
first keeps time-to-first-token low), else one decode step over every running request.

KV accounting: a request is admitted when its new prompt tokens plus an estimate of its future decode
tokens (`remaining * new_token_ratio`) fit in free + evictable slots. The estimate is optimistic; when a
decode step finds no free slot, the newest requests are retracted (their KV goes to the radix cache or
back to the allocator, and they re-queue with their output so far) and the ratio rises again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tide.config import EngineConfig
from tide.executor.model_runner import ModelRunner
from tide.layers.sampler import SampleOutput, Sampler
from tide.memory.device import empty_device_cache
from tide.memory.radix_cache import RadixCache
from tide.scheduler.request import Req

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
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
        model_runner: ModelRunner,
        eos_token_ids: tuple[int, ...],
        decode_text: Callable[[list[int]], str] | None,
    ) -> None:
        self.config = config
        self.runner = model_runner
        self.eos_token_ids = set(eos_token_ids)
        self.decode_text = decode_text
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.tree_cache = RadixCache(
            self.req_to_token_pool, self.allocator, disable=config.disable_radix_cache
        )
        self.sampler = Sampler(config.seed)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        # KV slots allocated for the forward in progress, not yet owned by a request's kv_len.
        self._inflight_loc: torch.Tensor | None = None
        # Handover state: a pause mode ("abort" | "retract" | "in_place") or None; admission is
        # blocked while a weight update waits for running requests to drain.
        self.paused: str | None = None
        self.retired_trees: list[RadixCache] = []  # trees whose KV predates a weight update
        # Bumped by every flush after a weight update: KV of an older epoch is never cached.
        self.kv_epoch = 0
        self.admission_blocked = False
        self.weight_version = "default"
        # Set while memory is released (or weights await a refill): nothing runs, new requests abort.
        self.memory_block_reason: str | None = None

    # ---- public surface
    @property
    def max_total_tokens(self) -> int:
        return self.runner.max_total_tokens

    def add_request(self, req: Req) -> None:
        if self.memory_block_reason is not None:
            req.finished_reason = {"type": "abort", "message": self.memory_block_reason}
            return
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def num_queued(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked_req else 0)

    def step(self) -> list[Req]:
        """Run one forward; return the requests that got a token in it (finished ones included).
        Does nothing while paused.

        If the forward raises, the requests of that batch finish with an abort that carries the
        error, their KV is released, and the scheduler stays usable. If sampling raises, only the
        requests whose own sampling fails are aborted (see `_sample`); the rest go on.
        """
        if self.paused is not None or self.memory_block_reason is not None:
            return []
        batch = self._get_prefill_batch()
        reqs = [r for r, _ in batch] if batch else list(self.running)
        try:
            if batch:
                return self._run_extend(batch)
            if self.running:
                return self._run_decode()
            return []
        except Exception as e:  # noqa: BLE001 - any failure must not leak KV or wedge the loop
            logger.exception("forward failed; aborting %d request(s)", len(reqs))
            return self._fail(reqs, f"internal error: {type(e).__name__}: {e}")

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
            req.weight_version = self.weight_version
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
            req.weight_version = self.weight_version
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
        self._reset_kv_state()
        if empty_cache:
            empty_device_cache(reason="flush_cache")
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
        self._reset_kv_state()

    def _reset_kv_state(self) -> None:
        self.retired_trees.clear()
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()

    # ---- training <-> rollout handover
    def num_holding_kv(self) -> int:
        """Requests that own KV slots (running, or a prompt mid-chunk)."""
        return len(self.running) + (1 if self.chunked_req is not None else 0)

    def can_update_weights(self) -> bool:
        """Not paused, an update waits until no request holds KV; paused, it may go at once."""
        return self.paused is not None or self.num_holding_kv() == 0

    def pause_generation(self, mode: str) -> int:
        """Stop scheduling. `abort`: every in-flight request (queued ones too) finishes now with its
        partial output; `retract`: running requests give up their KV and re-queue (recomputed on
        continue); `in_place`: running requests keep their KV and wait. Returns how many requests
        were affected."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            count = len(self.abort(message="paused with mode=abort"))
        elif mode == "retract":
            held = list(self.running)
            if self.chunked_req is not None:
                held.append(self.chunked_req)
                self.chunked_req = None
            for req in reversed(held):  # re-queue in admission order, ahead of new arrivals
                if req in self.running:
                    self.running.remove(req)
                self._release_kv(req)
                req.reset_for_retract()
                self.waiting.appendleft(req)
            self.stats.num_retractions += len(held)
            count = len(held)
        else:
            count = self.num_holding_kv()
        self.paused = mode
        return count

    def continue_generation(self) -> None:
        self.paused = None

    def flush_cache_after_weight_update(self, flush_cache: bool, torch_empty_cache: bool) -> None:
        """After new weights: cached KV was computed with the old ones. With no request holding KV,
        reset every pool (queued requests hold none); paused in place, drop every cached prefix no
        held request uses and leave the held requests' KV alone."""
        if flush_cache:
            self.kv_epoch += 1
            if self.num_holding_kv() == 0:
                self._reset_kv_state()
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
            empty_device_cache(reason="weight_update")

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
        if self.chunked_req is None and (not self.waiting or self.admission_blocked):
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
        waiting_iter = iter([] if self.admission_blocked else list(self.waiting))
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

    # ---- forward passes
    def _run_extend(self, batch: list[tuple[Req, int]]) -> list[Req]:
        out_cache_loc = self._alloc_kv(sum(n for _, n in batch))
        self._inflight_loc = out_cache_loc
        input_ids: list[int] = []
        positions: list[int] = []
        pool_idx: list[int] = []
        prefix_lens: list[int] = []
        offset = 0
        for req, n in batch:
            if req.req_pool_idx is None:
                slot = self.req_to_token_pool.alloc()
                assert slot is not None  # checked at admission
                req.req_pool_idx = slot
                self.req_to_token_pool.write(slot, 0, req.prefix_indices)
                req.cached_tokens = max(req.cached_tokens, len(req.prefix_indices))
                self.stats.num_cached_tokens += len(req.prefix_indices)
            start = req.kv_len
            self.req_to_token_pool.write(req.req_pool_idx, start, out_cache_loc[offset : offset + n])
            input_ids.extend(req.all_token_ids()[start : start + n])
            positions.extend(range(start, start + n))
            pool_idx.append(req.req_pool_idx)
            prefix_lens.append(start)
            offset += n
        logits = self.runner.forward_extend(
            input_ids, positions, pool_idx, prefix_lens, [n for _, n in batch], out_cache_loc
        )
        self.stats.num_forward_extend += 1
        self.stats.num_prefill_tokens += len(input_ids)
        self._inflight_loc = None

        done_rows: list[int] = []
        for i, (req, n) in enumerate(batch):
            req.kv_len += n
            if req.kv_len < req.seq_len:
                if req.kv_epoch == self.kv_epoch:  # stale chunks stay private to the request
                    (req.tree or self.tree_cache).cache_unfinished_req(req)
                self.chunked_req = req
            else:
                done_rows.append(i)
        if not done_rows:
            return []
        reqs = [batch[i][0] for i in done_rows]
        rows = logits if len(done_rows) == len(batch) else logits[done_rows]
        self._process_samples(rows, reqs, newly_prefilled=True)
        return reqs

    def _run_decode(self) -> list[Req]:
        self._ensure_decode_room()
        reqs = self.running
        if not reqs:
            return []
        out_cache_loc = self._alloc_kv(len(reqs))
        self._inflight_loc = out_cache_loc
        # forward_decode records each new slot in req_to_token (inside the graph when captured).
        logits = self.runner.forward_decode(
            [r.output_ids[-1] for r in reqs],
            [r.kv_len for r in reqs],
            [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            out_cache_loc,
        )
        self.stats.num_forward_decode += 1
        self._inflight_loc = None
        for req in reqs:
            req.kv_len += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        reqs = list(reqs)
        self._process_samples(logits, reqs, newly_prefilled=False, greedy_ids=self.runner.last_greedy_ids)
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

    def _process_samples(self, logits: torch.Tensor, reqs: list[Req], newly_prefilled: bool,
                         greedy_ids: torch.Tensor | None = None) -> None:
        out, failed = self._sample(logits, reqs, greedy_ids)
        for i, req in enumerate(reqs):
            if i in failed:  # this request alone ends; the rest of the batch goes on
                req.finished_reason = {"type": "abort", "message": failed[i]}
                req.weight_version = self.weight_version
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
                req.weight_version = self.weight_version
                if not newly_prefilled:
                    self.running.remove(req)
                self._release_kv(req)
            elif newly_prefilled:
                self.running.append(req)

    def _sample(self, logits: torch.Tensor, reqs: list[Req], greedy_ids: torch.Tensor | None
                ) -> tuple[SampleOutput, dict[int, str]]:
        """Sample the batch; if that raises, sample row by row so a request whose sampling setup
        fails (parameters that got past validation) is the only one to fail. Returns the output and
        the failed rows' error messages (their entries in the output are placeholders)."""
        try:
            return self.sampler(logits, reqs, greedy_ids), {}
        except Exception:  # noqa: BLE001 - find the row(s) at fault below
            if len(reqs) == 1:
                raise
        logger.warning("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[float, int]]] = []
        failed: dict[int, str] = {}
        for i, req in enumerate(reqs):
            try:
                row = self.sampler(logits[i : i + 1], [req],
                                   None if greedy_ids is None else greedy_ids[i : i + 1])
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("sampling failed for request %s", req.rid)
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
                ids.append(-1)
                logprobs.append(0.0)
                top.append([])
                continue
            ids.append(row.next_ids[0])
            logprobs.append(row.logprobs[0] if row.logprobs is not None else 0.0)
            top.append(row.top_logprobs[0] if row.top_logprobs is not None else [])
        return SampleOutput(ids, logprobs, top), failed

    def _check_finished(self, req: Req, token: int) -> dict[str, Any] | None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:  # type: ignore[operator]
            return {"type": "stop", "matched": token}
        if params.stop_strs and self.decode_text is not None:
            # Search the decoded output from just before the last search point: a token count
            # window would miss stops made of multi-byte characters split over many tokens.
            text = self.decode_text(req.output_ids)
            longest = max(len(s) for s in params.stop_strs)
            tail = text[max(0, req.stop_check_offset - longest) :]
            req.stop_check_offset = len(text)
            for stop in params.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.seq_len >= self.runner.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None
