"""Tensor parallelism behind the worker interface: one process per rank, one scheduler on rank 0.

`TpWorkerGroup` is the `ModelWorker` the scheduler drives when `tp_size > 1`. It runs rank 0 in this
process (a `TpModelWorker` holding rank 0's share of the model) and starts ranks 1..N-1 as child
processes (`python -m tide.scheduler.tp_worker`), each a `TpModelWorker` on its own device. The ranks
form their own process group (gloo on CPU, NCCL on CUDA; never torch's default group) over which the
layers all-reduce and all-gather.

Control goes over one authenticated local connection per child (`multiprocessing.connection`; only
this engine's own processes speak on it; tensors never travel on it, they go over the rank group):
- `forward`: rank 0 sends each batch's host fields (positions, request slots, prompt ids, where the
  request-table writes the scheduler made since the last batch go) to every rank; its device fields
  (KV slots, written slots, a decode step's input ids) follow in one broadcast over the rank group.
  Every rank runs the same forward (the collectives meet inside it), and only rank 0 samples. No
  reply, unless the forward raised on a child: it then sends `("forward_failed", error)`. Its
  collectives may no longer line up with rank 0's (the one-shot all-reduce would then add
  mismatched calls without noticing), so rank 0 stops stepping for good: the next batch it would
  send, and every later one, raise instead (restart the engine), as when a rank dies.
- `call`: a method of `RankRuntime`, run on every rank (children first, rank 0 last, so collectives
  inside meet), each rank's result or error sent back. Weight updates use two calls: `prepare` on
  every rank (validation; nothing written), then `apply` on every rank only if every rank validated,
  else `discard` everywhere: a failure on one rank leaves every rank unchanged.

The KV pool of every rank holds the same slots (the smallest size any rank can afford), so rank 0's
allocator serves all ranks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, NoReturn

import torch

from tide.config import EngineConfig
from tide.executor.forward_batch import ForwardMode
from tide.executor.model_runner import resolve_device
from tide.layers.sampler import PromptScoring, SampleOutput
from tide.memory.ledger import MemoryLedger
from tide.memory.observe import device_memory_stats
from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.model_config import ModelConfig
from tide.parallel import TpGroup
from tide.parallel.group import COALESCE
from tide.scheduler.profile import ProfileOptions
from tide.scheduler.schedule_batch import ScheduleBatch
from tide.scheduler.worker import ModelWorker, SampleFuture, TpModelWorker
from tide.weights.bucket import FlattenedBucket
from tide.weights.distributed import init_custom_process_group
from tide.weights.update import PartialWriteError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 600.0
_COLLECTIVE_TIMEOUT_S = 1800.0
_ENV_ADDRESS = "TIDE_TP_ADDRESS"
_ENV_AUTHKEY = "TIDE_TP_AUTHKEY"
_ENV_RANK = "TIDE_TP_RANK"
# (slot, start, kv slots): one `ReqToTokenPool.write` the scheduler made on rank 0 (the slots are
# sent with the batch's broadcast; the message carries (slot, start, number of slots)).
TableWrite = tuple[int, int, torch.Tensor]


def check_tp_size(tp_size: int, model_config: ModelConfig) -> None:
    """ValueError naming `tp_size` if the model cannot be split over `tp_size` ranks."""
    mc = model_config
    for name, value in (("num_attention_heads", mc.num_attention_heads),
                        ("intermediate_size", mc.intermediate_size)):
        if value % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide the model's {name} ({value})")
    kv = mc.num_key_value_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ValueError(f"tp_size {tp_size} and the model's num_key_value_heads ({kv}) must "
                         "divide one another")


# ---- every rank
class RankRuntime:
    """One rank's worker and the state of the calls in flight (prepared updates, tensors received
    for an update). The same class serves rank 0 (called in-process) and the child ranks."""

    def __init__(self, worker: TpModelWorker, tp: TpGroup) -> None:
        self.worker = worker
        self.tp = tp
        self.prepared: dict[int, Callable[[], int]] = {}
        self.outbox: list[tuple[str, torch.Tensor]] = []  # rank 0: tensors to broadcast
        self.inbox: dict[int, list[tuple[str, torch.Tensor]]] = {}

    @property
    def updater(self) -> Any:
        return self.worker.weight_updater

    # forward (child ranks; rank 0 runs `TpModelWorker.forward`, which also samples)
    def forward(self, batch: dict[str, Any]) -> None:
        runner = self.worker.model_runner
        pool = runner.req_to_token_pool
        n = batch["num_tokens"]
        ids_len = n if batch["ids_on_device"] else 0
        written = sum(length for _, _, length in batch["writes"])
        payload = torch.empty(n + ids_len + written, dtype=torch.int64, device=runner.device)
        self.tp.broadcast(payload)  # rank 0's `_send_batch`
        offset = n + ids_len
        for slot, start, length in batch["writes"]:
            pool.write(slot, start, payload[offset:offset + length].to(torch.int32))
            offset += length
        loc = payload[:n]
        ids = payload[n:n + ids_len] if batch["ids_on_device"] else batch["input_ids"]
        if batch["mode"] == ForwardMode.DECODE.value:
            runner.forward_decode(ids, batch["positions"], batch["req_pool_indices"], loc)
        else:
            score = batch["score"]
            runner.forward_extend(batch["input_ids"], batch["positions"],
                                  batch["req_pool_indices"], batch["prefix_lens"],
                                  batch["extend_lens"], loc,
                                  None if score is None else PromptScoring(*score))

    # weight updates: prepare (validate) on all, then apply on all or discard on all
    def prepare(self, uid: int, kind: str, arg: Any) -> None:
        up = self.updater
        if kind == "disk":
            fn = up.prepare_from_disk(arg)
        elif kind == "serialized":
            fn = up.prepare_serialized(arg[0], arg[1])
        elif kind == "ipc":
            fn = up.prepare_from_ipc(arg)
        elif kind == "received":
            fn = up.prepare_named_tensors(self.inbox.pop(uid))
        else:
            raise ValueError(f"unknown update kind {kind!r}")
        self.prepared[uid] = fn

    def apply(self, uid: int) -> int:
        count = self.prepared.pop(uid)()
        self._mark("weight_update", f"{count} tensors")
        return count

    def _mark(self, kind: str, detail: str) -> None:
        """Rank 0's handover marks rank 0's ledger; the other ranks mark their own here."""
        if self.tp.rank:
            self.worker.ledger.mark(kind, f"rank {self.tp.rank}: {detail}")

    def discard(self, uid: int) -> None:
        self.prepared.pop(uid, None)
        self.inbox.pop(uid, None)

    def receive_tensors(self, uid: int, metas: list[tuple[str, tuple[int, ...], torch.dtype]]
                        ) -> None:
        """Rank 0 broadcasts `outbox` (the full tensors of an in-process update) over the rank
        group, in NCCL groups of `COALESCE` tensors on GPUs; every rank keeps them for
        `prepare(uid, "received")`."""
        device = self.worker.model_runner.device
        received: list[tuple[str, torch.Tensor]] = []
        for first in range(0, len(metas), COALESCE):  # rank 0 stages one group on the GPU at a time
            wire: list[torch.Tensor] = []
            for i in range(first, min(len(metas), first + COALESCE)):
                name, shape, dtype = metas[i]
                if self.tp.rank == 0:
                    src = self.outbox[i][1]
                    wire.append(src.to(device).contiguous())
                    received.append((name, src))
                else:
                    buf = torch.empty(shape, dtype=dtype, device=device)
                    wire.append(buf)
                    received.append((name, buf))
            self.tp.broadcast_many(wire)
        self.outbox = []
        self.inbox[uid] = received

    def check_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                          group_name: str) -> None:
        self.updater.check_distributed(names, dtypes, shapes, group_name)

    def load_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                              group_name: str, load_format: str | None,
                              peer_error: str | None) -> int:
        return self.updater.load_from_distributed(names, dtypes, shapes, group_name, load_format,
                                                  peer_error)

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str, timeout: float) -> None:
        self.updater.init_group(master_address, master_port, rank_offset + self.tp.rank,
                                world_size, group_name, backend, timeout)

    def destroy_group(self, group_name: str) -> None:
        self.updater.destroy_group(group_name)

    def weight_part(self, name: str) -> Any:
        # As a numpy array: torch pickles tensors between processes through shared memory.
        shape, split, part = self.updater.weight_part(name)
        return shape, split, part.numpy()

    def coverage_complete(self) -> bool:
        return self.updater.coverage_complete()

    def reset_coverage(self) -> None:
        self.updater.reset_coverage()

    # memory
    def release(self, tags: list[str]) -> int:
        freed = int(self.worker.memory_occupation.release(tags))
        self._mark("release", f"{tags}: {freed / 2**20:.1f} MiB")
        return freed

    def resume(self, tags: list[str]) -> None:
        self.worker.memory_occupation.resume(tags)
        self._mark("resume", str(tags))

    def released_bytes(self) -> dict[str, int]:
        return {t: int(n) for t, n in self.worker.memory_occupation.released_bytes().items()}

    def weights_need_refill(self) -> bool:
        return bool(self.worker.memory_occupation.weights_need_refill)

    def set_weights_need_refill(self, value: bool) -> None:
        self.worker.memory_occupation.weights_need_refill = value

    def empty_device_cache(self, reason: str) -> None:
        self.worker.empty_device_cache(reason)

    def set_write_block(self, reason: str | None) -> None:
        self.updater.write_block = reason

    def drop_cpu_backup(self) -> int:
        return int(self.worker.memory_occupation.drop_cpu_backup())

    def start_profile(self, options: ProfileOptions) -> None:
        self.worker.start_profile(options, self.tp.rank)

    def stop_profile(self) -> list[str]:
        return self.worker.stop_profile()

    def close_occupation(self) -> None:
        self.worker.memory_occupation.close()

    def ledger(self) -> dict[str, Any]:
        return self.worker.ledger.to_dict()

    def memory_report(self) -> dict[str, Any]:
        stats = device_memory_stats()
        backup = self.worker.memory_occupation.backup
        return {"rank": self.tp.rank, "reserved_bytes": stats["reserved"],
                "allocated_bytes": stats["allocated"], "released_bytes": self.released_bytes(),
                "release_totals": self.worker.ledger.totals(),
                "cpu_backup_bytes": backup.host_bytes,
                "cpu_backup_allocations": backup.allocations}

    def max_total_tokens(self) -> int:
        return self.worker.max_total_tokens


def pin_first_device(config: EngineConfig) -> EngineConfig:
    """`config` with its device made concrete (`cuda` → `cuda:N`, N the current GPU here): every
    rank then counts its GPU, first + rank, from the same N, whatever device it made current."""
    device = resolve_device(config.device, 0)
    return dataclasses.replace(config, device=str(device))


def _connect_group(config: EngineConfig, rank: int, port: int) -> TpGroup:
    """Join the ranks' group as `rank` (gloo on CPU; NCCL on this rank's GPU, made current)."""
    device = resolve_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_custom_process_group(
        "nccl" if device.type == "cuda" else "gloo", "127.0.0.1", port, rank, config.tp_size, "tp",
        timeout_s=_COLLECTIVE_TIMEOUT_S, join_timeout_s=_START_TIMEOUT_S,
        device=device if device.type == "cuda" else None)
    one_shot = None
    if device.type == "cuda" and not config.disable_custom_all_reduce:
        from tide.layers.one_shot import OneShotAllReduce  # Triton: GPU hosts only

        one_shot = OneShotAllReduce.create(group.pg, rank, config.tp_size, device)
    return TpGroup(rank, config.tp_size, group.pg,
                   batch_invariant=config.enable_deterministic_inference, one_shot=one_shot)


def rank_main() -> None:
    """Entry point of child rank `$TIDE_TP_RANK`: connect to rank 0, build this rank's worker, serve
    calls until told to stop (or rank 0 goes away)."""
    # Ctrl-C reaches the whole process group: rank 0 decides, and this rank ends when it goes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_rank_0()
    host, port = os.environ[_ENV_ADDRESS].rsplit(":", 1)
    rank = int(os.environ[_ENV_RANK])
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[_ENV_AUTHKEY]))
    conn.send(rank)
    config, model_config, store_port = conn.recv()
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"[tp{rank}] %(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("tide").setLevel(config.log_level.upper())
    try:
        torch.manual_seed(config.seed)
        tp = _connect_group(config, rank, store_port)
        runtime = RankRuntime(TpModelWorker(config, model_config, MemoryLedger(), tp), tp)
    except BaseException as e:  # reported to rank 0, which fails the start
        conn.send((False, f"{type(e).__name__}: {e}"))
        raise
    conn.send((True, runtime.max_total_tokens()))
    _serve(conn, runtime)


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_rank_0() -> None:
    """SIGKILL this rank when its parent (rank 0's process) dies, even while this one is stopped
    or stuck in native code: killed rank 0 (a data-parallel router gives up on a stalled replica)
    would otherwise leave it holding its device. Linux (where the signal follows the thread that
    started the ranks: the one that built the engine); elsewhere the pipe's EOF ends it."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent:  # rank 0 died before the prctl took effect
        os._exit(1)


def _serve(conn: Connection, runtime: RankRuntime) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
        kind = msg[0]
        if kind == "forward":
            try:
                runtime.forward(msg[1])
            except Exception as e:  # reported to rank 0, which stops stepping
                logger.exception("forward failed on this rank")
                conn.send(("forward_failed", f"{type(e).__name__}: {e}"))
        elif kind == "call":
            _, method, args = msg
            try:
                conn.send((True, getattr(runtime, method)(*args)))
            except Exception as e:  # noqa: BLE001 - sent back to rank 0 as this rank's error
                conn.send((False, (type(e).__name__, str(e))))
        elif kind == "shutdown":
            return


# ---- rank 0
class _RecordingReqToTokenPool:
    """Rank 0's request table as the scheduler sees it: every `write` is also recorded, to be sent
    with the next batch to the other ranks (whose tables then match rank 0's)."""

    def __init__(self, pool: ReqToTokenPool) -> None:
        self._pool = pool
        self.writes: list[TableWrite] = []

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        self._pool.write(slot, start, kv_slots)
        self.writes.append((slot, start, kv_slots.clone()))  # on the device: no sync

    def take_writes(self) -> list[TableWrite]:
        writes, self.writes = self.writes, []
        return writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class RankError(Exception):
    """A call failed on one or more ranks: `errors` is rank -> (exception type name, message)."""

    def __init__(self, errors: dict[int, tuple[str, str]]) -> None:
        self.errors = errors
        rank, (kind, message) = min(errors.items())
        self.kind = kind
        self.message = message if rank == 0 else f"rank {rank}: {message}"
        super().__init__(self.message)

    def reraise(self) -> NoReturn:
        cls = {"ValueError": ValueError, "TypeError": TypeError,
               "PartialWriteError": PartialWriteError}.get(self.kind, RuntimeError)
        raise cls(self.message) from None


class TpWorkerGroup(ModelWorker):
    """The scheduler's worker for `tp_size > 1` (see the module docstring)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 ledger: MemoryLedger) -> None:
        check_tp_size(config.tp_size, model_config)
        config = pin_first_device(config)
        resolve_device(config.device, config.tp_size - 1)  # enough GPUs, before any rank starts
        self.tp_size = config.tp_size
        self.ledger = ledger
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._broken: str | None = None  # why stepping stopped for good (a child's forward failed)
        self._profiling = False  # every rank runs a profile (start_profile .. stop_profile)
        try:
            self._start(config, model_config, ledger)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, model_config: ModelConfig,
               ledger: MemoryLedger) -> None:
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        try:
            host, port = listener.address
            env = dict(os.environ, **{_ENV_ADDRESS: f"{host}:{port}",
                                      _ENV_AUTHKEY: authkey.hex()})
            for rank in range(1, self.tp_size):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tide.scheduler.tp_worker"],
                    env=dict(env, **{_ENV_RANK: str(rank)})))
            by_rank = self._accept(listener)
        finally:
            listener.close()
        self._conns = [by_rank[r] for r in range(1, self.tp_size)]
        store_port = _free_port()
        for conn in self._conns:
            conn.send((config, model_config, store_port))
        self.tp = _connect_group(config, 0, store_port)
        self.local = TpModelWorker(config, model_config, ledger, self.tp)
        self.runtime = RankRuntime(self.local, self.tp)
        sizes = [self.local.max_total_tokens]
        for rank, conn in enumerate(self._conns, start=1):
            ok, value = conn.recv()
            if not ok:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {value}")
            sizes.append(int(value))
        runner = self.local.model_runner
        self.max_total_tokens = min(sizes)
        if self.max_total_tokens < runner.max_total_tokens:  # every rank must hold every slot
            runner.max_total_tokens = self.max_total_tokens
            runner.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_tokens,
                                                                       runner.device)
        self.model_runner = runner
        self.sampler = self.local.sampler
        self.supports_overlap = self.local.supports_overlap
        self.req_to_token_pool = _RecordingReqToTokenPool(runner.req_to_token_pool)  # type: ignore[assignment]
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.context_len = runner.context_len
        self.weight_updater = TpWeightUpdater(self)  # type: ignore[assignment]
        self.memory_occupation = TpMemoryOccupation(self)  # type: ignore[assignment]
        logger.info("tensor parallel: %d ranks, %d KV slots each", self.tp_size,
                    self.max_total_tokens)

    def _accept(self, listener: Listener) -> dict[int, Connection]:
        """Accept every child's connection (each says its rank first); RuntimeError if a child
        exits or the start takes too long."""
        by_rank: dict[int, Connection] = {}
        done = threading.Event()
        failure: list[BaseException] = []

        def accept() -> None:
            try:
                while len(by_rank) < self.tp_size - 1:
                    conn = listener.accept()
                    by_rank[int(conn.recv())] = conn
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=accept, name="tide-tp-accept", daemon=True).start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not done.wait(0.1):
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code "
                                       f"{proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError("tensor-parallel ranks did not connect in time")
        if failure:
            raise RuntimeError(f"tensor-parallel start failed: {failure[0]}")
        return by_rank

    # ---- the worker interface
    def forward(self, batch: ScheduleBatch) -> SampleOutput:
        self._send_batch(batch)
        return self.local.forward(batch)

    def forward_launch(self, batch: ScheduleBatch) -> SampleFuture:
        """The overlap schedule's launch: the other ranks get the batch without rank 0 waiting for
        the device (see `_send_batch`), then rank 0 launches its own part and sampling."""
        self._send_batch(batch)
        return self.local.forward_launch(batch)

    def _send_batch(self, batch: ScheduleBatch) -> None:
        """The batch to the other ranks: its host fields over the pipes, then the new KV slots, a
        decode step's input ids when they are the previous step's tokens (still on the device),
        and the KV slots of the request-table writes since the last batch, in one broadcast over
        the rank group. The broadcast is queued on the device in stream order, so nothing here
        waits for the device."""
        loc = batch.out_cache_loc
        if loc is None:
            raise ValueError("prepare the batch first (out_cache_loc is not set)")
        ids = batch.input_ids_device if batch.is_decode else None
        message: dict[str, Any] = {
            "mode": batch.mode.value,
            "input_ids": batch.input_ids if ids is None else None,
            "ids_on_device": ids is not None,
            "num_tokens": int(loc.numel()),
            "positions": batch.positions,
            "req_pool_indices": batch.req_pool_indices,
            "prefix_lens": batch.prefix_lens,
            "extend_lens": batch.extend_lens,
            # Input logprobs: the output head runs the same pieces on every rank (it gathers).
            "score": None if batch.score is None else (
                batch.score.rows, batch.score.targets, batch.score.temperatures, batch.score.top),
        }
        writes = self.req_to_token_pool.take_writes()  # type: ignore[attr-defined]
        message["writes"] = [(slot, start, int(slots.numel())) for slot, start, slots in writes]
        parts = [loc] + ([ids.reshape(-1)] if ids is not None else [])
        parts += [slots.reshape(-1) for _, _, slots in writes]
        parts = [p.to(device=loc.device, dtype=torch.int64) for p in parts]
        payload = parts[0] if len(parts) == 1 else torch.cat(parts)
        with self._lock:  # the pipes' order and the group's collective order stay the same
            self._take_failure_reports()
            if self._broken is not None:
                raise RuntimeError(self._broken)
            try:
                for conn in self._conns:
                    conn.send(("forward", message))
                self.tp.broadcast(payload.contiguous())
            except (OSError, RuntimeError) as e:  # a rank process is gone (broken pipe, gloo)
                dead = [rank for rank, proc in enumerate(self._procs, start=1)
                        if proc.poll() is not None]
                self._broken = (f"tensor-parallel rank(s) {dead or '?'} gone ({type(e).__name__}: "
                                f"{e}); restart the engine")
                logger.error("%s", self._broken)
                raise RuntimeError(self._broken) from None

    def device_info(self) -> dict[str, str]:
        info = self.local.device_info()
        info["tp_size"] = str(self.tp_size)
        return info

    def empty_device_cache(self, reason: str) -> None:
        self.call("empty_device_cache", reason)

    def rank_ledgers(self) -> list[dict]:
        return self.call("ledger")

    def start_profile(self, options: ProfileOptions, rank: int = 0) -> None:
        """Start a profile on every rank; if one fails, the others stop theirs."""
        if self._profiling:
            raise RuntimeError("a profile is already running (stop_profile first)")
        try:
            self.call("start_profile", options)
        except RankError as e:
            try:
                self.call("stop_profile")  # those that started; the others report none runs
            except RankError:
                pass
            e.reraise()
        self._profiling = True

    def stop_profile(self) -> list[str]:
        """Stop every rank's profile; the files written, rank 0's first."""
        if not self._profiling:
            raise RuntimeError("no profile is running (start_profile first)")
        self._profiling = False
        try:
            return [path for paths in self.call("stop_profile") for path in paths]
        except RankError as e:
            e.reraise()

    def rank_memory(self) -> list[dict]:
        return self.call("memory_report")

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run `RankRuntime.<method>(*args)` on every rank; each rank's result, rank 0 first. Raises
        `RankError` (after every rank has answered) if any rank failed."""
        return self.call_each(method, [args] * self.tp_size)

    def call_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Like `call`, with rank r's own arguments `args[r]`."""
        with self._lock:
            for conn, rank_args in zip(self._conns, args[1:]):
                conn.send(("call", method, rank_args))
            results: list[Any] = [None] * self.tp_size
            errors: dict[int, tuple[str, str]] = {}
            try:
                results[0] = getattr(self.runtime, method)(*args[0])
            except Exception as e:  # noqa: BLE001 - gathered with the other ranks' errors
                errors[0] = (type(e).__name__, str(e))
            for rank, conn in enumerate(self._conns, start=1):
                ok, value = self._reply(rank, conn)
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = (str(value[0]), str(value[1]))
        if errors:
            raise RankError(errors)
        return results

    @property
    def broken(self) -> str | None:
        """Why this group can never step again (a rank's forward failed or a rank is gone), else
        None."""
        return self._broken

    def _note_failure(self, rank: int, error: str) -> None:
        if self._broken is None:
            self._broken = (f"tensor-parallel rank {rank}: forward failed ({error}); the ranks' "
                            "collectives may no longer line up, restart the engine")
            logger.error("%s", self._broken)

    def _reply(self, rank: int, conn: Connection) -> tuple[bool, Any]:
        """The reply to a call from `rank`, noting the failure reports of earlier forwards that
        arrive before it."""
        while True:
            msg = conn.recv()
            if msg[0] == "forward_failed":
                self._note_failure(rank, msg[1])
                continue
            return msg

    def _take_failure_reports(self) -> None:
        """Note every forward failure the children have reported so far (without waiting)."""
        for rank, conn in enumerate(self._conns, start=1):
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "forward_failed":
                        self._note_failure(rank, msg[1])
            except (EOFError, OSError):
                continue  # a rank that is gone: sending it the batch fails

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("shutdown",))
                conn.close()
            except OSError:
                pass
        self._conns = []
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        local = getattr(self, "local", None)
        if local is not None:
            local.shutdown()  # rank 0's own model, pools and graphs
        tp = getattr(self, "tp", None)
        if tp is not None and tp.one_shot is not None:  # the other ranks have exited
            tp.one_shot.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TpWeightUpdater:
    """`WeightUpdater`'s interface over every rank: validate on all ranks, then write on all or
    none. Full tensors arriving at rank 0 are broadcast to the ranks, and each keeps its part."""

    def __init__(self, group: TpWorkerGroup) -> None:
        self.group = group
        self.tp_size = group.tp_size
        self._uids = itertools.count()

    @property
    def groups(self) -> dict[str, Any]:
        return self.group.local.weight_updater.groups

    @property
    def write_block(self) -> str | None:
        """Set while the weights are released: every rank refuses updates."""
        return self.group.local.weight_updater.write_block

    @write_block.setter
    def write_block(self, reason: str | None) -> None:
        if reason != self.write_block:
            self.group.call("set_write_block", reason)

    def _prepare(self, kind: str, args: Sequence[Any], uid: int | None = None
                 ) -> Callable[[], int]:
        uid = next(self._uids) if uid is None else uid
        try:
            self.group.call_each("prepare", [(uid, kind, a) for a in args])
        except RankError as e:
            self.group.call("discard", uid)
            e.reraise()

        def apply() -> int:
            try:
                return int(self.group.call("apply", uid)[0])
            except RankError as e:
                e.reraise()
                raise

        return apply

    def prepare_from_disk(self, model_path: str) -> Callable[[], int]:
        return self._prepare("disk", [model_path] * self.tp_size)

    def prepare_serialized(self, payload: str | bytes, load_format: str | None
                           ) -> Callable[[], int]:
        return self._prepare("serialized", [(payload, load_format)] * self.tp_size)

    def prepare_serialized_per_rank(self, payloads: Sequence[str | bytes],
                                    load_format: str | None) -> Callable[[], int]:
        if len(payloads) != self.tp_size:
            raise ValueError(f"serialized_named_tensors must hold one payload per rank "
                             f"({self.tp_size}), got {len(payloads)}")
        return self._prepare("serialized", [(p, load_format) for p in payloads])

    def prepare_from_ipc(self, payload: str | bytes | Sequence[str | bytes]
                         ) -> Callable[[], int]:
        if isinstance(payload, (list, tuple)):  # each rank maps its own handles
            if len(payload) != self.tp_size:
                raise ValueError(f"serialized_buckets must hold one payload per rank "
                                 f"({self.tp_size}), got {len(payload)}")
            return self._prepare("ipc", list(payload))
        return self._prepare("ipc", [payload] * self.tp_size)

    def prepare_buckets(self, buckets: object) -> Callable[[], int]:
        if isinstance(buckets, FlattenedBucket):
            buckets = [buckets]
        if not isinstance(buckets, (list, tuple)) or not all(
                isinstance(b, FlattenedBucket) for b in buckets):
            raise ValueError("a flattened_bucket payload must be a FlattenedBucket or a list of them")
        named: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            named.extend(bucket.named_tensors())
        return self.prepare_named_tensors(named)

    def prepare_named_tensors(self, named: object) -> Callable[[], int]:
        # Rank 0 checks the payload's form and its own part first: nothing is sent for a bad one.
        self.group.local.weight_updater.prepare_named_tensors(named)
        assert isinstance(named, (list, tuple))  # checked just above
        pairs = [(n, t) for n, t in named]
        uid = next(self._uids)
        self.group.runtime.outbox = pairs
        metas = [(n, tuple(t.shape), t.dtype) for n, t in pairs]
        try:
            self.group.call("receive_tensors", uid, metas)
        except RankError as e:
            self.group.call("discard", uid)
            e.reraise()
        return self._prepare("received", [None] * self.tp_size, uid)

    def load_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                              shapes: Sequence[Sequence[int]], group_name: str,
                              load_format: str | None) -> int:
        """Every rank checks first; then every rank receives every broadcast (the trainer's group
        spans all ranks) and writes its part, or, if any rank's check failed, none writes."""
        args = (list(names), list(dtypes), [list(s) for s in shapes], group_name)
        peer_error: str | None = None
        try:
            self.group.call("check_distributed", *args)
        except RankError as e:
            peer_error = e.message
        try:
            counts = self.group.call("load_from_distributed", *args, load_format, peer_error)
        except RankError as e:
            e.reraise()
        return int(counts[0])

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str, timeout: float) -> None:
        """Rank r joins as `rank_offset + r` (a data-parallel router passes
        `rank_offset = first + replica * tp_size`). A failed join leaves no rank in the group."""
        if isinstance(rank_offset, int) and isinstance(world_size, int) and (
                rank_offset + self.tp_size > world_size):
            raise ValueError(f"rank_offset {rank_offset} + tp_size {self.tp_size} exceeds "
                             f"world_size {world_size}")
        try:
            self.group.call("init_group", master_address, master_port, rank_offset, world_size,
                            group_name, backend, timeout)
        except RankError as e:
            for rank in range(self.tp_size):
                if rank not in e.errors:
                    self._destroy_on(rank, group_name)
            e.reraise()

    def _destroy_on(self, rank: int, group_name: str) -> None:
        args: list[tuple[Any, ...]] = [("",)] * self.tp_size
        args[rank] = (group_name,)
        try:
            self.group.call_each("destroy_group", args)
        except RankError:
            pass  # the other ranks have no group named "" to destroy

    def destroy_group(self, group_name: str) -> None:
        try:
            self.group.call("destroy_group", group_name)
        except RankError as e:
            e.reraise()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The full tensor, gathered from every rank's part."""
        try:
            parts = self.group.call("weight_part", name)
        except RankError as e:
            e.reraise()
            raise
        shape, split, local = parts[0]
        full = torch.from_numpy(local) if split is None else torch.empty(shape)
        if split is not None:
            for _, rank_split, rank_local in parts:
                dim, start, size = rank_split
                full.narrow(dim, start, size).copy_(torch.from_numpy(rank_local))
        return full.reshape(-1)[: max(0, truncate_size)].tolist()

    def coverage_complete(self) -> bool:
        return all(self.group.call("coverage_complete"))

    def reset_coverage(self) -> None:
        self.group.call("reset_coverage")


class TpMemoryOccupation:
    """`MemoryOccupation`'s interface over every rank: release and resume act on all ranks."""

    def __init__(self, group: TpWorkerGroup) -> None:
        self.group = group

    def release(self, tags: list[str]) -> int:
        try:
            return sum(self.group.call("release", tags))
        except RankError as e:
            e.reraise()
            raise

    def resume(self, tags: list[str]) -> None:
        try:
            self.group.call("resume", tags)
        except RankError as e:
            e.reraise()

    def is_released(self, tag: str) -> bool:
        return self.group.local.memory_occupation.is_released(tag)

    def released_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self.group.call("released_bytes"):
            for tag, n in part.items():
                total[tag] = total.get(tag, 0) + n
        return total

    def drop_cpu_backup(self) -> int:
        try:
            return sum(self.group.call("drop_cpu_backup"))
        except RankError as e:
            e.reraise()
            raise

    def close(self) -> None:
        """Free every rank's host backup of the weights (engine shutdown)."""
        self.group.call("close_occupation")

    def released_bytes_per_rank(self) -> list[dict[str, int]]:
        return self.group.call("released_bytes")

    @property
    def weights_need_refill(self) -> bool:
        return any(self.group.call("weights_need_refill"))

    @weights_need_refill.setter
    def weights_need_refill(self, value: bool) -> None:
        self.group.call("set_weights_need_refill", value)


if __name__ == "__main__":
    rank_main()
