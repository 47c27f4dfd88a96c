"""A process group between a trainer and the engine, made without a default process group.

Both sides call `init_custom_process_group` with the same address, port, world size and backend;
the trainer is rank 0 and broadcasts. Works with `gloo` (CPU tensors) and `nccl` (CUDA tensors).

Every argument is checked first (`ValueError` naming it): `master_address` must be a host name or an
IP literal (IPv6 included; no port, whitespace or control characters), the port in [1, 65535], the
group name short and plain. The join is bounded by `join_timeout_s`: past it the call raises
`RuntimeError` and drops whatever it had built (store connection, half-made group), so a failed join
leaves no thread or socket behind.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_GROUP_NAME_LEN = 128
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


@dataclass
class WeightUpdateGroup:
    """A process group plus the store it was built on (the store must outlive the group)."""

    name: str
    backend: str
    rank: int
    world_size: int
    pg: Any  # a ProcessGroupGloo/NCCL backend (torch's stubs lack its `broadcast`)
    store: dist.Store
    timeout: timedelta = timedelta(seconds=300)  # of each broadcast

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self.pg.broadcast([tensor], opts).wait()


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the group. `join_timeout_s` (default `timeout_s`) bounds the
    rendezvous; `timeout_s` bounds each later broadcast."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
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
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None
    prefixed: dist.PrefixStore | None = None
    try:
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
        store.set_timeout(timedelta(seconds=timeout_s))  # NCCL's lazy set-up reads it later
    except Exception as e:  # noqa: BLE001 - reported as one clear error; nothing is kept
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        # Drop the references now (not when the traceback goes): the store's socket closes.
        pg = store = prefixed = None
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"could not join group {group_name!r} at {master_address}:{master_port} as rank "
            f"{rank} of {world_size} within {join_s:g} s: {detail}") from None
    assert pg is not None and prefixed is not None  # set by the try block, or it raised
    return WeightUpdateGroup(group_name, backend, rank, world_size, pg, prefixed,
                             timedelta(seconds=timeout_s))
