"""The tensor-parallel group of one engine: which rank this process is, how many there are, and the
two collectives the layers need (sum across ranks, gather along the last dim).

The group is not torch's default process group (a colocated trainer may own that): it is a process
group of its own (`tide.weights.distributed.init_custom_process_group`), gloo on CPU, NCCL on CUDA.
With one rank every collective is the identity and nothing is communicated. On GPUs, sums small
enough for one slot of `tide.layers.one_shot` (every decode step's) take that one-shot kernel
over peer memory instead of NCCL, unless `disable_custom_all_reduce`; so do gathers that fit one
(a zero-padded sum).

Layers read the group once, when they are built, from `tp_context` (a scoped context that rejects
nesting), so model code never passes it around.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpGroup:
    """Rank `rank` of `size` ranks; `pg` is the process group (None when `size == 1`).

    `batch_invariant` (`enable_deterministic_inference`): `all_reduce` gathers every rank's tensor
    and adds them in rank order on each rank, so an element's sum never depends on the tensor's
    size. A backend's all-reduce (NCCL's ring or tree, gloo's ring) cuts the buffer into chunks by
    its size and, with three ranks or more, adds the ranks' values in an order that follows the
    chunk an element falls in: a row's bits then change with the batch it shares the step with.
    """

    rank: int = 0
    size: int = 1
    pg: Any = None
    batch_invariant: bool = False
    one_shot: Any = None  # a `OneShotAllReduce` for small sums between GPUs, else None (NCCL)

    def split(self, total: int, name: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` (ValueError if it does not divide)."""
        if total % self.size:
            raise ValueError(f"tp_size {self.size} must divide the model's {name} ({total})")
        share = total // self.size
        return self.rank * share, share

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first KV head, number of KV heads) this rank holds: an even share when `total` is a
        multiple of the ranks, else one head replicated over `size // total` ranks."""
        if total >= self.size:
            return self.split(total, "num_key_value_heads")
        if self.size % total:
            raise ValueError(f"tp_size {self.size} must be a multiple of num_key_value_heads "
                             f"({total}) when it is larger")
        return self.rank * total // self.size, 1

    def vocab_shard(self, vocab: int) -> tuple[int, int, int]:
        """(start, size, padded rows): rank r holds ids [start, start + size) in `padded` rows (the
        last rank's tail rows are padding, never read as embeddings, sliced off the logits)."""
        rows = -(-vocab // self.size)
        start = min(self.rank * rows, vocab)
        return start, min(rows, vocab - start), rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):  # rank order: batch-invariant
            return self.one_shot(x)
        if self.batch_invariant and self.size > 2:  # two ranks: a + b whatever the algorithm
            # In rank order, in fp32, rounded once: what the one-shot kernel computes for smaller
            # tensors, so a row's sum does not change when its step's tensor outgrows a slot.
            parts = self._gather_parts(x)
            total = parts[0].float()
            for part in parts[1:]:
                total += part.float()
            return x.copy_(total)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        self.pg.allreduce([x], opts).wait()
        return x

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(sum + residual) * weight, sum + residual), sum = `x` summed over the ranks, in
        one one-shot launch; None where that kernel does not serve `x` (the caller then sums with
        `all_reduce` and norms on its own, which gives the same bits)."""
        if self.size == 1 or self.one_shot is None or not self.one_shot.fits_rows(x, residual):
            return None
        result: tuple[torch.Tensor, torch.Tensor] = self.one_shot.add_rmsnorm(
            x, residual, weight, eps)
        return result

    def _gather_parts(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's `x`, rank r's at index r."""
        flat = x.contiguous().reshape(-1)
        out = torch.empty(self.size * flat.numel(), dtype=x.dtype, device=x.device)
        self.pg._allgather_base(out, flat).wait()
        return out.view(self.size, *x.shape)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's columns at [r * n, (r + 1) * n).

        Where the result fits a one-shot slot (a decode step's vocab-parallel logits), each rank
        places its columns in zeros and the one-shot kernel sums them: every element is one rank's
        value plus zeros, so it arrives exactly (a -0.0 as +0.0), in one launch where NCCL's
        all-gather in a CUDA graph costs tens of microseconds. (NCCL's gather keeps a -0.0: a
        logit's sign of zero may differ between the two paths, never a token or a logprob.)"""
        if self.size == 1:
            return x
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        if self.one_shot is not None and self.one_shot.fits_numel(rows.shape[0] * self.size * n,
                                                                  x.dtype):
            full = rows.new_zeros(rows.shape[0], self.size * n)
            full[:, self.rank * n : (self.rank + 1) * n] = rows
            return self.one_shot(full).view(*x.shape[:-1], self.size * n)
        rows = rows.contiguous()
        out = torch.empty((self.size * rows.shape[0], n), dtype=x.dtype, device=x.device)
        self.pg._allgather_base(out, rows).wait()
        out = out.view(self.size, rows.shape[0], n).transpose(0, 1)
        return out.reshape(*x.shape[:-1], self.size * n)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """`x` of rank `src` into `x` of every rank."""
        if self.size == 1:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([x], opts).wait()


    def broadcast_many(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """`broadcast` each of `tensors` in order; on GPUs in NCCL groups of `COALESCE` (one
        launch per group instead of one per tensor). Every rank passes the same sizes."""
        if self.size == 1:
            return
        if not tensors or not tensors[0].is_cuda:
            for t in tensors:
                self.broadcast(t, src)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        for first in range(0, len(tensors), COALESCE):
            self.pg._start_coalescing()  # a backend (ProcessGroupNCCL): no device argument
            for t in tensors[first:first + COALESCE]:
                self.pg.broadcast([t], opts)
            work = self.pg._end_coalescing()
            if work is not None:
                work.wait()


COALESCE = 32  # tensors per NCCL group in `TpGroup.broadcast_many`
SINGLE = TpGroup()
_current: list[TpGroup] = []


@contextlib.contextmanager
def tp_context(group: TpGroup) -> Iterator[TpGroup]:
    """Layers built inside read `group` from `current_tp()`; contexts do not nest."""
    if _current:
        raise RuntimeError("tp_context does not nest")
    _current.append(group)
    try:
        yield group
    finally:
        _current.clear()


def current_tp() -> TpGroup:
    """The group of the model being built (one rank outside `tp_context`)."""
    return _current[0] if _current else SINGLE
