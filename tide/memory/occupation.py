"""Releasing and re-taking the memory of tagged tensors (colocated RL: hand the GPU to the trainer).

Tags: `kv_cache` (the per-layer K/V buffers and the request-to-token table), `weights` (model
parameters; buffers such as rotary tables are not weights and stay), `cuda_graph` (the captured decode
graphs: their shared logits buffer, and on the portable path the graphs and their pool).

On CUDA with the driver's virtual-memory API (the model runner's `use_vmm`), weights, KV and the
graphs' shared logits buffer live in `VmmRegion`s: release unmaps their physical memory and resume maps
new memory at the same addresses, so captured CUDA graphs stay valid and are kept (their small
transient pool stays too). While `cuda_graph` is released, decode runs eager. Elsewhere (CPU, or CUDA
without that API) release frees a tag's storages in place (`untyped_storage().resize_(0)`, every tensor
stays the same Python object), resume allocates them again, and a CUDA-graph runner drops its graphs
and re-captures. Either way, freed blocks go back to the driver through
`empty_device_cache(reason="release_memory")`. Weights come back from a host copy when
`enable_cpu_backup` (pinned buffers allocated on the first release and refreshed on each); otherwise
they come back zeroed and the engine refuses to generate until a weight update has covered every
parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tide.memory.ledger import MemoryLedger
from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool
from tide.memory.release import empty_device_cache
from tide.memory.swa import SWAKVPool

if TYPE_CHECKING:
    from tide.memory.vmm import VmmRegion


class GraphMemory(Protocol):
    """The captured decode graphs (`tide.executor.CudaGraphRunner`) as occupation sees them."""

    suspended: bool  # True: replay nothing (decode runs eager)

    @property
    def logits_region(self) -> VmmRegion | None: ...

    def release(self) -> None: ...

    def capture(self) -> None: ...


class OccupationTarget(Protocol):
    """What occupation releases and resumes: the model runner's weights, KV pools and graphs."""

    @property
    def device(self) -> torch.device: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...

    @property
    def token_to_kv_pool(self) -> MHATokenToKVPool | SWAKVPool: ...

    @property
    def cuda_graph_runner(self) -> GraphMemory | None: ...

    @property
    def weights_region(self) -> VmmRegion | None: ...

    @property
    def use_vmm(self) -> bool: ...

logger = logging.getLogger(__name__)

TAGS = ("kv_cache", "weights", "cuda_graph")


def parse_tags(tags: Iterable[str] | str | None) -> list[str]:
    """None means every tag; otherwise a list of known tags (ValueError naming `tags`)."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    if not tags or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be null or a non-empty list of {list(TAGS)}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags {unknown} are not known; allowed tags: {list(TAGS)}")
    return [t for t in TAGS if t in tags]


class MemoryOccupation:
    """Which tags are released, how many bytes each gave back, and the weights' host copy."""

    def __init__(self, runner: OccupationTarget, enable_cpu_backup: bool,
                 ledger: MemoryLedger | None) -> None:
        self.runner = runner
        self.ledger = ledger
        self.enable_cpu_backup = enable_cpu_backup
        self._released: dict[str, int] = {}
        self._backup: dict[str, torch.Tensor] = {}  # filled while weights are released
        self._host: dict[str, torch.Tensor] = {}  # pinned host buffers, kept for the next release
        self.weights_need_refill = False

    def released_bytes(self) -> dict[str, int]:
        return {tag: self._released.get(tag, 0) for tag in TAGS}

    def is_released(self, tag: str) -> bool:
        return tag in self._released

    def _region(self, tag: str) -> VmmRegion | None:
        if tag == "kv_cache":
            return self.runner.token_to_kv_pool.region
        if tag == "weights":
            return self.runner.weights_region
        graphs = self.runner.cuda_graph_runner
        return graphs.logits_region if graphs is not None else None

    def _kv_tensors(self) -> list[torch.Tensor]:
        pool = self.runner.token_to_kv_pool
        tables = self.runner.req_to_token_pool
        swa = [tables.req_to_token_swa] if tables.req_to_token_swa is not None else []
        return [tables.req_to_token, *swa, *pool.k_buffer, *pool.v_buffer]

    # ---- storages per tag
    def _storages(self, tag: str) -> list[torch.UntypedStorage]:
        if tag == "kv_cache":
            tensors = self._kv_tensors()
        elif tag == "weights":
            tensors = [p.data for p in self.runner.model.parameters()]
        else:
            return []
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), s)
        return list(seen.values())

    # ---- release / resume
    def release(self, tags: list[str]) -> int:
        """Free the tags' memory; returns the bytes given back. Tags already released are skipped."""
        freed = 0
        for tag in tags:
            if tag in self._released:
                continue
            nbytes = 0
            region = self._region(tag)
            if tag == "weights" and self.enable_cpu_backup:
                self._backup_weights()
            if tag == "cuda_graph" and self.runner.cuda_graph_runner is not None:
                self.runner.cuda_graph_runner.suspended = True  # decode runs eager meanwhile
            if region is not None:
                region.unmap()
                nbytes = region.size
            elif tag == "cuda_graph" and self.runner.use_vmm:
                pass  # no graphs: nothing to free
            elif tag == "cuda_graph":
                graphs = self.runner.cuda_graph_runner
                if graphs is not None:
                    before = torch.cuda.memory_reserved(self.runner.device)
                    graphs.release()
                    empty_device_cache(reason="release_memory", ledger=self.ledger)
                    nbytes = max(0, before - torch.cuda.memory_reserved(self.runner.device))
            else:
                for storage in self._storages(tag):
                    nbytes += storage.nbytes()
                    storage.resize_(0)
            self._released[tag] = nbytes
            freed += nbytes
        if self.runner.device.type == "cuda":
            empty_device_cache(reason="release_memory", ledger=self.ledger)
        return freed

    def resume(self, tags: list[str]) -> None:
        """Take the tags' memory again (sizes as before release). Tags not released are skipped."""
        for tag in tags:
            if tag not in self._released:
                continue
            nbytes = self._released.pop(tag)
            region = self._region(tag)
            if region is not None:
                region.remap()
                if tag == "cuda_graph" and self.runner.cuda_graph_runner is not None:
                    self.runner.cuda_graph_runner.suspended = False
                if tag == "weights":
                    self._restore_weights()
                elif tag == "kv_cache":
                    for t in self._kv_tensors():
                        t.zero_()  # the request table's dummy row must map to slot 0 again
                logger.info("resumed %s (%.1f MiB, same addresses)", tag, nbytes / 2**20)
                continue
            if tag == "cuda_graph":
                graphs = self.runner.cuda_graph_runner
                if graphs is not None:
                    if not self.runner.use_vmm:
                        graphs.capture()
                    graphs.suspended = False
                continue
            tensors = (
                [p.data for p in self.runner.model.parameters()]
                if tag == "weights"
                else self._kv_tensors()
            )
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(int(t.numel() + t.storage_offset()) * t.element_size())
            if tag == "weights":
                self._restore_weights()
            else:
                for t in tensors:
                    t.zero_()
            logger.info("resumed %s (%.1f MiB)", tag, nbytes / 2**20)

    def _backup_weights(self) -> None:
        """Copy every parameter to host memory. The (pinned, on CUDA) host buffers are allocated on
        the first release and reused by every later one: pinning 16 GB takes seconds, the copy alone
        a fraction of that."""
        cuda = self.runner.device.type == "cuda"
        for name, p in self.runner.model.named_parameters():
            host = self._host.get(name)
            if host is None or host.shape != p.shape or host.dtype != p.dtype:
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda)
                self._host[name] = host
            host.copy_(p.data, non_blocking=cuda)
            self._backup[name] = host
        if cuda:
            torch.cuda.current_stream(self.runner.device).synchronize()

    def _restore_weights(self) -> None:
        params = dict(self.runner.model.named_parameters())
        if self._backup:
            for name, host in self._backup.items():
                params[name].data.copy_(host, non_blocking=True)
            self._backup = {}
            self.weights_need_refill = False
        else:
            for p in params.values():
                p.data.zero_()
            self.weights_need_refill = True
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()


