"""The training <-> rollout handover of one scheduler, in one owner (sglang's semantics and names).

`Handover` owns: pause/continue (`paused`), the weight version, the four weight-update paths (their
validation, the queue of updates waiting for in-flight work, applying them), trainer groups, memory
release/resume (`memory_block_reason`), and the admission block (admission stops while an update
waits). `Engine` calls it under its lock; `SchedulerProcess` calls it from its loop. The scheduler
reads its state; nothing else writes it.

Weight updates: `submit_update` validates the request first (`WeightUpdate.prepare`: names, shapes and
dtypes against the model, a disk checkpoint's headers, a decoded tensor payload), so a bad request
fails at once and changes nothing. A valid one aborts every request if `abort_all_requests`, then
waits in arrival order until no request holds KV (or generation is paused, when it may go at once);
meanwhile admission is blocked, so requests that arrive queue behind it. `apply_ready_updates` writes
those whose turn has come, sets the version, flushes the stale KV (`flush_cache`) and reports each
result through its `on_done`. Distributed updates are validated while receiving (the trainer's
broadcasts must be drained anyway); IPC handles are opened at submission and released once copied.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypedDict

from tide.io_struct import WeightUpdateOptions, check_weight_version
from tide.memory.ledger import MemoryLedger
from tide.memory.observe import reserved_bytes
from tide.memory.occupation import parse_tags
from tide.weights.distributed import DEFAULT_JOIN_TIMEOUT_S
from tide.weights.update import (
    SHARDED,
    TENSOR_LOAD_FORMATS,
    PartialWriteError,
    TensorPayload,
    WeightUpdater,
)

if TYPE_CHECKING:
    from tide.scheduler.scheduler import Scheduler
    from tide.scheduler.worker import ModelWorker

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class HandoverReply(TypedDict):
    """sglang's reply dict (what `Engine`'s handover methods return)."""

    success: bool
    message: str
    num_paused_requests: int


@dataclass(frozen=True)
class HandoverResult:
    """sglang's reply to a handover call."""

    success: bool
    message: str
    num_paused_requests: int = 0

    def to_dict(self) -> HandoverReply:
        return {"success": self.success, "message": self.message,
                "num_paused_requests": self.num_paused_requests}


# ---- the four update paths
class WeightUpdate(ABC):
    """One weight-update request. `prepare` checks everything that can be checked before writing
    (raising ValueError naming the problem) and returns the function that writes (and returns how
    many tensors it wrote)."""

    source: ClassVar[str]

    @abstractmethod
    def prepare(self, updater: WeightUpdater) -> Callable[[], int]: ...


@dataclass(frozen=True)
class DiskUpdate(WeightUpdate):
    """An HF safetensors directory (same names as the initial load)."""

    model_path: str
    load_format: str | None = None
    source: ClassVar[str] = "disk"

    def prepare(self, updater: WeightUpdater) -> Callable[[], int]:
        if self.load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {self.load_format!r} is not supported for disk updates")
        if not isinstance(self.model_path, str) or not os.path.isdir(self.model_path):
            raise ValueError(f"model_path {self.model_path!r} is not a directory")
        return updater.prepare_from_disk(self.model_path)


@dataclass(frozen=True)
class TensorUpdate(WeightUpdate):
    """In-process tensors (`named_tensors`: [(name, tensor), ...], or with
    `load_format="flattened_bucket"` a `FlattenedBucket` or a list of them), or the same from another
    process as `serialized_named_tensors` (`tide.weights.serialize_named_tensors`), one payload or a
    list of one per tensor-parallel rank. `load_format="sharded"`: each rank's payload holds only that
    rank's part of each tensor (what a trainer that shards them itself sends)."""

    named_tensors: TensorPayload | None = None
    serialized_named_tensors: str | bytes | list[str] | None = None
    load_format: str | None = None
    source: ClassVar[str] = "tensor"

    def prepare(self, updater: WeightUpdater) -> Callable[[], int]:
        if self.load_format not in TENSOR_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {TENSOR_LOAD_FORMATS}, "
                             f"got {self.load_format!r}")
        if (self.named_tensors is None) == (self.serialized_named_tensors is None):
            raise ValueError("give exactly one of named_tensors or serialized_named_tensors")
        if self.serialized_named_tensors is not None:
            payload = self.serialized_named_tensors
            if isinstance(payload, list):  # one per tensor-parallel rank (sglang's form)
                return updater.prepare_serialized_per_rank(payload, self.load_format)
            return updater.prepare_serialized(payload, self.load_format)
        if self.load_format == "flattened_bucket":
            return updater.prepare_buckets(self.named_tensors)
        if self.load_format == SHARDED and updater.tp_size > 1:
            raise ValueError("load_format='sharded' needs serialized_named_tensors with one "
                             "payload per rank")
        return updater.prepare_named_tensors(self.named_tensors)


@dataclass(frozen=True)
class IPCUpdate(WeightUpdate):
    """A colocated trainer's bucket buffers shared as CUDA IPC handles
    (`serialize_named_tensors(flatten_by_dtype(...))`), or a list with one payload per
    tensor-parallel rank (each rank maps its own); copied in, then the handles released."""

    serialized_buckets: str | bytes | list[str | bytes]
    source: ClassVar[str] = "ipc"

    def prepare(self, updater: WeightUpdater) -> Callable[[], int]:
        return updater.prepare_from_ipc(self.serialized_buckets)


@dataclass(frozen=True)
class DistributedUpdate(WeightUpdate):
    """Tensors the trainer (rank 0 of `group_name`) broadcasts, in `names` order (one broadcast per
    tensor, or per dtype with `load_format="flattened_bucket"`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None
    source: ClassVar[str] = "distributed"

    def prepare(self, updater: WeightUpdater) -> Callable[[], int]:
        # Checked while receiving (load_format included): a bad request still drains what rank 0
        # announced, so the trainer never hangs and the group stays in step.
        return lambda: updater.load_from_distributed(
            self.names, self.dtypes, self.shapes, self.group_name, self.load_format)


@dataclass
class PendingUpdate:
    update: WeightUpdate
    options: WeightUpdateOptions
    load: Callable[[], int]
    on_done: Callable[[HandoverResult], None]


class Handover:
    """See the module docstring. Not thread-safe: one caller at a time (the engine lock, or the
    scheduler process's loop)."""

    def __init__(self, scheduler: Scheduler, worker: ModelWorker, ledger: MemoryLedger,
                 enable_memory_saver: bool, weight_version: str = "default") -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.ledger = ledger
        self.enable_memory_saver = enable_memory_saver
        self.paused: str | None = None  # a pause mode, or None while generating
        self.weight_version = weight_version
        # Set while memory is released (or weights await a refill): nothing runs, new requests abort.
        self.memory_block_reason: str | None = None
        # Why the weights await a refill when an update failed part-way (None: a resume without a
        # CPU backup, or no refill awaited).
        self.refill_reason: str | None = None
        self.pending_updates: deque[PendingUpdate] = deque()

    # ---- state the scheduler reads
    @property
    def admission_blocked(self) -> bool:
        """A weight update waits: no request is admitted (one mid-prompt finishes its prefill)."""
        return bool(self.pending_updates)

    def may_step(self) -> bool:
        return self.paused is None and self.memory_block_reason is None

    def num_paused_requests(self) -> int:
        sched = self.scheduler
        return sched.num_running() + sched.num_queued() if self.paused is not None else 0

    def _result(self, success: bool, message: str) -> HandoverResult:
        return HandoverResult(success, message, self.num_paused_requests())

    # ---- pause / continue
    def pause_generation(self, mode: str = "abort") -> HandoverResult:
        """Stop scheduling. `abort`: every request (queued ones too) finishes now with its partial
        output; `retract`: running requests give up their KV and re-queue (recomputed on continue);
        `in_place`: running requests keep their KV and wait. Requests submitted while paused queue."""
        if mode not in PAUSE_MODES:
            return HandoverResult(False, f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        sched = self.scheduler
        sched.settle()  # a decode step still on the device lands before the pause
        if mode == "abort":
            count = len(sched.abort(message="paused with mode=abort"))
        elif mode == "retract":
            count = sched.retract_all()
        else:
            count = sched.num_running()
        self.paused = mode
        self.ledger.mark("pause", f"mode={mode}, {count} request(s)")
        return HandoverResult(True, f"paused ({mode}); {count} request(s) affected", count)

    def continue_generation(self, torch_empty_cache: bool = True) -> HandoverResult:
        """Resume. With `torch_empty_cache`, empty the allocator cache first, while still paused (the
        one release point that undoes fragmentation from in-place updates)."""
        if torch_empty_cache:
            before = reserved_bytes()
            self.worker.empty_device_cache("continue_generation")
            logger.info("continue_generation: reserved %.1f MiB -> %.1f MiB",
                        before / 2**20, reserved_bytes() / 2**20)
        self.paused = None
        self.ledger.mark("continue", f"torch_empty_cache={torch_empty_cache}")
        return HandoverResult(True, "continued")

    # ---- versions
    def update_weight_version(self, new_version: str, abort_all_requests: bool = True
                              ) -> HandoverResult:
        try:
            check_weight_version(new_version, "new_version")
        except ValueError as e:
            return HandoverResult(False, str(e))
        self.scheduler.settle()  # a step still on the device finishes under the old version
        if abort_all_requests:
            self.scheduler.abort(message="aborted by update_weight_version")
        self.weight_version = new_version
        return HandoverResult(True, f"weight version is {new_version}")

    # ---- weight updates
    def submit_update(self, update: WeightUpdate, options: WeightUpdateOptions,
                      on_done: Callable[[HandoverResult], None]) -> None:
        """Validate `update` (a bad one is answered through `on_done` now, changing nothing), then
        queue it; `apply_ready_updates` applies it when no request holds KV."""
        try:
            load = update.prepare(self.worker.weight_updater)
        except Exception as e:  # noqa: BLE001 - any decoding or validation failure is bad input
            message = str(e) if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {e}"
            on_done(self._result(False, message))
            return
        if options.abort_all_requests:
            self.scheduler.abort(message="aborted by weight update")
        self.pending_updates.append(PendingUpdate(update, options, load, on_done))

    def update_ready(self) -> bool:
        """The next queued update may be applied now."""
        return bool(self.pending_updates) and self._can_update_now()

    def _can_update_now(self) -> bool:
        """Not paused, an update waits until no request holds KV; paused, it may go at once. So it
        may while memory is blocked: nothing steps then, so held requests could never drain (and a
        weight refill is what unblocks)."""
        return (self.paused is not None or self.memory_block_reason is not None
                or self.scheduler.num_running() == 0)

    def apply_ready_updates(self) -> int:
        """Apply queued updates, in order, while their turn has come; returns how many ran."""
        applied = 0
        while self.apply_next_update():
            applied += 1
        return applied

    def apply_next_update(self) -> bool:
        """Apply the next queued update if its turn has come (its result goes to its `on_done`)."""
        if not self.update_ready():
            return False
        pending = self.pending_updates.popleft()
        try:
            result = self._apply(pending)
        except Exception as e:  # reported to the caller; serving goes on
            logger.exception("weight update failed")
            result = self._result(False, f"weight update failed: {type(e).__name__}: {e}")
        pending.on_done(result)
        return True

    def _apply(self, pending: PendingUpdate) -> HandoverResult:
        self.scheduler.settle()  # tokens of a step still on the device came from the old weights
        start = time.perf_counter()
        try:
            count = pending.load()
        except (ValueError, TypeError) as e:
            return self._result(False, str(e))
        except PartialWriteError as e:
            # Some parameters may hold new values, some old: nothing runs on them until an update
            # has written every parameter again (as after a resume without a CPU backup).
            self.refill_reason = (f"a weight update failed part-way ({e}); push new weights "
                                  "(update_weights_*) covering every parameter first")
            self.worker.memory_occupation.weights_need_refill = True
            self.worker.weight_updater.reset_coverage()
            self._refresh_memory_block()
            logger.error("%s", self.refill_reason)
            return self._result(False, f"{e}; generation waits for an update that writes every "
                                       "parameter")
        options = pending.options
        if options.weight_version is not None:
            self.weight_version = options.weight_version
        occupation = self.worker.memory_occupation
        if occupation.weights_need_refill and self.worker.weight_updater.coverage_complete():
            occupation.weights_need_refill = False
            self.refill_reason = None
            self._refresh_memory_block()
        self.scheduler.flush_cache_after_weight_update(options.flush_cache, options.torch_empty_cache)
        ms = (time.perf_counter() - start) * 1e3
        self.ledger.mark("weight_update", f"{count} tensors, {ms:.1f} ms, "
                                          f"version={self.weight_version}")
        return self._result(True, f"updated {count} tensors in {ms:.1f} ms")

    def cancel_pending_updates(self, message: str) -> None:
        while self.pending_updates:
            self.pending_updates.popleft().on_done(self._result(False, message))

    # ---- trainer groups and reading weights
    def has_group(self, group_name: str) -> bool:
        return group_name in self.worker.weight_updater.groups

    def group_names(self) -> list[str]:
        return sorted(self.worker.weight_updater.groups)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl",
                                  timeout: float = DEFAULT_JOIN_TIMEOUT_S) -> HandoverResult:
        """Join the trainer's broadcast group as rank `rank_offset` (blocks until the trainer joins,
        at most `timeout` seconds; a failed join keeps nothing)."""
        try:
            self.worker.weight_updater.init_group(
                master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
        except (ValueError, RuntimeError) as e:
            return HandoverResult(False, f"init_weights_update_group failed: {e}")
        return HandoverResult(True, f"joined {group_name} as rank {rank_offset} of {world_size}")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> HandoverResult:
        try:
            self.worker.weight_updater.destroy_group(group_name)
        except ValueError as e:
            return HandoverResult(False, str(e))
        return HandoverResult(True, f"destroyed {group_name}")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of checkpoint tensor `name`, flattened (ValueError for an
        unknown name)."""
        return self.worker.weight_updater.get_weights_by_name(name, truncate_size)

    # ---- memory occupation (colocated trainer)
    def release_memory_occupation(self, tags: list[str] | None = None) -> HandoverResult:
        """Give back the memory of `tags` (None: kv_cache, weights, cuda_graph). Needs the memory
        saver, and the engine idle or paused with no request holding KV for `kv_cache` (whose release
        also flushes the radix cache)."""
        try:
            tags = self._memory_saver_tags("release_memory_occupation", tags)
        except ValueError as e:
            return HandoverResult(False, str(e))
        sched = self.scheduler
        sched.settle()
        if self.pending_updates:
            return HandoverResult(False, f"{len(self.pending_updates)} weight update(s) wait to "
                                         "apply; release memory once they have finished")
        if self.paused is None and sched.has_work():
            return HandoverResult(False, f"engine is busy ({sched.num_queued()} queued, "
                                         f"{sched.num_running()} running): pause_generation first")
        if "kv_cache" in tags and sched.num_running():
            return HandoverResult(False, f"{sched.num_running()} request(s) paused in place hold KV;"
                                         " pause with mode='retract' or 'abort' to release kv_cache")
        occupation = self.worker.memory_occupation
        try:
            if "kv_cache" in tags and not occupation.is_released("kv_cache"):
                sched.reset_kv_state()
            freed = occupation.release(tags)
        except Exception as e:  # reported to the caller; serving goes on
            logger.exception("release_memory_occupation failed")
            self._refresh_memory_block()
            return HandoverResult(False, f"release_memory_occupation failed: "
                                         f"{type(e).__name__}: {e}")
        if "weights" in tags:
            self.worker.weight_updater.reset_coverage()
        self._refresh_memory_block()
        self.ledger.mark("release", f"{tags}: {freed / 2**20:.1f} MiB")
        return HandoverResult(True, f"released {tags}: {freed / 2**20:.1f} MiB")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> HandoverResult:
        """Take the memory of `tags` again; `weights` first lets the trainer push into them before
        `kv_cache` returns. Without a CPU backup, weights come back zeroed and generation is refused
        until updates have covered every parameter."""
        try:
            tags = self._memory_saver_tags("resume_memory_occupation", tags)
        except ValueError as e:
            return HandoverResult(False, str(e))
        try:
            self.worker.memory_occupation.resume(tags)
            if self.refill_reason is not None and "weights" in tags:
                # The backup held weights an update had left half-written: still a refill.
                self.worker.memory_occupation.weights_need_refill = True
        except Exception as e:  # reported to the caller; serving goes on
            logger.exception("resume_memory_occupation failed")
            return HandoverResult(False, f"resume_memory_occupation failed: "
                                         f"{type(e).__name__}: {e}")
        finally:
            self._refresh_memory_block()
        self.ledger.mark("resume", str(tags))
        return HandoverResult(True, f"resumed {tags}")

    def drop_cpu_backup(self) -> HandoverResult:
        """Free the host memory of the weights' CPU backup (the next release allocates it again);
        refused while the weights are released."""
        try:
            freed = self.worker.memory_occupation.drop_cpu_backup()
        except ValueError as e:
            return HandoverResult(False, str(e))
        self.ledger.mark("drop_cpu_backup", f"{freed / 2**20:.1f} MiB of host memory")
        return HandoverResult(True, f"freed {freed / 2**20:.1f} MiB of host memory")

    def released_bytes(self) -> dict[str, int]:
        return {tag: int(n) for tag, n in self.worker.memory_occupation.released_bytes().items()}

    def _memory_saver_tags(self, op: str, tags: list[str] | None) -> list[str]:
        if not self.enable_memory_saver:
            raise ValueError(f"{op} needs enable_memory_saver=True")
        return parse_tags(tags)

    def _refresh_memory_block(self) -> None:
        occupation = self.worker.memory_occupation
        self.worker.weight_updater.write_block = (
            "the weights are released; resume_memory_occupation(['weights']) before updating them"
            if occupation.is_released("weights") else None)
        released = [t for t in ("kv_cache", "weights") if occupation.is_released(t)]
        if released:
            self.memory_block_reason = (f"memory of {released} is released; call "
                                        "resume_memory_occupation first")
        elif occupation.weights_need_refill:
            self.memory_block_reason = self.refill_reason or (
                "weights were resumed without a CPU backup; push new weights (update_weights_*) "
                "covering every parameter first")
        else:
            self.memory_block_reason = None

    # ---- shutdown
    def shutdown(self, message: str) -> None:
        """Abort every request, answer every queued update, leave every trainer group."""
        self.scheduler.abort(message=message)
        self.scheduler.shutdown_grammar()
        self.cancel_pending_updates(message)
        for name in self.group_names():
            self.worker.weight_updater.destroy_group(name)
        self.worker.memory_occupation.close()  # the host backup of the weights
