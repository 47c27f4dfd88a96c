"""The scheduler subprocess of `tide serve`: model runner + scheduler behind two zmq sockets.

Loop (`SchedulerProcess.run`):

    while running:
        take every waiting message (block on the socket only when there is nothing to run)
        reply to finished trainer-group joins; apply weight updates that may go now
        if there is runnable work: step once and send the new tokens of every request that got one

Admin messages (sglang's semantics):

- Weight updates (disk, tensor, IPC, distributed) are checked at receipt where that is cheap (a
  tensor payload is decoded and its names/shapes/dtypes validated; a disk checkpoint's headers are
  read), so a bad request fails at once and changes nothing. Otherwise, with `abort_all_requests`
  every request is aborted now; admission is blocked and the update waits, while the loop keeps
  stepping and streaming, until no request holds KV (or generation is paused), then the `Engine`
  method applies it at once and the reply goes out. Updates apply in arrival order; requests that
  arrive meanwhile queue behind them.
- `pause_generation`, `continue_generation`, `update_weight_version`, `get_weights_by_name`,
  `destroy_weights_update_group`, `release_memory_occupation`, `resume_memory_occupation` and
  `dump_memory_timeline` are immediate. A release is refused while a weight update waits to apply
  (the engine itself refuses one while requests run and are not paused). While memory is released
  the loop does not step.
- `init_weights_update_group` joins the trainer's group in a helper thread (the rendezvous blocks until
  the trainer joins, at most the request's `timeout`), so the loop keeps serving meanwhile; the reply
  goes out when the join is done or has failed (a failed join keeps nothing: its thread ends, its
  store connection is closed). At most `MAX_CONCURRENT_JOINS` joins run at once.
  `update_weights_from_distributed` blocks the loop until every broadcast has arrived.

Liveness: a heartbeat thread sends a `SchedulerHeartbeat` every interval with the loop's turn count
and the long operation it has declared (`LoopProgress.operation`, for the messages in
`_LONG_OPERATIONS`: weight updates, memory release/resume, pause/continue, ...), so the HTTP side can
tell a frozen process (no heartbeat), a stuck loop (turn count still) and a long legitimate operation
apart.

The process owns a full in-process `Engine` (model, KV pools, scheduler, tokenizer for stop strings)
and never talks HTTP. It exits when asked (`ShutdownReq`), when its parent dies (PR_SET_PDEATHSIG
delivers SIGTERM on Linux, and a watcher thread checks the parent pid), or on SIGTERM; however it
exits it removes the zmq `ipc://` directory it was given. SIGINT is ignored: a Ctrl-C in a terminal
reaches the whole process group, and the parent decides how to shut down (abort, reply, then exit).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from tide.config import EngineConfig
from tide.memory.device import MEMORY_LEDGER, device_memory_stats
from tide.server.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ContinueGenerationReqInput,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    DumpMemoryTimelineReqInput,
    FlushCacheReqInput,
    GetLoadReqInput,
    GetServerInfoReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    SchedulerHeartbeat,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromIPCReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
    WeightUpdateReq,
    decode_input,
    encode_message,
)

logger = logging.getLogger("tide.scheduler.process")

_IDLE_POLL_MS = 1000  # how often an idle loop turns (checks the parent, counts a turn), at most
_BUSY_POLL_MS = 50  # while something waits on time or a helper thread (flush timeout, group join)
_PARENT_CHECK_S = 0.5  # how often the watcher thread checks that the parent lives
_PR_SET_PDEATHSIG = 1
MAX_CONCURRENT_JOINS = 8  # init_weights_update_group joins in progress at once
_WEIGHT_UPDATES = (
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromIPCReqInput,
    UpdateWeightsFromDistributedReqInput,
)
# Messages whose handling may block the loop for long; declared to the heartbeat while they run.
_LONG_OPERATIONS: dict[type, str] = {
    UpdateWeightFromDiskReqInput: "update_weights_from_disk",
    UpdateWeightsFromTensorReqInput: "update_weights_from_tensor",
    UpdateWeightsFromIPCReqInput: "update_weights_from_ipc",
    UpdateWeightsFromDistributedReqInput: "update_weights_from_distributed",
    ReleaseMemoryOccupationReqInput: "release_memory_occupation",
    ResumeMemoryOccupationReqInput: "resume_memory_occupation",
    PauseGenerationReqInput: "pause_generation",
    ContinueGenerationReqInput: "continue_generation",
    GetWeightsByNameReqInput: "get_weights_by_name",
    DumpMemoryTimelineReqInput: "dump_memory_timeline",
}


class LoopProgress:
    """The loop's turn count and the long operation it is in; written by the loop, read by the
    heartbeat thread (single attribute reads and writes, so no lock is needed)."""

    def __init__(self) -> None:
        self.loop_count = 0
        self.operation: str | None = None
        self.operation_start = 0.0

    def tick(self) -> None:
        self.loop_count += 1

    @contextlib.contextmanager
    def operation_scope(self, name: str) -> Iterator[None]:
        """Declare a long operation for as long as the block runs (nesting keeps the outer one)."""
        if self.operation is not None:
            yield
            return
        self.operation_start = time.monotonic()
        self.operation = name
        try:
            yield
        finally:
            self.operation = None
            self.tick()

    def heartbeat(self) -> SchedulerHeartbeat:
        name, start = self.operation, self.operation_start
        return SchedulerHeartbeat(loop_count=self.loop_count, operation=name,
                                  operation_seconds=time.monotonic() - start if name else 0.0)


class Heartbeat:
    """A daemon thread that sends `progress.heartbeat()` to the HTTP process every `interval` s,
    on its own socket (zmq sockets are not shared across threads). Beats are dropped, not queued
    without bound, when the HTTP side does not read them."""

    def __init__(self, ctx: zmq.Context, output_addr: str, progress: LoopProgress,
                 interval: float) -> None:
        self._ctx = ctx
        self._addr = output_addr
        self._progress = progress
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tide-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.connect(self._addr)
        try:
            while True:
                with contextlib.suppress(zmq.Again):
                    sock.send(encode_message(self._progress.heartbeat()), zmq.NOBLOCK)
                if self._stop.wait(self._interval):
                    return
        finally:
            sock.close()


@dataclass
class _PendingFlush:
    req_id: str
    deadline: float


@dataclass
class _PendingUpdate:
    """A weight update waiting for running requests to drain. `payload`: the tensor path's decoded
    and validated tensors (decoded once, at receipt)."""

    msg: WeightUpdateReq
    payload: Any = None


def run_scheduler_process(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    ready: Connection,
    weight_version: str | None = None,
    heartbeat_interval: float = 1.0,
    ipc_dir: str | None = None,
) -> None:
    """Entry point of the spawned process: build the engine, report readiness, run the loop.
    `ipc_dir` (the directory of the `ipc://` sockets) is removed however the process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _die_with_parent(parent_pid, ipc_dir)
    _setup_logging(config.log_level)
    try:
        _serve(config, input_addr, output_addr, parent_pid, ready, weight_version,
               heartbeat_interval)
    finally:
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _serve(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
           ready: Connection, weight_version: str | None, heartbeat_interval: float) -> None:
    try:
        from tide.engine import Engine

        engine = Engine(config.model_path, **_config_kwargs(config))
        if weight_version is not None:
            engine.scheduler.weight_version = weight_version
        proc = SchedulerProcess(engine, input_addr, output_addr, parent_pid, heartbeat_interval)
    except Exception as e:  # reported to the parent, which prints it and exits
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        logger.debug("scheduler start-up failed:\n%s", traceback.format_exc())
        ready.send_bytes(encode_message(SchedulerReady(error=msg)))
        ready.close()
        return
    info = proc.static_info()
    MEMORY_LEDGER.mark("scheduler_ready", f"pid {os.getpid()}, {info['max_total_tokens']} KV slots")
    ready.send_bytes(encode_message(SchedulerReady(info=info)))
    ready.close()
    try:
        proc.run()
    finally:
        proc.close()


class SchedulerProcess:
    """Runs `engine.scheduler` against the zmq channel to the HTTP process."""

    def __init__(self, engine: Any, input_addr: str, output_addr: str, parent_pid: int,
                 heartbeat_interval: float = 1.0) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.parent_pid = parent_pid
        self.ctx = zmq.Context(1)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.setsockopt(zmq.RCVHWM, 0)
        self.recv_sock.bind(input_addr)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.setsockopt(zmq.SNDHWM, 0)
        self.send_sock.setsockopt(zmq.LINGER, 1000)
        self.send_sock.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_sock, zmq.POLLIN)
        self.live: dict[str, Any] = {}  # rid -> Req, until its finish has been sent
        self.sent_len: dict[str, int] = {}  # rid -> output tokens already sent
        self.pending_flushes: list[_PendingFlush] = []
        self.pending_updates: deque[_PendingUpdate] = deque()
        self.joins: dict[str, threading.Thread] = {}  # group_name -> joining thread
        self.join_results: queue.SimpleQueue[tuple[str, str, dict[str, Any]]] = queue.SimpleQueue()
        self.running = True
        self.idle_poll_ms = max(1, min(_IDLE_POLL_MS, int(heartbeat_interval * 1000)))
        self.progress = LoopProgress()
        self.heartbeat = Heartbeat(self.ctx, output_addr, self.progress, heartbeat_interval)
        self.heartbeat.start()

    # ---- loop
    def run(self) -> None:
        while self.running:
            self.progress.tick()
            self._recv_requests(block=not self._has_ready_work())
            if not self.running:
                break
            self.run_once()

    def run_once(self) -> None:
        """One turn of the loop after the messages are in: joins, updates, a step, flushes."""
        self._finish_joins()
        self._apply_pending_updates()
        if self._can_step():
            try:
                reqs = self._step()
            except Exception as e:  # a bug or device error: fail the requests, keep serving
                logger.error("scheduler step failed:\n%s", traceback.format_exc())
                self._abort_everything(f"internal error in scheduler step: {type(e).__name__}: {e}")
                return
            if reqs:
                self._send_outputs(reqs)
        self._retry_flushes()

    def _can_step(self) -> bool:
        """A step would make progress: not paused, and (while an update waits) something holds KV."""
        sched = self.scheduler
        if sched.paused is not None or not sched.has_work():
            return False
        if sched.memory_block_reason is not None:  # memory released: a step would do nothing
            return False
        if sched.admission_blocked:
            return sched.num_holding_kv() > 0
        return True

    def _has_ready_work(self) -> bool:
        return self._can_step() or bool(
            self.pending_updates and self.scheduler.can_update_weights()
        )

    def _step(self) -> list[Any]:
        # While admission is blocked the scheduler still finishes a half-prefilled (chunked) prompt.
        return self.scheduler.step()

    def _abort_everything(self, message: str) -> None:
        """Finish every live request with an abort, including any a failed step left in limbo."""
        aborted = self.scheduler.abort(None, message=message)
        if aborted:
            self._send_outputs(aborted)
        for rid in list(self.sent_len):  # requests the scheduler no longer knows about
            self.sent_len.pop(rid)
            self.live.pop(rid, None)
            self._send_finished(rid, {"type": "abort", "message": message})

    def _abort_all(self, message: str) -> None:
        aborted = self.scheduler.abort(None, message=message)
        if aborted:
            self._send_outputs(aborted)

    def _report_finished(self) -> None:
        """Send the finish of every tracked request an engine call finished (e.g. pause abort)."""
        done = [req for req in self.live.values() if req.finished]
        if done:
            self._send_outputs(done)

    def close(self) -> None:
        self.heartbeat.stop()
        self.recv_sock.close(linger=0)
        self.send_sock.close()
        self.ctx.term()

    def _recv_requests(self, block: bool) -> None:
        if block:
            timeout = self.idle_poll_ms
            if self.pending_flushes or self.joins:
                timeout = _BUSY_POLL_MS
            if not self.poller.poll(timeout):
                if os.getppid() != self.parent_pid:
                    logger.warning("parent process is gone; scheduler exits")
                    self.running = False
                return
        while self.running:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_input(data)
            except Exception as e:  # a bad message must not take the loop down
                logger.error("dropping undecodable message: %s", e)
                continue
            operation = _LONG_OPERATIONS.get(type(msg))
            if operation is None:
                self._dispatch(msg)
            else:
                with self.progress.operation_scope(operation):
                    self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self._handle_generate(msg)
        elif isinstance(msg, AbortReq):
            self._handle_abort(msg)
        elif isinstance(msg, FlushCacheReqInput):
            self._handle_flush(msg)
        elif isinstance(msg, GetLoadReqInput):
            self._reply(msg.req_id, True, data=self.load_info())
        elif isinstance(msg, GetServerInfoReqInput):
            self._reply(msg.req_id, True, data={**self.static_info(), **self.load_info()})
        elif isinstance(msg, _WEIGHT_UPDATES):
            self._handle_weight_update(msg)
        elif isinstance(msg, PauseGenerationReqInput):
            result = self.engine.pause_generation(msg.mode)
            self._report_finished()  # mode=abort finished every request
            self._reply_result(msg.req_id, result)
        elif isinstance(msg, ContinueGenerationReqInput):
            self._reply_result(msg.req_id, self.engine.continue_generation(msg.torch_empty_cache))
        elif isinstance(msg, UpdateWeightVersionReqInput):
            self._handle_weight_version(msg)
        elif isinstance(msg, (ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput)):
            self._handle_memory_occupation(msg)
        elif isinstance(msg, DumpMemoryTimelineReqInput):
            self._reply(msg.req_id, True, data={"timeline": MEMORY_LEDGER.to_dict()})
        elif isinstance(msg, GetWeightsByNameReqInput):
            try:
                values = self.engine.get_weights_by_name(msg.name, msg.truncate_size)
            except ValueError as e:
                self._reply(msg.req_id, False, str(e))
            else:
                self._reply(msg.req_id, True, data={"values": values})
        elif isinstance(msg, InitWeightsUpdateGroupReqInput):
            self._handle_init_group(msg)
        elif isinstance(msg, DestroyWeightsUpdateGroupReqInput):
            if msg.group_name in self.joins:
                self._reply(msg.req_id, False, f"group_name {msg.group_name!r} is still joining")
            else:
                self._reply_result(msg.req_id, self.engine.destroy_weights_update_group(msg.group_name))
        elif isinstance(msg, ShutdownReq):
            self._abort_everything("server shutting down")
            for pending in self.pending_updates:
                self._reply(pending.msg.req_id, False, "server shutting down")
            self.pending_updates.clear()
            self._reply(msg.req_id, True, "scheduler stopped")
            self.running = False

    # ---- handlers
    def _handle_generate(self, msg: TokenizedGenerateReqInput) -> None:
        from tide.sampling_params import SamplingParams
        from tide.scheduler.request import Req

        try:
            params = SamplingParams.from_dict(msg.sampling_params)
        except ValueError as e:  # validated on the HTTP side already; never crash on it here
            self._send_finished(msg.rid, {"type": "abort", "message": f"invalid request: {e}"})
            return
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=params,
            return_logprob=msg.return_logprob or msg.top_logprobs_num > 0,
            top_logprobs_num=msg.top_logprobs_num,
        )
        self.sent_len[req.rid] = 0
        self.live[req.rid] = req
        self.scheduler.add_request(req)
        if req.finished:  # e.g. max_new_tokens == 0
            self._send_outputs([req])

    def _handle_abort(self, msg: AbortReq) -> None:
        aborted = []
        if msg.abort_all:
            aborted = self.scheduler.abort(None, message=msg.message)
        else:
            for rid in msg.rids:
                aborted += self.scheduler.abort(rid, message=msg.message)
        if aborted:
            self._send_outputs(aborted)
        if msg.req_id is not None:
            self._reply(msg.req_id, True, data={"num_aborted": len(aborted)})

    def _handle_flush(self, msg: FlushCacheReqInput) -> None:
        ok, message = self.scheduler.flush_cache()
        if ok or msg.timeout <= 0:
            self._reply(msg.req_id, ok, message)
        else:
            self.pending_flushes.append(_PendingFlush(msg.req_id, time.monotonic() + msg.timeout))

    def _retry_flushes(self) -> None:
        if not self.pending_flushes:
            return
        now = time.monotonic()
        still: list[_PendingFlush] = []
        for pending in self.pending_flushes:
            if not self.scheduler.has_work():
                ok, message = self.scheduler.flush_cache()
                self._reply(pending.req_id, ok, message)
            elif now >= pending.deadline:
                _, message = self.scheduler.flush_cache()
                self._reply(pending.req_id, False, message + " (timed out waiting for idle)")
            else:
                still.append(pending)
        self.pending_flushes = still

    # ---- handover: weight updates, versions, trainer groups
    def _handle_weight_update(self, msg: WeightUpdateReq) -> None:
        try:
            payload = self._precheck_update(msg)
        except Exception as e:  # noqa: BLE001 - any decoding/validation failure is bad input
            message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            self._reply(msg.req_id, False, message, self._result_data(0))
            return
        if msg.abort_all_requests:
            self._abort_all("aborted by weight update")
        self.scheduler.admission_blocked = True
        self.pending_updates.append(_PendingUpdate(msg, payload))

    def _precheck_update(self, msg: WeightUpdateReq) -> Any:
        """Decode and validate what can be checked before the update waits its turn (raises
        ValueError naming the problem); the tensor path returns its decoded tensors."""
        from tide.weights import deserialize_named_tensors, read_checkpoint_shapes
        from tide.weights.bucket import FlattenedBucket

        updater = self.engine.weight_updater
        if isinstance(msg, UpdateWeightsFromTensorReqInput):
            obj = deserialize_named_tensors(msg.serialized_named_tensors)
            if msg.load_format == "flattened_bucket":
                buckets = [obj] if isinstance(obj, FlattenedBucket) else obj
                if not isinstance(buckets, (list, tuple)) or not all(
                    isinstance(b, FlattenedBucket) for b in buckets
                ):
                    raise ValueError("a flattened_bucket payload must hold FlattenedBucket objects")
                named = [nt for bucket in buckets for nt in bucket.named_tensors()]
            else:
                if not isinstance(obj, (list, tuple)) or not all(
                    isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor) for item in obj
                ):
                    raise ValueError(
                        "serialized_named_tensors must decode to a list of (name, tensor) pairs")
                named = list(obj)
            updater.plan([(n, t.shape, t.dtype) for n, t in named], exact_dtype=True)
            return obj
        if isinstance(msg, UpdateWeightFromDiskReqInput):
            if msg.load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {msg.load_format!r} is not supported for disk updates")
            if not os.path.isdir(msg.model_path):
                raise ValueError(f"model_path {msg.model_path!r} is not a directory")
            updater.plan(read_checkpoint_shapes(msg.model_path), exact_dtype=False,
                         require_complete=True)
        # Distributed updates are validated by the engine, which still receives every broadcast of
        # a bad request so the trainer never hangs; IPC handles are opened only once, when applied.
        return None

    def _apply_pending_updates(self) -> None:
        sched = self.scheduler
        while self.pending_updates and sched.can_update_weights():
            pending = self.pending_updates.popleft()
            try:
                with self.progress.operation_scope(_LONG_OPERATIONS[type(pending.msg)]):
                    result = self._apply_update(pending)
            except Exception as e:  # noqa: BLE001 - report it; the loop must keep serving
                logger.error("weight update failed:\n%s", traceback.format_exc())
                result = {"success": False, "message": f"weight update failed: "
                          f"{type(e).__name__}: {e}", "num_paused_requests": 0}
            finally:
                sched.admission_blocked = bool(self.pending_updates)
            self._report_finished()
            self._reply_result(pending.msg.req_id, result)

    def _apply_update(self, pending: _PendingUpdate) -> dict[str, Any]:
        msg = pending.msg
        engine = self.engine
        # Requests were aborted at receipt; ones that arrived since are queued behind the update.
        flags = dict(flush_cache=msg.flush_cache, abort_all_requests=False,
                     weight_version=msg.weight_version, torch_empty_cache=msg.torch_empty_cache)
        if isinstance(msg, UpdateWeightFromDiskReqInput):
            return engine.update_weights_from_disk(msg.model_path, load_format=msg.load_format,
                                                   **flags)
        if isinstance(msg, UpdateWeightsFromTensorReqInput):
            return engine.update_weights_from_tensor(named_tensors=pending.payload,
                                                     load_format=msg.load_format, **flags)
        if isinstance(msg, UpdateWeightsFromIPCReqInput):
            return engine.update_weights_from_ipc(msg.serialized_buckets, **flags)
        return engine.update_weights_from_distributed(
            msg.names, msg.dtypes, msg.shapes, group_name=msg.group_name,
            load_format=msg.load_format, **flags,
        )

    def _handle_weight_version(self, msg: UpdateWeightVersionReqInput) -> None:
        if not msg.new_version:
            self._reply(msg.req_id, False, "new_version must be a non-empty string")
            return
        if msg.abort_all_requests:
            self._abort_all("aborted by update_weight_version")
        result = self.engine.update_weight_version(msg.new_version, abort_all_requests=False)
        self._reply_result(msg.req_id, result, new_version=self.scheduler.weight_version)

    def _handle_init_group(self, msg: InitWeightsUpdateGroupReqInput) -> None:
        name = msg.group_name
        if name in self.joins or name in self.engine.weight_updater.groups:
            self._reply(msg.req_id, False, f"group_name {name!r} already exists; destroy it first")
            return
        if len(self.joins) >= MAX_CONCURRENT_JOINS:
            self._reply(msg.req_id, False, f"{len(self.joins)} joins are in progress (at most "
                        f"{MAX_CONCURRENT_JOINS}); retry once one has finished")
            return

        def join() -> None:
            try:
                result = self.engine.init_weights_update_group(
                    msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                    group_name=name, backend=msg.backend, timeout=msg.timeout,
                )
            except Exception as e:  # noqa: BLE001 - reported to the caller
                result = {"success": False, "num_paused_requests": 0,
                          "message": f"init_weights_update_group failed: {type(e).__name__}: {e}"}
            self.join_results.put((msg.req_id, name, result))

        thread = threading.Thread(target=join, name=f"tide-join-{name}", daemon=True)
        self.joins[name] = thread
        thread.start()

    def _finish_joins(self) -> None:
        while True:
            try:
                req_id, name, result = self.join_results.get_nowait()
            except queue.Empty:
                return
            thread = self.joins.pop(name, None)
            if thread is not None:
                thread.join()
            self._reply_result(req_id, result)

    # ---- memory occupation (colocated trainer)
    def _handle_memory_occupation(
        self, msg: ReleaseMemoryOccupationReqInput | ResumeMemoryOccupationReqInput
    ) -> None:
        release = isinstance(msg, ReleaseMemoryOccupationReqInput)
        if release and self.pending_updates:
            self._reply(msg.req_id, False,
                        f"{len(self.pending_updates)} weight update(s) wait to apply; release "
                        "memory once they have finished", self._result_data(0))
            return
        engine = self.engine
        try:
            if release:
                result = engine.release_memory_occupation(msg.tags)
            else:
                result = engine.resume_memory_occupation(msg.tags)
        except Exception as e:  # noqa: BLE001 - reported to the caller; the loop keeps serving
            logger.error("%s failed:\n%s", type(msg).__name__, traceback.format_exc())
            name = "release" if release else "resume"
            result = {"success": False, "num_paused_requests": 0,
                      "message": f"{name}_memory_occupation failed: {type(e).__name__}: {e}"}
        self._report_finished()
        self._reply_result(msg.req_id, result, released_bytes=self._released_bytes())

    def _released_bytes(self) -> dict[str, int]:
        occupation = getattr(self.engine, "memory_occupation", None)
        if occupation is None:
            return {}
        return {tag: int(n) for tag, n in occupation.released_bytes().items()}

    def memory_info(self) -> dict[str, Any]:
        """Device memory now (reserved, allocated, their gap) and bytes released per tag."""
        stats = device_memory_stats()
        return {"reserved_bytes": stats["reserved"], "allocated_bytes": stats["allocated"],
                "fragmentation_bytes": max(0, stats["reserved"] - stats["allocated"]),
                "source": stats["source"], "released_bytes": self._released_bytes()}

    # ---- replies
    def _result_data(self, num_paused_requests: int, **extra: Any) -> dict[str, Any]:
        return {"num_paused_requests": num_paused_requests, "paused": self.scheduler.paused,
                "weight_version": self.scheduler.weight_version, **extra}

    def _reply_result(self, req_id: str, result: dict[str, Any], **extra: Any) -> None:
        """Reply with an `Engine` handover result ({success, message, num_paused_requests})."""
        data = self._result_data(int(result.get("num_paused_requests", 0)), **extra)
        self._reply(req_id, bool(result["success"]), str(result["message"]), data)

    def _reply(self, req_id: str, success: bool, message: str = "", data: dict | None = None) -> None:
        out = ControlReqOutput(req_id=req_id, success=success, message=message, data=data or {})
        self.send_sock.send(encode_message(out))

    def _send_finished(self, rid: str, reason: dict[str, Any]) -> None:
        out = BatchTokenIDOut([rid], [[]], [[]], [[]], [reason], [0],
                              [self.scheduler.weight_version])
        self.send_sock.send(encode_message(out))

    def _send_outputs(self, reqs: list[Any]) -> None:
        rids: list[str] = []
        new_ids: list[list[int]] = []
        new_lps: list[list[float]] = []
        new_tops: list[list[list[tuple[float, int]]]] = []
        reasons: list[dict[str, Any] | None] = []
        cached: list[int] = []
        versions: list[str | None] = []
        for req in reqs:
            start = self.sent_len.get(req.rid, 0)
            rids.append(req.rid)
            new_ids.append(req.output_ids[start:])
            if req.return_logprob:
                new_lps.append([lp for lp, _ in req.output_token_logprobs[start:]])
                new_tops.append(
                    [list(t) for t in req.output_top_logprobs[start:]]
                    if req.top_logprobs_num > 0
                    else []
                )
            else:
                new_lps.append([])
                new_tops.append([])
            reasons.append(req.finished_reason)
            cached.append(req.cached_tokens)
            versions.append(req.weight_version if req.finished and req.weight_version is not None
                            else self.scheduler.weight_version)
            if req.finished:
                self.sent_len.pop(req.rid, None)
                self.live.pop(req.rid, None)
            else:
                self.sent_len[req.rid] = len(req.output_ids)
        out = BatchTokenIDOut(rids, new_ids, new_lps, new_tops, reasons, cached, versions)
        self.send_sock.send(encode_message(out))

    # ---- info
    def static_info(self) -> dict[str, Any]:
        engine = self.engine
        mc = engine.model_config
        info = dict(engine.get_server_info())
        info.update(
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            eos_token_ids=list(engine.eos_token_ids),
            max_running_requests=engine.config.max_running_requests,
            scheduler_pid=os.getpid(),
            weight_version=engine.scheduler.weight_version,
        )
        return info

    def load_info(self) -> dict[str, Any]:
        sched = self.scheduler
        stats = sched.stats
        total = sched.max_total_tokens
        free = sched.allocator.available_size()
        cached = sched.tree_cache.total_size()
        try:
            sched.check_invariants()
            invariants_ok = True
        except RuntimeError as e:
            logger.error("%s", e)
            invariants_ok = False
        return {
            "num_running_reqs": sched.num_running(),
            "num_queued_reqs": sched.num_queued(),
            "max_total_tokens": total,
            "kv_free_slots": free,
            "kv_cached_slots": cached,
            "kv_evictable_slots": sched.tree_cache.evictable_size(),
            "kv_used_slots": total - free,
            "kv_held_slots": total - free - cached,
            "num_prefill_tokens": stats.num_prefill_tokens,
            "num_cached_tokens": stats.num_cached_tokens,
            "num_generated_tokens": stats.num_generated_tokens,
            "num_retractions": stats.num_retractions,
            "invariants_ok": invariants_ok,
            "weight_version": sched.weight_version,
            "paused": sched.paused,
            "admission_blocked": sched.admission_blocked,
            "num_pending_weight_updates": len(self.pending_updates),
            "weight_update_groups": sorted(self.engine.weight_updater.groups),
            "num_weight_update_joins": len(self.joins),
            "num_threads": _num_threads(),
            "memory_ledger": MEMORY_LEDGER.totals(),
            "memory": self.memory_info(),
        }


def _config_kwargs(config: EngineConfig) -> dict[str, Any]:
    import dataclasses

    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    kwargs.pop("model_path")
    return kwargs


def _num_threads() -> int:
    """This process's threads, native ones included (Linux), else the Python threads."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _die_with_parent(parent_pid: int, ipc_dir: str | None) -> None:
    """Exit, removing `ipc_dir`, when the parent exits: Linux sends SIGTERM (PR_SET_PDEATHSIG; the
    handler exits through the `finally` that removes the directory), and a watcher thread checks
    the parent pid, for when the main thread cannot take the signal (stuck in native code)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass

    def orphaned() -> None:
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(0)

    if os.getppid() != parent_pid:  # parent died before prctl took effect
        orphaned()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_CHECK_S)
        logger.warning("parent process %d is gone; scheduler exits", parent_pid)
        time.sleep(2.0)  # give the SIGTERM path its chance to exit cleanly first
        orphaned()

    threading.Thread(target=watch, name="tide-parent-watch", daemon=True).start()


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s [scheduler] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("tide").setLevel(level.upper())
