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
  stepping and streaming, until no request holds KV (or generation is paused), then the handover
  applies it at once and the reply goes out. Updates apply in arrival order; requests that
  arrive meanwhile queue behind them.
- `pause_generation`, `continue_generation`, `update_weight_version`, `get_weights_by_name`,
  `destroy_weights_update_group`, `release_memory_occupation`, `resume_memory_occupation` and
  `dump_memory_timeline` are immediate. A release is refused while a weight update waits to apply
  (and while requests run and are not paused). While memory is released the loop does not step.
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

The process is transport only: it decodes a message, calls the scheduler or its `Handover` (which own
every decision above), and encodes the reply. It holds the scheduler side of one engine (model, KV
pools, scheduler, tokenizer for stop strings, memory ledger) and never talks HTTP. It exits when asked
(`ShutdownReq`), when its parent dies (PR_SET_PDEATHSIG delivers SIGTERM on Linux, and a watcher
thread checks the parent pid), or on SIGTERM; however it
exits it removes the zmq `ipc://` directory it was given. SIGINT is ignored: a Ctrl-C in a terminal
reaches the whole process group, and the parent decides how to shut down (abort, reply, then exit).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import zmq

from tide.config import EngineConfig
from tide.io_struct import (
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
    SchedulerInput,
    SchedulerReady,
    ShutdownReq,
    StartProfileReqInput,
    StopProfileReqInput,
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
from tide.memory.observe import device_memory_stats
from tide.sampling_params import SamplingParams
from tide.scheduler.handover import (
    DiskUpdate,
    DistributedUpdate,
    HandoverResult,
    IPCUpdate,
    TensorUpdate,
    WeightUpdate,
)
from tide.scheduler.profile import ProfileOptions
from tide.scheduler.request import FinishReason, Req
from tide.scheduler.scheduler import Scheduler, create_scheduler

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
    StopProfileReqInput: "stop_profile",
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
    """Entry point of the spawned process: build the scheduler side, report readiness, run the loop.
    `ipc_dir` (the directory of the `ipc://` sockets) is removed however the process exits."""
    handle_exit_signals(ipc_dir)
    die_with_parent(parent_pid, ipc_dir)
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
        scheduler = create_scheduler(config, weight_version)
        proc = SchedulerProcess(scheduler, input_addr, output_addr, parent_pid, heartbeat_interval)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which prints it and exits
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        logger.debug("scheduler start-up failed:\n%s", traceback.format_exc())
        ready.send_bytes(encode_message(SchedulerReady(error=msg)))
        ready.close()
        return
    info = proc.static_info()
    scheduler.ledger.mark("scheduler_ready", f"pid {os.getpid()}, {info['max_total_tokens']} KV slots")
    ready.send_bytes(encode_message(SchedulerReady(info=info)))
    ready.close()
    try:
        proc.run()
    finally:
        proc.close()
        scheduler.worker.shutdown()


class SchedulerProcess:
    """Runs `scheduler` against the zmq channel to the HTTP process."""

    def __init__(self, scheduler: Scheduler, input_addr: str, output_addr: str, parent_pid: int,
                 heartbeat_interval: float = 1.0) -> None:
        self.scheduler = scheduler
        self.handover = scheduler.handover
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
        self.live: dict[str, Req] = {}  # rid -> Req, until its finish has been sent
        self.sent_len: dict[str, int] = {}  # rid -> output tokens already sent
        self.pending_flushes: list[_PendingFlush] = []
        self.joins: dict[str, threading.Thread] = {}  # group_name -> joining thread
        self.join_results: queue.SimpleQueue[tuple[str, str, HandoverResult]] = queue.SimpleQueue()
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
        self._apply_ready_updates()
        if self.scheduler.can_step():
            # While an update waits, the scheduler still finishes a half-prefilled (chunked) prompt.
            try:
                reqs = self.scheduler.step()
            except Exception as e:  # noqa: BLE001 - a bug or device error: fail them, keep serving
                logger.error("scheduler step failed:\n%s", traceback.format_exc())
                self._abort_everything(f"internal error in scheduler step: {type(e).__name__}: {e}")
                self._exit_if_broken()
                return
            # A request a handover call already reported finished (it got its last token while a
            # launched step was settled) is not sent twice.
            reqs = [r for r in reqs if self.live.get(r.rid) is r]
            if reqs:
                self._send_outputs(reqs)
            self._exit_if_broken()
        self._retry_flushes()

    def _exit_if_broken(self) -> None:
        """A model worker that can never step again (a tensor-parallel rank is gone, or its forward
        failed) fails every request at once: this process exits instead, so the server (or a
        data-parallel router, which then serves on the other replicas) sees it dead."""
        broken = getattr(self.scheduler.worker, "broken", None)
        if broken is not None and self.running:
            logger.error("the model worker is broken for good (%s); the scheduler exits", broken)
            self._abort_everything(f"the model worker is broken: {broken}")
            self.running = False

    def _has_ready_work(self) -> bool:
        return self.scheduler.can_step() or self.handover.update_ready()

    def _apply_ready_updates(self) -> None:
        """Apply the queued weight updates whose turn has come, each declared to the heartbeat as a
        long operation; each reply goes out from the update's `on_done`."""
        handover = self.handover
        while handover.update_ready():
            source = handover.pending_updates[0].update.source
            with self.progress.operation_scope(f"update_weights_from_{source}"):
                handover.apply_next_update()

    def _abort_everything(self, message: str) -> None:
        """Finish every live request with an abort, including any a failed step left in limbo."""
        aborted = self.scheduler.abort(None, message=message)
        if aborted:
            self._send_outputs(aborted)
        for rid in list(self.sent_len):  # requests the scheduler no longer knows about
            self.sent_len.pop(rid)
            self.live.pop(rid, None)
            self._send_finished(rid, {"type": "abort", "message": message})

    def _report_finished(self) -> None:
        """Send the finish of every tracked request a handover call finished (e.g. pause abort)."""
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
            except Exception as e:  # noqa: BLE001 - a bad message must not take the loop down
                logger.error("dropping undecodable message: %s", e)
                continue
            operation = _LONG_OPERATIONS.get(type(msg))
            try:
                if operation is None:
                    self._dispatch(msg)
                else:
                    with self.progress.operation_scope(operation):
                        self._dispatch(msg)
            except Exception as e:  # noqa: BLE001 - one bad call must not take the server down
                logger.error("handling %s failed:\n%s", type(msg).__name__, traceback.format_exc())
                req_id = getattr(msg, "req_id", None)
                if isinstance(req_id, str):
                    self._reply(req_id, False, f"internal error: {type(e).__name__}: {e}")

    def _dispatch(self, msg: SchedulerInput) -> None:
        handover = self.handover
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
            self._reply_result(msg.req_id, handover.pause_generation(msg.mode))
        elif isinstance(msg, ContinueGenerationReqInput):
            self._reply_result(msg.req_id, handover.continue_generation(msg.torch_empty_cache))
        elif isinstance(msg, UpdateWeightVersionReqInput):
            result = handover.update_weight_version(msg.new_version, msg.abort_all_requests)
            self._reply_result(msg.req_id, result, new_version=handover.weight_version)
        elif isinstance(msg, ReleaseMemoryOccupationReqInput):
            self._reply_result(msg.req_id, handover.release_memory_occupation(msg.tags),
                               released_bytes=handover.released_bytes())
        elif isinstance(msg, ResumeMemoryOccupationReqInput):
            self._reply_result(msg.req_id, handover.resume_memory_occupation(msg.tags),
                               released_bytes=handover.released_bytes())
        elif isinstance(msg, DumpMemoryTimelineReqInput):
            self._reply(msg.req_id, True, data={"timeline": self.scheduler.ledger.to_dict()})
        elif isinstance(msg, StartProfileReqInput):
            self._handle_start_profile(msg)
        elif isinstance(msg, StopProfileReqInput):
            try:
                paths = self.scheduler.stop_profile()
            except Exception as e:  # noqa: BLE001 - the reply says why; the loop goes on
                self._reply(msg.req_id, False, f"{type(e).__name__}: {e}")
            else:
                self._reply(msg.req_id, True, "profile stopped", data={"paths": paths})
        elif isinstance(msg, GetWeightsByNameReqInput):
            try:
                values = handover.get_weights_by_name(msg.name, msg.truncate_size)
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
                self._reply_result(msg.req_id, handover.destroy_weights_update_group(msg.group_name))
        elif isinstance(msg, ShutdownReq):
            self._abort_everything("server shutting down")
            handover.cancel_pending_updates("server shutting down")
            self._reply(msg.req_id, True, "scheduler stopped")
            self.running = False

    # ---- handlers
    def _handle_generate(self, msg: TokenizedGenerateReqInput) -> None:
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
            logprob_start_len=msg.logprob_start_len,
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

    # ---- handover: weight updates and trainer groups
    def _handle_weight_update(self, msg: WeightUpdateReq) -> None:
        """Validated now (a bad request is answered at once); applied when its turn comes."""

        def on_done(result: HandoverResult) -> None:
            self._reply_result(msg.req_id, result)

        self.handover.submit_update(_weight_update(msg), msg, on_done)
        self._report_finished()  # requests its abort_all_requests finished

    def _handle_start_profile(self, msg: StartProfileReqInput) -> None:
        """A bad option is refused naming its field (`data["param"]`); a running profile too."""
        try:
            options = ProfileOptions(  # the default directory: a request never picks a path
                num_steps=msg.num_steps,
                activities=None if msg.activities is None else tuple(msg.activities),
                record_shapes=msg.record_shapes, with_stack=msg.with_stack,
                profile_id=msg.profile_id)
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            self._reply(msg.req_id, False, str(e), data={"param": param})
            return
        try:
            self.scheduler.start_profile(options)
        except Exception as e:  # noqa: BLE001 - the reply says why; the loop goes on
            self._reply(msg.req_id, False, f"{type(e).__name__}: {e}")
            return
        self._reply(msg.req_id, True, f"profiling to {options.output_dir} as {options.profile_id}",
                    data={"profile_id": options.profile_id, "output_dir": options.output_dir})

    def _handle_init_group(self, msg: InitWeightsUpdateGroupReqInput) -> None:
        name = msg.group_name
        if name in self.joins or self.handover.has_group(name):
            self._reply(msg.req_id, False, f"group_name {name!r} already exists; destroy it first")
            return
        if len(self.joins) >= MAX_CONCURRENT_JOINS:
            self._reply(msg.req_id, False, f"{len(self.joins)} joins are in progress (at most "
                        f"{MAX_CONCURRENT_JOINS}); retry once one has finished")
            return

        def join() -> None:
            try:
                result = self.handover.init_weights_update_group(
                    msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                    group_name=name, backend=msg.backend, timeout=msg.timeout,
                )
            except Exception as e:  # noqa: BLE001 - reported to the caller
                result = HandoverResult(
                    False, f"init_weights_update_group failed: {type(e).__name__}: {e}")
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

    def memory_info(self) -> dict[str, Any]:
        """Device memory now (reserved, allocated, their gap) and bytes released per tag."""
        stats = device_memory_stats()
        return {"reserved_bytes": stats["reserved"], "allocated_bytes": stats["allocated"],
                "fragmentation_bytes": max(0, stats["reserved"] - stats["allocated"]),
                "source": stats["source"], "released_bytes": self.handover.released_bytes()}

    # ---- replies
    def _reply_result(self, req_id: str, result: HandoverResult, **extra: Any) -> None:
        """Reply with a handover result (sglang's success, message, num_paused_requests)."""
        self._report_finished()  # requests the call finished (pause mode=abort, ...) go first
        data = {"num_paused_requests": result.num_paused_requests,
                "paused": self.handover.paused, "weight_version": self.handover.weight_version,
                **extra}
        self._reply(req_id, result.success, result.message, data)

    def _reply(self, req_id: str, success: bool, message: str = "", data: dict | None = None) -> None:
        out = ControlReqOutput(req_id=req_id, success=success, message=message, data=data or {})
        self.send_sock.send(encode_message(out))

    def _send_finished(self, rid: str, reason: FinishReason) -> None:
        out = BatchTokenIDOut([rid], [[]], [[]], [[]], [reason], [0],
                              [self.handover.weight_version])
        self.send_sock.send(encode_message(out))

    def _send_outputs(self, reqs: list[Req]) -> None:
        rids: list[str] = []
        new_ids: list[list[int]] = []
        new_lps: list[list[float]] = []
        new_tops: list[list[list[tuple[float, int]]]] = []
        reasons: list[FinishReason | None] = []
        cached: list[int] = []
        versions: list[str | None] = []
        input_lps: list[list[float | None]] = []
        input_tops: list[list[list[tuple[float, int]] | None]] = []
        for req in reqs:
            # Input logprobs are complete once the prompt is prefilled: sent with the first output
            # (nothing of a request aborted before that).
            if (req.wants_input_logprobs and req.input_score_first() is None
                    and self.sent_len.get(req.rid, 0) == 0):
                input_lps.append([lp for lp, _ in req.input_token_logprobs])
                input_tops.append([None if t is None else list(t)
                                   for t in req.input_top_logprobs])
            else:
                input_lps.append([])
                input_tops.append([])
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
                            else self.handover.weight_version)
            if req.finished:
                self.sent_len.pop(req.rid, None)
                self.live.pop(req.rid, None)
            else:
                self.sent_len[req.rid] = len(req.output_ids)
        if not any(input_lps):
            input_lps, input_tops = [], []
        out = BatchTokenIDOut(rids, new_ids, new_lps, new_tops, reasons, cached, versions,
                              input_lps, input_tops)
        self.send_sock.send(encode_message(out))

    # ---- info
    def static_info(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            **sched.server_info(),
            "eos_token_ids": sorted(sched.eos_token_ids),
            "max_running_requests": sched.config.max_running_requests,
            "scheduler_pid": os.getpid(),
            "weight_version": self.handover.weight_version,
        }

    def load_info(self) -> dict[str, Any]:
        sched = self.scheduler
        stats = sched.stats
        total = sched.max_total_tokens
        pools = sched.kv_pools()
        free = pools["full"]["free"]
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
            "kv_pools": pools,
            "num_prefill_tokens": stats.num_prefill_tokens,
            "num_cached_tokens": stats.num_cached_tokens,
            "num_generated_tokens": stats.num_generated_tokens,
            "num_retractions": stats.num_retractions,
            "invariants_ok": invariants_ok,
            "weight_version": self.handover.weight_version,
            "paused": self.handover.paused,
            "memory_blocked": self.handover.memory_block_reason,
            "admission_blocked": self.handover.admission_blocked,
            "num_pending_weight_updates": len(self.handover.pending_updates),
            "weight_update_groups": self.handover.group_names(),
            "num_weight_update_joins": len(self.joins),
            "num_threads": _num_threads(),
            "grammar_cache_bytes": sched.grammar_cache_bytes(),
            "memory_ledger": sched.ledger.totals(),
            "memory": self.memory_info(),
            "ranks": sched.worker.rank_memory(),
        }


def _weight_update(msg: WeightUpdateReq) -> WeightUpdate:
    """The handover's request for an update message."""
    if isinstance(msg, UpdateWeightFromDiskReqInput):
        return DiskUpdate(msg.model_path, msg.load_format)
    if isinstance(msg, UpdateWeightsFromTensorReqInput):
        return TensorUpdate(serialized_named_tensors=msg.serialized_named_tensors,
                            load_format=msg.load_format)
    if isinstance(msg, UpdateWeightsFromIPCReqInput):
        return IPCUpdate(msg.serialized_buckets)
    return DistributedUpdate(msg.names, msg.dtypes, msg.shapes, msg.group_name, msg.load_format)


def _num_threads() -> int:
    """This process's threads, native ones included (Linux), else the Python threads."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def handle_exit_signals(ipc_dir: str | None) -> None:
    """SIGINT is ignored (the server's Ctrl-C reaches the whole group; the server stops this process).
    SIGTERM removes `ipc_dir` at once, before the teardown that follows could hang or crash in native
    code, then exits through the `finally` blocks. A native crash prints its traceback (faulthandler)."""
    faulthandler.enable()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        sys.exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)


def die_with_parent(parent_pid: int, ipc_dir: str | None) -> None:
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
