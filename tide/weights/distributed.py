"""A process group between a trainer and the engine, made without a default process group.

Both sides call `init_custom_process_group` with the same address, port, world size and backend;
the trainer is rank 0 and broadcasts. Works with `gloo` (CPU tensors) and `nccl` (CUDA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class WeightUpdateGroup:
    """A process group plus the store it was built on (the store must outlive the group)."""

    name: str
    backend: str
    rank: int
    world_size: int
    pg: dist.ProcessGroup
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"tide/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return WeightUpdateGroup(group_name, backend, rank, world_size, pg, store)
