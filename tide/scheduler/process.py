"""The scheduler subprocess of `tide serve`: model runner + scheduler behind two zmq sockets.

Loop (`SchedulerProcess.run`):

    while running:
        take every waiting message (block on the socket only when there is no work)
        if there is work: step once and send the new tokens of every request that got one

The process owns a full in-process `Engine` (model, KV pools, scheduler, tokenizer for stop strings)
and never talks HTTP. It exits when asked (`ShutdownReq`), when its parent dies (PR_SET_PDEATHSIG on
Linux, plus a parent-pid check while idle), or on SIGTERM. SIGINT is ignored: a Ctrl-C in a terminal
reaches the whole process group, and the parent decides how to shut down (abort, reply, then exit).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from tide.config import EngineConfig
from tide.server.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReqOutput,
    FlushCacheReqInput,
    GetLoadReqInput,
    GetServerInfoReqInput,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReqInput,
    decode_input,
    encode_message,
)

logger = logging.getLogger("tide.scheduler.process")

_IDLE_POLL_MS = 1000  # how often an idle loop checks that the parent is alive
_PR_SET_PDEATHSIG = 1


@dataclass
class _PendingFlush:
    req_id: str
    deadline: float


def run_scheduler_process(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, ready: Connection
) -> None:
    """Entry point of the spawned process: build the engine, report readiness, run the loop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _setup_logging(config.log_level)
    try:
        from tide.engine import Engine

        engine = Engine(config.model_path, **_config_kwargs(config))
        proc = SchedulerProcess(engine, input_addr, output_addr, parent_pid)
    except Exception as e:  # reported to the parent, which prints it and exits
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        logger.debug("scheduler start-up failed:\n%s", traceback.format_exc())
        ready.send_bytes(encode_message(SchedulerReady(error=msg)))
        ready.close()
        return
    ready.send_bytes(encode_message(SchedulerReady(info=proc.static_info())))
    ready.close()
    try:
        proc.run()
    finally:
        proc.close()


class SchedulerProcess:
    """Runs `engine.scheduler` against the zmq channel to the HTTP process."""

    def __init__(self, engine: Any, input_addr: str, output_addr: str, parent_pid: int) -> None:
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
        self.sent_len: dict[str, int] = {}  # rid -> output tokens already sent
        self.pending_flushes: list[_PendingFlush] = []
        self.running = True

    # ---- loop
    def run(self) -> None:
        while self.running:
            self._recv_requests(block=not self.scheduler.has_work() and not self.pending_flushes)
            if not self.running:
                break
            if self.scheduler.has_work():
                try:
                    reqs = self.scheduler.step()
                except Exception as e:  # a bug or device error: fail the requests, keep serving
                    logger.error("scheduler step failed:\n%s", traceback.format_exc())
                    self._abort_everything(f"internal error in scheduler step: {type(e).__name__}: {e}")
                    continue
                if reqs:
                    self._send_outputs(reqs)
            self._retry_flushes()

    def _abort_everything(self, message: str) -> None:
        """Finish every live request with an abort, including any a failed step left in limbo."""
        aborted = self.scheduler.abort(None, message=message)
        if aborted:
            self._send_outputs(aborted)
        for rid in list(self.sent_len):  # requests the scheduler no longer knows about
            self.sent_len.pop(rid)
            self._send_finished(rid, {"type": "abort", "message": message})

    def close(self) -> None:
        self.recv_sock.close(linger=0)
        self.send_sock.close()
        self.ctx.term()

    def _recv_requests(self, block: bool) -> None:
        if block:
            timeout = _IDLE_POLL_MS
            if self.pending_flushes:
                timeout = 50
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
        elif isinstance(msg, ShutdownReq):
            self._abort_everything("server shutting down")
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

    # ---- replies
    def _reply(self, req_id: str, success: bool, message: str = "", data: dict | None = None) -> None:
        out = ControlReqOutput(req_id=req_id, success=success, message=message, data=data or {})
        self.send_sock.send(encode_message(out))

    def _send_finished(self, rid: str, reason: dict[str, Any]) -> None:
        out = BatchTokenIDOut([rid], [[]], [[]], [[]], [reason], [0])
        self.send_sock.send(encode_message(out))

    def _send_outputs(self, reqs: list[Any]) -> None:
        rids: list[str] = []
        new_ids: list[list[int]] = []
        new_lps: list[list[float]] = []
        new_tops: list[list[list[tuple[float, int]]]] = []
        reasons: list[dict[str, Any] | None] = []
        cached: list[int] = []
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
            if req.finished:
                self.sent_len.pop(req.rid, None)
            else:
                self.sent_len[req.rid] = len(req.output_ids)
        out = BatchTokenIDOut(rids, new_ids, new_lps, new_tops, reasons, cached)
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
        }


def _config_kwargs(config: EngineConfig) -> dict[str, Any]:
    import dataclasses

    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    kwargs.pop("model_path")
    return kwargs


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(0)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s [scheduler] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("tide").setLevel(level.upper())
