"""`tide serve --dp-size N`: one process between the HTTP side and N scheduler processes.

    tide serve (HTTP process: TokenizerManager)          the same server as with one engine
      └── tide-dp-controller (this module)                speaks the scheduler's wire protocol upward
            ├── tide-scheduler replica 0  (cuda:0, or cpu)
            └── tide-scheduler replica N-1

To the HTTP side the controller looks exactly like one scheduler process (the same zmq sockets,
messages and heartbeats), so the server needs no change beyond choosing which process to start.
Downward each replica is an ordinary scheduler process (`tide.scheduler.process`) with its own pair
of `ipc://` sockets.

- **Generation**: each request goes to the live replica with the fewest outstanding requests
  (`tide.cluster.router.Router`); its outputs are passed up unchanged.
- **Control and handover messages** (flush, load, info, pause/continue, weight updates, groups,
  versions, release/resume, memory timeline, shutdown) go to every live replica, each copy with its
  own `req_id`; once all have answered, one merged reply goes up (`merge_replies`; load and info
  counters add up and carry a per-replica list under `replicas`). `init_weights_update_group` gives
  the `k`-th live replica the rank offset `rank_offset + k * tp_size` (`group_rank_offsets`).
- **Liveness**: the controller sends one heartbeat up for each replica heartbeat, whose turn count is
  the sum of the live replicas' (it moves while any replica turns) and whose operation is any
  replica's declared long operation.
- **A replica that dies** (its process exits, or it shows no progress for the server's
  `--scheduler-abort-timeout` and is killed) is marked dead and never picked again; its in-flight
  requests finish with reason `abort` and a message naming the replica; control calls waiting on it
  fail with that message; the other replicas keep serving. `/get_server_info` lists every replica
  (`alive`, `dead_reason`), `/metrics` has `tide:dp_replicas_alive`. When the last replica dies the
  controller exits, and the server with it (as with one scheduler).

Devices: with `device` auto or cuda and at least `dp_size x tp_size` visible GPUs, replica `i` sees
only its own `tp_size` GPUs (`CUDA_VISIBLE_DEVICES`); with fewer GPUs and `device` auto every replica
runs on CPU; `device=cpu` puts every replica on CPU.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tide.cluster.router import (
    NoLiveReplicaError,
    ReplicaReply,
    Router,
    group_rank_offsets,
    merge_replies,
)
from tide.config import EngineConfig
from tide.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReqOutput,
    GetLoadReqInput,
    GetServerInfoReqInput,
    InitWeightsUpdateGroupReqInput,
    SchedulerHeartbeat,
    SchedulerInput,
    SchedulerReady,
    ShutdownReq,
    StartProfileReqInput,
    StopProfileReqInput,
    TokenizedGenerateReqInput,
    decode_input,
    decode_output,
    encode_message,
)

logger = logging.getLogger("tide.cluster.dp_controller")

_POLL_MS = 250  # how often the loop checks the replica processes, at most
# Load and info answer with the replicas that replied within this many seconds (a frozen replica
# must not make /metrics and /get_server_info wait, nor leave their fan-outs pending forever).
_INFO_DEADLINE_S = 3.0
_SHUTDOWN_DEADLINE_S = 3.0  # for the replicas' shutdown acknowledgements
MAX_DP_SIZE = 64

# Load counters that add up over replicas (each counts its own requests, slots and tokens).
LOAD_COUNTERS = (
    "num_running_reqs", "num_queued_reqs", "max_total_tokens", "kv_free_slots", "kv_cached_slots",
    "kv_evictable_slots", "kv_used_slots", "kv_held_slots", "num_prefill_tokens",
    "num_cached_tokens", "num_generated_tokens", "num_retractions", "num_pending_weight_updates",
    "num_weight_update_joins", "num_threads", "grammar_cache_bytes",
)
_MEMORY_COUNTERS = ("reserved_bytes", "allocated_bytes", "fragmentation_bytes")
# What each replica's entry in `replicas` shows of its own load.
_REPLICA_FIELDS = ("num_running_reqs", "num_queued_reqs", "max_total_tokens", "kv_used_slots",
                   "weight_version", "paused", "invariants_ok")


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where replica `index` runs: its engine config and, on GPU, its `CUDA_VISIBLE_DEVICES`."""

    index: int
    config: EngineConfig
    visible_devices: str | None = None


def plan_replicas(config: EngineConfig, dp_size: int) -> list[ReplicaPlacement]:
    """One placement per replica (see the module docstring); replica i's config has `dp_rank` i,
    so replicas draw unseeded samples from different streams. ValueError naming `device` when an
    explicit cuda device cannot give every replica its own GPUs."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or not 1 <= dp_size <= MAX_DP_SIZE:
        raise ValueError(f"dp_size must be an integer in [1, {MAX_DP_SIZE}], got {dp_size!r}")
    tp_size = int(getattr(config, "tp_size", 1))
    if config.device == "cpu":
        return [ReplicaPlacement(i, config.replace(dp_rank=i)) for i in range(dp_size)]
    if config.device not in ("auto", "cuda"):
        raise ValueError(f"device {config.device!r}: with dp_size > 1 use auto, cuda or cpu "
                         "(each replica is given its own GPUs)")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = dp_size * tp_size
    if count < needed:
        if config.device == "cuda":
            raise ValueError(f"device cuda: dp_size {dp_size} x tp_size {tp_size} needs {needed} "
                             f"GPUs and {count} are visible")
        if count:
            logger.warning("dp_size %d x tp_size %d needs %d GPUs and %d are visible: every "
                           "replica runs on CPU", dp_size, tp_size, needed, count)
        return [ReplicaPlacement(i, config.replace(device="cpu", dp_rank=i))
                for i in range(dp_size)]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in env.split(",")] if env else [str(i) for i in range(count)]
    return [ReplicaPlacement(i, config.replace(device="cuda", dp_rank=i),
                             ",".join(visible[i * tp_size:(i + 1) * tp_size]))
            for i in range(dp_size)]


@dataclass
class _FanOut:
    """A control message sent to several replicas, waiting for all their replies."""

    msg: SchedulerInput
    waiting: set[int]
    replies: list[ReplicaReply] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    deadline: float | None = None  # answer with the replies so far at this time (monotonic)


@contextmanager
def _visible_devices(value: str | None) -> Iterator[None]:
    """`CUDA_VISIBLE_DEVICES` set to `value` while a child process is started (it inherits it)."""
    if value is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def run_dp_controller_process(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    ready: Connection,
    weight_version: str | None = None,
    heartbeat_interval: float = 1.0,
    ipc_dir: str | None = None,
    dp_size: int = 2,
    startup_timeout: float = 600.0,
    replica_stall_timeout: float = 120.0,
) -> None:
    """Entry point of the spawned controller (the same arguments as `run_scheduler_process`, plus
    `dp_size` and `replica_stall_timeout`, the server's `--scheduler-abort-timeout`): start the
    replicas, report readiness once all are ready, route until shutdown. However it exits, it stops
    its replicas and removes `ipc_dir`."""
    from tide.scheduler.process import die_with_parent, handle_exit_signals

    handle_exit_signals(ipc_dir)
    die_with_parent(parent_pid, ipc_dir)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s [dp-controller] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("tide").setLevel(config.log_level.upper())
    procs: list[Any] = []
    controller: DataParallelController | None = None
    try:
        try:
            placements = plan_replicas(config, dp_size)
            if ipc_dir is None:
                raise ValueError("ipc_dir: the controller needs a directory for its sockets")
            controller = DataParallelController(len(placements), input_addr, output_addr, ipc_dir,
                                                int(getattr(config, "tp_size", 1)),
                                                replica_stall_timeout)
            procs = _start_replicas(placements, controller, weight_version, heartbeat_interval)
            info = _wait_replicas_ready(procs, startup_timeout)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which prints it and exits
            ready.send_bytes(encode_message(SchedulerReady(error=str(e))))
            ready.close()
            return
        controller.procs = [proc for proc, _ in procs]
        controller.devices = [(p.config.device, p.visible_devices) for p in placements]
        ready.send_bytes(encode_message(SchedulerReady(info=info)))
        ready.close()
        controller.run()
    finally:
        if controller is not None:
            controller.close()
        start = time.monotonic()
        _stop_replicas([proc for proc, _ in procs])
        logger.info("replicas stopped in %.1f s; the controller exits", time.monotonic() - start)
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _start_replicas(placements: list[ReplicaPlacement], controller: DataParallelController,
                    weight_version: str | None, heartbeat_interval: float
                    ) -> list[tuple[Any, Connection]]:
    from tide.scheduler.process import run_scheduler_process

    ctx = mp.get_context("spawn")
    started: list[tuple[Any, Connection]] = []
    for placement in placements:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(placement.config, controller.replica_inputs[placement.index],
                  controller.replica_outputs[placement.index], os.getpid(), send, weight_version),
            kwargs={"heartbeat_interval": heartbeat_interval},
            name=f"tide-scheduler-{placement.index}", daemon=False,
        )
        with _visible_devices(placement.visible_devices):
            proc.start()
        send.close()
        started.append((proc, recv))
        logger.info("replica %d: scheduler pid %d on %s%s", placement.index, proc.pid,
                    placement.config.device,
                    f" (CUDA_VISIBLE_DEVICES={placement.visible_devices})"
                    if placement.visible_devices else "")
    return started


def _wait_replicas_ready(procs: list[tuple[Any, Connection]], timeout: float) -> dict[str, Any]:
    """Every replica's readiness; the first replica's facts, with the smallest KV pool (a request
    must fit the replica it lands on) and the replicas' pids. Raises with the first failure."""
    deadline = time.monotonic() + timeout
    infos: list[dict[str, Any]] = []
    for index, (proc, conn) in enumerate(procs):
        while True:
            if conn.poll(0.25):
                try:
                    msg = msgspec.msgpack.decode(conn.recv_bytes(), type=SchedulerReady)
                except EOFError:
                    raise RuntimeError(f"replica {index} exited during start-up (exit code "
                                       f"{proc.exitcode})") from None
                if msg.error is not None:
                    raise RuntimeError(f"replica {index}: {msg.error}")
                infos.append(dict(msg.info))
                break
            if not proc.is_alive():
                raise RuntimeError(f"replica {index} exited during start-up (exit code "
                                   f"{proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {index} did not get ready within {timeout:.0f} s")
    info = dict(infos[0])
    info["max_total_tokens"] = min(int(i["max_total_tokens"]) for i in infos)
    info["dp_size"] = len(infos)
    info["replica_pids"] = [i.get("scheduler_pid") for i in infos]
    info["scheduler_pid"] = os.getpid()
    return info


def _stop_replicas(procs: list[Any], timeout: float = 5.0) -> None:
    """Wait up to `timeout` for the replicas to exit, then SIGTERM, then SIGKILL. A stopped
    (SIGSTOP) replica is killed at once: it would take neither signal before it is continued, so
    it would outlive the server."""
    for proc in procs:
        if proc.is_alive() and _is_stopped(proc.pid):
            proc.kill()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _is_stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped (Linux; False where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class DataParallelController:
    """Routes the HTTP side's messages over the replicas and merges their answers (see the module
    docstring). Single-threaded: everything happens in `run`."""

    def __init__(self, num_replicas: int, input_addr: str, output_addr: str, ipc_dir: str,
                 tp_size: int = 1, stall_timeout: float = 120.0) -> None:
        self.router = Router(num_replicas)
        self.tp_size = tp_size
        self.stall_timeout = stall_timeout
        self.procs: list[Any] = []
        self.devices: list[tuple[str, str | None]] = []  # (device, CUDA_VISIBLE_DEVICES) per replica
        self.ctx = zmq.Context(1)
        self.up_recv = self._socket(zmq.PULL, bind=input_addr)
        self.up_send = self._socket(zmq.PUSH, connect=output_addr)
        self.replica_inputs = [f"ipc://{os.path.join(ipc_dir, f'replica{i}_input')}"
                               for i in range(num_replicas)]
        self.replica_outputs = [f"ipc://{os.path.join(ipc_dir, f'replica{i}_output')}"
                                for i in range(num_replicas)]
        self.down_send = [self._socket(zmq.PUSH, connect=a) for a in self.replica_inputs]
        self.down_recv = [self._socket(zmq.PULL, bind=a) for a in self.replica_outputs]
        self.poller = zmq.Poller()
        self.poller.register(self.up_recv, zmq.POLLIN)
        for sock in self.down_recv:
            self.poller.register(sock, zmq.POLLIN)
        self.rid_replica: dict[str, int] = {}  # in-flight request -> the replica running it
        self.pending: dict[str, _FanOut] = {}  # the HTTP side's req_id -> its fan-out
        self.beats: dict[int, SchedulerHeartbeat] = {}
        self.last_beat: dict[int, float] = {}
        # when each replica last showed progress: a new turn count, a declared operation, an output
        self.last_progress = {i: time.monotonic() for i in range(num_replicas)}
        self.running = True

    def _socket(self, kind: int, bind: str | None = None, connect: str | None = None) -> Any:
        sock = self.ctx.socket(kind)
        if kind == zmq.PULL:
            sock.setsockopt(zmq.RCVHWM, 0)
        else:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
        return sock

    def close(self) -> None:
        for sock in [self.up_recv, self.up_send, *self.down_send, *self.down_recv]:
            sock.close(linger=0)
        self.ctx.term()

    # ---- loop
    def run(self) -> None:
        start = time.monotonic()
        self.last_progress = {i: start for i in self.last_progress}
        while self.running:
            events = dict(self.poller.poll(_POLL_MS))
            if self.up_recv in events:
                self._drain(self.up_recv, self._from_http)
            for index, sock in enumerate(self.down_recv):
                if sock in events:
                    self._drain(sock, lambda data, i=index: self._from_replica(i, data))
            self.check_replicas()
            self._expire_fan_outs()

    def _expire_fan_outs(self) -> None:
        now = time.monotonic()
        for req_id, fan in list(self.pending.items()):
            if fan.deadline is not None and now >= fan.deadline:
                waited = (_SHUTDOWN_DEADLINE_S if isinstance(fan.msg, ShutdownReq)
                          else _INFO_DEADLINE_S)
                for index in sorted(fan.waiting):
                    fan.replies.append(ReplicaReply(
                        index, False, f"replica {index} did not answer within {waited:g} s"))
                fan.waiting.clear()
                self._complete_if_done(req_id)

    def _drain(self, sock: Any, handle: Any) -> None:
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(data)
            except Exception:  # one bad message must not stop the controller
                logger.exception("failed to route a message")

    # ---- from the HTTP side
    def _from_http(self, data: bytes) -> None:
        msg = decode_input(data)
        if isinstance(msg, TokenizedGenerateReqInput):
            try:
                index = self.router.pick()
            except NoLiveReplicaError as e:
                self._send_up(_finished(msg.rid, str(e)))
                return
            self.rid_replica[msg.rid] = index
            self.down_send[index].send(data)
        elif isinstance(msg, AbortReq):
            self._route_abort(msg)
        elif isinstance(msg, InitWeightsUpdateGroupReqInput):
            live = self.router.live_indices()  # ranks go to the live replicas, densely
            try:
                offsets = dict(zip(live, group_rank_offsets(msg.rank_offset, msg.world_size,
                                                            len(live), self.tp_size)))
            except ValueError as e:
                self._send_up(ControlReqOutput(req_id=msg.req_id, success=False, message=str(e)))
                return
            self._fan_out(msg, lambda i: msgspec.structs.replace(
                msg, req_id=_sub_id(msg.req_id, i), rank_offset=offsets[i]))
        elif isinstance(msg, StartProfileReqInput):  # each replica's files under its own name
            base = (msg.profile_id or str(int(time.time())))[:120]  # room for the suffix
            self._fan_out(msg, lambda i: msgspec.structs.replace(
                msg, req_id=_sub_id(msg.req_id, i), profile_id=f"{base}-DP-{i}"))
        else:
            req_id = getattr(msg, "req_id", None)
            if req_id is None:
                logger.error("dropping %s without a req_id", type(msg).__name__)
                return
            self._fan_out(msg, lambda i: msgspec.structs.replace(msg, req_id=_sub_id(req_id, i)))

    def _route_abort(self, msg: AbortReq) -> None:
        per_replica: dict[int, list[str]] = {}
        for rid in msg.rids:
            index = self.rid_replica.get(rid)
            if index is not None:
                per_replica.setdefault(index, []).append(rid)
        if msg.req_id is not None:  # the caller waits for the aborts to land
            if not msg.abort_all and not per_replica:  # no replica holds them: nothing to wait for
                self._send_up(ControlReqOutput(req_id=msg.req_id, success=True, message="",
                                               data={"num_aborted": 0}))
                return
            # Only the replicas holding the rids (every one for abort_all): a frozen replica
            # that holds none must not hold the reply back.
            self._fan_out(msg, lambda i: msgspec.structs.replace(
                msg, req_id=_sub_id(msg.req_id, i), rids=per_replica.get(i, [])),
                targets=None if msg.abort_all else set(per_replica))
            return
        for index in self.router.live_indices():
            if msg.abort_all:
                self.down_send[index].send(encode_message(msg))
            elif index in per_replica:
                self.down_send[index].send(encode_message(
                    msgspec.structs.replace(msg, rids=per_replica[index])))

    def _fan_out(self, msg: Any, copy_for: Any, targets: set[int] | None = None) -> None:
        """`copy_for(i)` to every live replica i (of `targets`, if given); the merged reply goes
        out once each has answered."""
        live = [i for i in self.router.live_indices() if targets is None or i in targets]
        skipped = [r for r in self.router.describe() if not r["alive"]]
        fan = _FanOut(msg, set(live), skipped=skipped)
        if isinstance(msg, (GetLoadReqInput, GetServerInfoReqInput)):
            fan.deadline = time.monotonic() + _INFO_DEADLINE_S
        elif isinstance(msg, ShutdownReq):
            # A frozen replica never answers: the controller stops anyway (and then kills it),
            # well within the time the server gives it.
            fan.deadline = time.monotonic() + _SHUTDOWN_DEADLINE_S
        self.pending[msg.req_id] = fan
        for index in live:
            self.down_send[index].send(encode_message(copy_for(index)))
        self._complete_if_done(msg.req_id)

    # ---- from a replica
    def _from_replica(self, index: int, data: bytes) -> None:
        msg = decode_output(data)
        now = time.monotonic()
        if isinstance(msg, SchedulerHeartbeat):
            previous = self.beats.get(index)
            if (previous is None or previous.loop_count != msg.loop_count
                    or msg.operation is not None):
                self.last_progress[index] = now
            self.beats[index] = msg
            self.last_beat[index] = now
            self._send_up(self._heartbeat())
            return
        self.last_progress[index] = now
        if isinstance(msg, BatchTokenIDOut):
            for rid, reason in zip(msg.rids, msg.finished_reasons):
                if reason is not None and self.rid_replica.pop(rid, None) is not None:
                    self.router.finish(index)
            self.up_send.send(data)
        else:
            req_id, _, _ = msg.req_id.rpartition("/")
            fan = self.pending.get(req_id)
            if fan is None or index not in fan.waiting:
                return
            fan.waiting.discard(index)
            fan.replies.append(ReplicaReply(index, msg.success, msg.message, dict(msg.data)))
            self._complete_if_done(req_id)

    def _complete_if_done(self, req_id: str) -> None:
        fan = self.pending.get(req_id)
        if fan is None or fan.waiting:
            return
        del self.pending[req_id]
        replies = sorted(fan.replies, key=lambda r: r.index)
        merged = merge_replies(replies, fan.skipped)
        if isinstance(fan.msg, (GetLoadReqInput, GetServerInfoReqInput)):
            merged.data = self._merge_load(replies)
            merged.message = replies[0].message if replies else merged.message
        elif isinstance(fan.msg, StopProfileReqInput):
            merged.data = {"paths": [p for r in replies for p in r.data.get("paths", [])]}
        self._send_up(ControlReqOutput(req_id=req_id, success=merged.success,
                                       message=merged.message, data=merged.data))
        if isinstance(fan.msg, ShutdownReq):
            logger.info("shutdown: every replica has stopped serving")
            self.running = False

    def _merge_load(self, replies: list[ReplicaReply]) -> dict[str, Any]:
        """Counters summed over the replicas that answered, the rest from the first, and one entry
        per replica (dead ones included) under `replicas`."""
        missing = {r.index: r.message for r in replies if not r.success}
        replies = [r for r in replies if r.success]
        data = merge_load(replies)
        by_index = {r.index: r.data for r in replies}
        now = time.monotonic()
        entries = []
        for entry in self.router.describe():
            index = entry["index"]
            proc = self.procs[index] if index < len(self.procs) else None
            entry["pid"] = proc.pid if proc is not None else None
            if index < len(self.devices):
                entry["device"], entry["cuda_visible_devices"] = self.devices[index]
            beat = self.last_beat.get(index)
            entry["seconds_since_heartbeat"] = round(now - beat, 3) if beat is not None else None
            entry.update({k: by_index[index][k] for k in _REPLICA_FIELDS
                          if index in by_index and k in by_index[index]})
            if index in missing:
                entry["error"] = missing[index]
            entries.append(entry)
        data["dp_size"] = self.router.num_replicas
        data["num_replicas_alive"] = sum(1 for e in entries if e["alive"])
        data["replicas"] = entries
        return data

    def _heartbeat(self) -> SchedulerHeartbeat:
        live = [self.beats[i] for i in self.router.live_indices() if i in self.beats]
        busy = next((b for b in live if b.operation is not None), None)
        return SchedulerHeartbeat(
            loop_count=sum(b.loop_count for b in live),
            operation=busy.operation if busy is not None else None,
            operation_seconds=busy.operation_seconds if busy is not None else 0.0)

    # ---- replica deaths
    def check_replicas(self) -> None:
        """Mark replicas whose process has exited as dead and fail what they held. A replica that
        has shown no progress for `stall_timeout` seconds (frozen, or its loop stuck outside a
        declared operation) is killed first: the others must not keep routing to it."""
        now = time.monotonic()
        for index, proc in enumerate(self.procs):
            if not self.router.is_alive(index):
                continue
            if not proc.is_alive():
                self._replica_died(index, f"replica {index} (scheduler pid {proc.pid}) exited "
                                          f"with code {proc.exitcode}")
            elif now - self.last_progress[index] > self.stall_timeout:
                stalled = now - self.last_progress[index]
                proc.kill()
                self._replica_died(index, f"replica {index} (scheduler pid {proc.pid}) stopped "
                                          f"responding ({stalled:.0f} s without progress) and "
                                          "was killed")
        if self.procs and not self.router.live_indices():
            logger.error("every replica has died; the controller exits")
            self.running = False

    def _replica_died(self, index: int, reason: str) -> None:
        self.router.mark_dead(index, reason)
        lost = [rid for rid, i in self.rid_replica.items() if i == index]
        logger.error("%s; failing its %d in-flight requests, the other replicas keep serving",
                     reason, len(lost))
        message = f"data-parallel {reason} while running this request"
        for rid in lost:
            del self.rid_replica[rid]
            self._send_up(_finished(rid, message))
        for req_id, fan in list(self.pending.items()):
            if index in fan.waiting:
                fan.waiting.discard(index)
                fan.replies.append(ReplicaReply(index, False, f"{reason} before answering"))
                self._complete_if_done(req_id)

    def _send_up(self, msg: msgspec.Struct) -> None:
        self.up_send.send(encode_message(msg))


def merge_load(replies: list[ReplicaReply]) -> dict[str, Any]:
    """One load (or server-info) reply for the replicas that answered: counters, KV pools, memory,
    per-rank memory and release totals summed over them (so `kv_pools` adds up to `max_total_tokens`
    and the `kv_*` counters), flags combined, everything else from the first."""
    if not replies:
        return {}
    datas = [r.data for r in replies]
    data = dict(datas[0])
    for key in LOAD_COUNTERS:
        values = [d[key] for d in datas if isinstance(d.get(key), int)]
        if values:
            data[key] = sum(values)
    data["invariants_ok"] = all(d.get("invariants_ok", True) for d in datas)
    data["admission_blocked"] = any(d.get("admission_blocked") for d in datas)
    data["memory"] = _sum_memory([d.get("memory") or {} for d in datas])
    data["memory_ledger"] = _sum_ledgers([d.get("memory_ledger") or {} for d in datas])
    if any("kv_pools" in d for d in datas):
        data["kv_pools"] = _sum_kv_pools([d.get("kv_pools") or {} for d in datas])
    if any(d.get("ranks") for d in datas):
        data["ranks"] = _sum_ranks([d.get("ranks") or [] for d in datas])
    return data


def _sum_kv_pools(pools: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Each pool's counts (capacity, free, used, cached, evictable) summed over the replicas."""
    out: dict[str, dict[str, int]] = {}
    for replica in pools:
        for pool, counts in replica.items():
            merged = out.setdefault(pool, {})
            for key, value in counts.items():
                merged[key] = merged.get(key, 0) + int(value)
    return out


def _sum_ranks(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Tensor-parallel rank r's memory summed over the replicas (each replica has ranks 0..tp-1)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for replica in ranks:
        for entry in replica:
            by_rank.setdefault(int(entry.get("rank", 0)), []).append(entry)
    out = []
    for _, entries in sorted(by_rank.items()):
        merged = dict(entries[0])
        for key in ("reserved_bytes", "allocated_bytes", "cpu_backup_bytes",
                    "cpu_backup_allocations"):
            merged[key] = sum(int(e.get(key, 0)) for e in entries)
        released: dict[str, int] = {}
        for e in entries:
            for tag, nbytes in (e.get("released_bytes") or {}).items():
                released[tag] = released.get(tag, 0) + int(nbytes)
        merged["released_bytes"] = released
        merged["release_totals"] = _sum_ledgers([e.get("release_totals") or {} for e in entries])
        out.append(merged)
    return out


def _sub_id(req_id: str, index: int) -> str:
    return f"{req_id}/{index}"


def _finished(rid: str, message: str) -> BatchTokenIDOut:
    return BatchTokenIDOut([rid], [[]], [[]], [[]], [{"type": "abort", "message": message}], [0])


def _sum_memory(memories: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(memories[0]) if memories else {}
    for key in _MEMORY_COUNTERS:
        out[key] = sum(int(m.get(key, 0)) for m in memories)
    released: dict[str, int] = {}
    for m in memories:
        for tag, nbytes in (m.get("released_bytes") or {}).items():
            released[tag] = released.get(tag, 0) + int(nbytes)
    out["released_bytes"] = released
    return out


def _sum_ledgers(ledgers: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for ledger in ledgers:
        for reason, totals in ledger.items():
            merged = out.setdefault(reason, {})
            for key, value in totals.items():
                merged[key] = merged.get(key, 0) + value
    return out
