"""A process group between a trainer and the engine, made without a default process group.

Both sides call `init_custom_process_group` with the same address, port, world size and backend;
the trainer is rank 0 and broadcasts. Works with `gloo` (CPU tensors) and `nccl` (CUDA tensors).

Every argument is checked first (`ValueError` naming it): `master_address` must be a host name or an
IP literal (IPv6 included; no port, whitespace or control characters), the port in [1, 65535], the
group name short and plain. The join is bounded by `join_timeout_s`: past it the call raises
`RuntimeError` and drops whatever it had built (store connection, half-made group), so a failed join
leaves no thread or socket behind.

The handshake: once the group exists, `init_custom_process_group` runs two broadcasts from rank 0 on
every rank before it returns, so both sides must make their group with it (it is a collective). The
first carries `[HANDSHAKE_MAGIC, PROTOCOL_VERSION, bucket_bytes, coalesce_tensors]` (rank 0's values;
the other ranks check magic and version and adopt them); with NCCL the warm-up follows: one broadcast
of each size in `WARMUP_SIZES` (NCCL's small-, medium- and large-message protocols), then, where
`coalesce_tensors` > 1, one NCCL group of up to `WARMUP_GROUP` tensors. NCCL builds its communicator on
a group's first collective (about 200 ms) and connects each protocol's channels the first time a
message uses it, so the group is warm when init returns and the first weight update runs at full
speed.

Every update starts with a header from rank 0 (`UpdateHeader`, protocol 4): [UPDATE_MAGIC, flattened,
count, 0], then (numel, dtype code) of each tensor (or flat dtype buffer) it is about to broadcast.
The engine compares it with the request's names, dtypes and shapes. When they disagree (or the
request is invalid), it drains exactly what the header announces and writes nothing, so a trainer
that sends something else than it declared can neither hang the engine, nor desynchronise the
group (a later update would receive stale bytes), nor crash it (gloo aborts the process on a size
mismatch). Trainers therefore send updates with `broadcast_weights` or `broadcast_flattened`,
never with bare broadcasts. A shape that differs with the same element count is not caught.

`bucket_bytes` is how a `flattened_bucket` update travels: each dtype's flat buffer is broadcast as
consecutive pieces of at most `bucket_bytes` bytes (`WeightUpdateGroup.broadcast_flattened` does the
split on the trainer side), so the engine receives piece i+1 while it copies piece i into the
parameters, in two buffers of that size; 0 sends each dtype's buffer in one broadcast.

`coalesce_tensors` is how a per-tensor update travels over NCCL: every run of that many consecutive
tensors goes as one NCCL group (`ncclGroupStart`/`End`: one launch instead of one per tensor, which
costs ~15 us each), on the trainer (`WeightUpdateGroup.broadcast_weights`) and in the engine alike.
NCCL defines a group only when every rank groups the same calls, so it is agreed at the handshake,
and a trainer that opts in must send per-tensor updates with `broadcast_weights` (or
`broadcast_many`), never tensor by tensor. 0 or 1 (the default, and always on gloo): one broadcast
per tensor.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_GROUP_NAME_LEN = 128
HANDSHAKE_MAGIC = 0x7469_6465_5747  # "tideWG"
PROTOCOL_VERSION = 4  # 2: the header carries coalesce_tensors; 3: the warm-up; 4: update headers
DEFAULT_BUCKET_BYTES = 256 << 20
MAX_BUCKET_BYTES = 4 << 30
MIN_BUCKET_BYTES = 4096
MAX_COALESCE_TENSORS = 1024  # NCCL caps a group at 2048 calls
WARMUP_BYTES = 32 << 20  # large enough for NCCL's large-message protocol: that path is set up too
WARMUP_SIZES = (4 << 10, 256 << 10, 4 << 20, WARMUP_BYTES)  # one broadcast in each protocol's range
WARMUP_GROUP = 64  # tensors in the warm-up's NCCL group (at most coalesce_tensors)
WARMUP_GROUP_BYTES = WARMUP_BYTES // WARMUP_GROUP
UPDATE_MAGIC = 0x7469_6465_5550  # "tideUP": the first value of every update header
MAX_UPDATE_ITEMS = 1 << 20  # tensors (or flat buffers) one update header may announce
# The dtypes an update may carry, as its header encodes them.
WIRE_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int8: 5,
    torch.uint8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
    torch.float8_e4m3fn: 11, torch.float8_e5m2: 12,
}
_WIRE_DTYPE_OF = {code: dtype for dtype, code in WIRE_DTYPES.items()}
MAX_WORLD_SIZE = 65536
MAX_JOIN_TIMEOUT_S = 600.0
DEFAULT_JOIN_TIMEOUT_S = 120.0
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_master_address(value: str) -> str:
    """`value` if it is an IP literal or a host name (RFC 1123 labels, at most 253 characters), else
    ValueError naming `master_address`. `host:port`, brackets, whitespace and control characters
    are refused (the port is its own field)."""
    if not isinstance(value, str) or not value:
        raise ValueError("master_address must be a non-empty host name or IP address")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        scope = getattr(address, "scope_id", None)  # fe80::1%eth0: an interface name or number
        if scope is None or _GROUP_NAME.fullmatch(scope):
            return value
    labels = value.split(".")
    if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(
            f"master_address {value[:64]!r} is not a host name or an IP address (give the port "
            "in master_port; no whitespace, brackets or control characters)")
    return value


def check_group_name(value: str, param: str = "group_name") -> str:
    """`value` if it is 1 to 128 of [A-Za-z0-9_.-], else ValueError naming `param`."""
    if (not isinstance(value, str) or not value or len(value) > MAX_GROUP_NAME_LEN
            or not _GROUP_NAME.fullmatch(value)):
        raise ValueError(f"{param} must be 1 to {MAX_GROUP_NAME_LEN} characters of letters, digits, "
                         f"'_', '.' and '-', got {str(value)[:64]!r}")
    return value


def check_coalesce_tensors(value: int, param: str = "coalesce_tensors") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            0 <= value <= MAX_COALESCE_TENSORS):
        raise ValueError(f"{param} must be an int in [0, {MAX_COALESCE_TENSORS}], got {value!r}")
    return value


def check_bucket_bytes(value: int, param: str = "bucket_bytes") -> int:
    """`value` if it is 0 or in [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES], else ValueError naming `param`."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            value == 0 or MIN_BUCKET_BYTES <= value <= MAX_BUCKET_BYTES):
        raise ValueError(f"{param} must be 0 (one broadcast per dtype) or in [{MIN_BUCKET_BYTES}, "
                         f"{MAX_BUCKET_BYTES}] bytes, got {value!r}")
    return value


@dataclass(frozen=True)
class UpdateHeader:
    """What rank 0 broadcasts next, announced before it (module docstring): one broadcast per
    tensor (`flattened` False) or flat dtype buffers in the group's pieces (True); `items` are the
    (numel, dtype) of each tensor or buffer, in order."""

    flattened: bool
    items: tuple[tuple[int, torch.dtype], ...]

    def describe(self) -> str:
        kind = "flat buffers" if self.flattened else "tensors"
        shown = ", ".join(f"{n} x {str(d).removeprefix('torch.')}" for n, d in self.items[:4])
        more = f", ... ({len(self.items)} in all)" if len(self.items) > 4 else ""
        return f"{len(self.items)} {kind} [{shown}{more}]"


@dataclass
class WeightUpdateGroup:
    """A process group plus the store it was built on (the store must outlive the group).

    `bucket_bytes`: the largest piece of a flattened buffer one broadcast carries (0: no split),
    agreed at the handshake. `device`: where this rank's broadcast tensors live (CPU for gloo)."""

    name: str
    backend: str
    rank: int
    world_size: int
    pg: Any  # a ProcessGroupGloo/NCCL backend (torch's stubs lack its `broadcast`)
    store: dist.Store
    timeout: timedelta = timedelta(seconds=300)  # of each broadcast
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    coalesce_tensors: int = 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0,
                  timeout: timedelta | None = None) -> None:
        """Broadcast `tensor` (contiguous) from rank `src`. With NCCL the call returns once queued:
        the current stream waits for it, the host does not."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout if timeout is None else timeout
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_many(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Broadcast `tensors` (contiguous) in order from rank `src`: in NCCL groups of
        `coalesce_tensors` where that was agreed, else one by one. Every rank calls it with the
        same sizes (and the receivers' tensors shaped like the sender's)."""
        step = self.coalesce_tensors if self.backend == "nccl" else 0
        if step <= 1:
            for t in tensors:
                self.broadcast(t, src)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        for first in range(0, len(tensors), step):
            self.pg._start_coalescing()
            for t in tensors[first:first + step]:
                self.pg.broadcast([t], opts)
            work = self.pg._end_coalescing()
            if work is not None:
                work.wait()  # the current stream waits for the group; the host does not

    def close(self) -> None:
        """Leave the group without waiting for the other ranks. NCCL: the communicator is aborted
        (`ncclCommAbort`: local; its graceful destroy waits for every rank to destroy it too, so it
        hung while a trainer kept its side open). Gloo: shut down (local). A later broadcast by
        another rank finds no peer: with NCCL it waits until that rank's own timeout."""
        if self.backend == "nccl":
            self.pg.abort()
        else:
            self.pg.shutdown()

    def pieces(self, numel: int, element_size: int) -> list[tuple[int, int]]:
        """The [start, end) element ranges a flat buffer of `numel` elements travels in."""
        step = max(1, numel if self.bucket_bytes == 0 else self.bucket_bytes // element_size)
        return [(start, min(numel, start + step)) for start in range(0, max(numel, 1), step)]

    def broadcast_flattened(self, *flats: torch.Tensor) -> None:
        """Trainer side of a flattened update: its header, then each dtype's 1-D buffer (in the
        request's first-seen dtype order) in the pieces the engine expects (see `pieces`)."""
        if not flats or any(f.dim() != 1 or not f.is_contiguous() for f in flats):
            raise ValueError("broadcast_flattened needs one or more contiguous 1-D tensors")
        self.send_update_header(UpdateHeader(True, tuple((f.numel(), f.dtype) for f in flats)))
        for flat in flats:
            for start, end in self.pieces(flat.numel(), flat.element_size()):
                self.broadcast(flat[start:end])

    def send_update_header(self, header: UpdateHeader) -> None:
        """Rank 0: announce an update (two broadcasts: [UPDATE_MAGIC, flattened, count, 0], then
        (numel, dtype code) per item). ValueError, before anything is sent, for a dtype not in
        `WIRE_DTYPES` or a count outside [1, MAX_UPDATE_ITEMS]."""
        if not 1 <= len(header.items) <= MAX_UPDATE_ITEMS:
            raise ValueError(f"an update carries 1 to {MAX_UPDATE_ITEMS} tensors, got "
                             f"{len(header.items)}")
        for _, dtype in header.items:
            if dtype not in WIRE_DTYPES:
                raise ValueError(f"dtype {dtype} cannot travel in a weight update")
        head = torch.tensor([UPDATE_MAGIC, int(header.flattened), len(header.items), 0],
                            dtype=torch.int64)
        body = torch.tensor([v for n, d in header.items for v in (n, WIRE_DTYPES[d])],
                            dtype=torch.int64)
        self.broadcast(head.to(self.device))
        self.broadcast(body.to(self.device))

    def receive_update_header(self) -> UpdateHeader:
        """The other ranks: the header rank 0 sends before an update (waits for it, on the
        current stream). RuntimeError if it is not one (rank 0 broadcast without
        `broadcast_weights` / `broadcast_flattened`): the broadcasts are then out of step."""
        head = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.broadcast(head)
        magic, flattened, count, _ = (int(v) for v in head.tolist())
        if magic != UPDATE_MAGIC or flattened not in (0, 1) or not 1 <= count <= MAX_UPDATE_ITEMS:
            raise RuntimeError("rank 0 sent no update header: a trainer sends updates with "
                               "WeightUpdateGroup.broadcast_weights or broadcast_flattened")
        body = torch.zeros(2 * count, dtype=torch.int64, device=self.device)
        self.broadcast(body)
        values = [int(v) for v in body.tolist()]
        items = []
        for numel, code in zip(values[0::2], values[1::2]):
            dtype = _WIRE_DTYPE_OF.get(code)
            if dtype is None or numel < 0:
                raise RuntimeError(f"rank 0 sent a malformed update header (numel {numel}, "
                                   f"dtype code {code})")
            items.append((numel, dtype))
        return UpdateHeader(bool(flattened), tuple(items))

    def broadcast_weights(self, named: Sequence[tuple[str, torch.Tensor]],
                          load_format: str | None = None) -> None:
        """Trainer side of `update_weights_from_distributed(names, dtypes, shapes, load_format)`
        for these tensors, in this order: one broadcast per tensor, or with
        `load_format="flattened_bucket"` each dtype's tensors concatenated (first-seen dtype order)
        and sent with `broadcast_flattened`. Concatenating copies each dtype's tensors once on this
        rank; a trainer that keeps its weights in one flat buffer calls `broadcast_flattened` on it
        instead."""
        if not named:
            raise ValueError("broadcast_weights needs at least one tensor")
        if load_format == "flattened_bucket":
            groups: dict[torch.dtype, list[torch.Tensor]] = {}
            for _, t in named:
                groups.setdefault(t.dtype, []).append(t.reshape(-1))
            self.broadcast_flattened(*(torch.cat(tensors) for tensors in groups.values()))
        elif load_format is None:
            tensors = [t.contiguous() for _, t in named]
            self.send_update_header(UpdateHeader(False, tuple((t.numel(), t.dtype)
                                                               for t in tensors)))
            self.broadcast_many(tensors)
        else:
            raise ValueError(f"load_format must be None or 'flattened_bucket', got {load_format!r}")

    def handshake(self, bucket_bytes: int, timeout: timedelta, coalesce_tensors: int = 0) -> None:
        """The group's first collectives (module docstring); sets `bucket_bytes` and
        `coalesce_tensors` from rank 0's."""
        on_cuda = self.device.type == "cuda"
        # Allocated on the current stream (their blocks return to its pool), broadcast on a side
        # stream, so nothing queued for serving waits on the handshake.
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            header.copy_(torch.tensor([HANDSHAKE_MAGIC, PROTOCOL_VERSION, bucket_bytes,
                                       coalesce_tensors]))
        warm = torch.empty(WARMUP_BYTES, dtype=torch.uint8, device=self.device) if on_cuda else None
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.broadcast(header, timeout=timeout)
            magic, version, agreed, coalesce = (int(v) for v in header.tolist())  # waits
            if magic != HANDSHAKE_MAGIC:
                raise RuntimeError("rank 0 did not make its side of the group with "
                                   "tide.weights.init_custom_process_group (no handshake)")
            if version != PROTOCOL_VERSION:
                raise RuntimeError(f"rank 0 speaks weight-update protocol {version}, this side "
                                   f"{PROTOCOL_VERSION}")
            self.bucket_bytes = check_bucket_bytes(agreed, "rank 0's bucket_bytes")
            self.coalesce_tensors = check_coalesce_tensors(coalesce, "rank 0's coalesce_tensors")
            if warm is not None and stream is not None:
                self._warm_up(warm, timeout)
                stream.synchronize()  # warm when init returns

    def _warm_up(self, warm: torch.Tensor, timeout: timedelta) -> None:
        """Every kind of broadcast an update makes, once (module docstring), through `warm`
        (`WARMUP_BYTES`): NCCL connects each protocol (small, medium, large messages) and sets up
        grouped launches on first use. Queued on the current stream."""
        for size in WARMUP_SIZES:
            self.broadcast(warm[:size], timeout=timeout)
        if self.coalesce_tensors > 1:
            count = min(self.coalesce_tensors, WARMUP_GROUP)
            self.broadcast_many([warm[i * WARMUP_GROUP_BYTES:(i + 1) * WARMUP_GROUP_BYTES]
                                 for i in range(count)])


def _wait_for_listener(address: str, port: int, deadline: float) -> float:
    """Seconds left before `deadline` (`time.monotonic`) once something accepts a TCP connection at
    `address:port` (the connection is closed at once); TimeoutError naming the address past it. The
    name is resolved once; each try gives every address at most the time left."""
    try:
        targets = [(family, addr) for family, _, _, _, addr in socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM)]
    except OSError as e:
        raise TimeoutError(f"cannot resolve {address}: {e}") from None
    while True:
        for family, addr in targets:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"nothing accepted a connection at {address}:{port} (is rank "
                                   "0's side of the group up?)")
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(min(remaining, 1.0))
                try:
                    sock.connect(addr)
                except OSError:
                    continue
            return max(deadline - time.monotonic(), 0.001)
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str | None = None,
    coalesce_tensors: int = 0,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the group and run the handshake (module docstring) with the
    other ranks. `join_timeout_s` (default `timeout_s`) bounds the rendezvous and the handshake;
    `timeout_s` bounds each later broadcast. `bucket_bytes` (rank 0's counts): the piece size of
    flattened updates. `device`: the CUDA device of this rank's NCCL broadcasts (default: the current
    one); gloo groups broadcast CPU tensors. `coalesce_tensors` (rank 0's counts; NCCL): per-tensor
    updates travel in NCCL groups of that many tensors (module docstring)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    check_bucket_bytes(bucket_bytes)
    check_coalesce_tensors(coalesce_tensors)
    comm_device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        comm_device = torch.device("cuda" if device is None else device)
        if comm_device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for an nccl group, got {device!r}")
        if comm_device.index is None:
            comm_device = torch.device("cuda", torch.cuda.current_device())
    check_master_address(master_address)
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not (
            1 <= master_port <= 65535):
        raise ValueError(f"master_port must be in [1, 65535], got {master_port!r}")
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [2, {MAX_WORLD_SIZE}], got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
    check_group_name(group_name)
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    for name, value in (("timeout_s", timeout_s), ("join_timeout_s", join_s)):
        if not 0 < value <= 86400:
            raise ValueError(f"{name} must be in (0, 86400] seconds, got {value}")
    join_timeout = timedelta(seconds=join_s)
    store: dist.Store | None = None
    group: WeightUpdateGroup | None = None
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None
    prefixed: dist.PrefixStore | None = None
    try:
        if rank != 0:
            # torch's store client retries its connect with a back-off that can run to twice the
            # timeout (and logs each try's C++ stack); a plain connect loop keeps the deadline.
            remaining = _wait_for_listener(master_address, master_port,
                                           time.monotonic() + join_s)
            join_timeout = timedelta(seconds=remaining)
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0,
                              timeout=join_timeout)
        prefixed = dist.PrefixStore(f"tide/{group_name}", store)
        if backend == "gloo":
            # Gloo connects every pair now, so the group's timeout bounds this rendezvous;
            # broadcasts carry their own (`WeightUpdateGroup.timeout`).
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, join_timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        group = WeightUpdateGroup(group_name, backend, rank, world_size, pg, prefixed,
                                  timedelta(seconds=timeout_s), bucket_bytes, comm_device)
        # bounded by the join timeout, store included
        group.handshake(bucket_bytes, join_timeout, coalesce_tensors)
        store.set_timeout(timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - reported as one clear error; nothing is kept
        if group is not None:
            with contextlib.suppress(Exception):  # the join's error is the one to report
                group.close()
        # Drop the references now (not when the traceback goes): the store's socket closes.
        pg = store = prefixed = group = None
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"could not join group {group_name!r} at {master_address}:{master_port} as rank "
            f"{rank} of {world_size} within {join_s:g} s: {detail}") from None
    return group
