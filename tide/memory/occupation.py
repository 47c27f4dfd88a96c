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
`enable_cpu_backup` (`WeightsBackup`: one host buffer as large as the weights, pinned on CUDA,
allocated on the first release and reused by every later one until `close()`); otherwise they come
back zeroed and the engine refuses to generate until a weight update has covered every parameter.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tide.memory.host import HostBuffer
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


def parse_tags(tags: Iterable[str] | str | None, allowed: tuple[str, ...] = TAGS) -> list[str]:
    """None means every tag of `allowed`; otherwise a list of known tags (ValueError naming `tags`),
    in `allowed` order. The diffusion engine passes its own tags."""
    if tags is None:
        return list(allowed)
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    if not tags or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be null or a non-empty list of {list(allowed)}")
    unknown = [t for t in tags if t not in allowed]
    if unknown:
        raise ValueError(f"tags {unknown} are not known; allowed tags: {list(allowed)}")
    return [t for t in allowed if t in tags]

_SPAN_ALIGN = 256


class WeightsBackup:
    """The host copy of the weights while their device memory is released (`enable_cpu_backup`).

    Layout: one `HostBuffer` (pinned on CUDA) holds every weight byte as a few large spans: with the
    address-stable weights region, its used bytes as one span; otherwise each parameter storage's
    bytes, one span each. The buffer is allocated by the first `save()` and reused by every later
    one; it is freed only by `close()` (engine shutdown, or `Engine.drop_cpu_backup()`), so it costs
    as much host memory as the weights (16 GB for an 8B bf16 model) from the first release on.

    Copies run on a side stream ordered after the work already queued on the current stream, split
    at the buffer's pinned chunks; on the first save, the copy into a chunk starts as soon as that
    chunk is pinned, while the next ones are being pinned. The host then waits for that stream
    only, never for the whole device.

    Invariant: `valid` is True exactly from a `save()` to the `restore()` that consumes it, so a
    backup is restored at most once, and never over weights written after it was taken.
    """

    def __init__(self, runner: OccupationTarget) -> None:
        self.runner = runner
        self.buffer: HostBuffer | None = None
        self.valid = False
        self.allocations = 0  # host buffers allocated so far (1 after any number of cycles)
        self.last_save_s = 0.0  # seconds of the last save (pinning a new buffer's chunks included)
        self.last_restore_s = 0.0
        self._stream: torch.cuda.Stream | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory held for the backup now (0 before the first release and after close)."""
        return self.buffer.nbytes if self.buffer is not None else 0

    def _spans(self) -> list[torch.Tensor]:
        """The weights' device bytes, as uint8 tensors, in a fixed order. Derived parameters (fp8
        copies of weights, `tide.layers.fp8`) are left out: a restore recomputes them."""
        params = list(self.runner.model.parameters())
        derived = [p for p in params if getattr(p, "derived", False)]
        region = self.runner.weights_region
        if region is not None:
            used = region.used_bytes()
            if derived:  # ModelRunner's region puts them after every checkpoint parameter
                cut = min(p.data_ptr() for p in derived) - used.data_ptr()
                if all(p.data_ptr() + p.numel() * p.element_size() - used.data_ptr() <= cut
                       for p in params if not getattr(p, "derived", False)):
                    used = used[:cut]
            return [used]
        seen: dict[int, torch.Tensor] = {}
        for p in params:
            if getattr(p, "derived", False):
                continue
            storage = p.data.untyped_storage()
            if storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = torch.empty(
                    0, dtype=torch.uint8, device=storage.device).set_(storage)
        return list(seen.values())

    @staticmethod
    def _layout(spans: list[torch.Tensor]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for span in spans:
            start = -(-end // _SPAN_ALIGN) * _SPAN_ALIGN
            offsets.append(start)
            end = start + span.numel()
        return offsets, end

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.runner.device)
        return self._stream

    def _transfer(self, spans: list[torch.Tensor], offsets: list[int], to_host: bool) -> None:
        """Copy between the spans and the host buffer, chunk by chunk of the buffer (a copy never
        straddles two of its pinned chunks). On CUDA the copies run on the side stream, ordered
        after the current stream's queued work, and the copy into a chunk is queued as soon as
        that chunk is pinned (the first save pins while earlier chunks copy); returns once done."""
        assert self.buffer is not None and self.buffer.tensor is not None  # open
        host = self.buffer.tensor
        cuda = self.runner.device.type == "cuda"
        stream = self._side_stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        for lo, hi in self.buffer.pin_chunks():
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for offset, span in zip(offsets, spans):
                    a, b = max(lo, offset), min(hi, offset + span.numel())
                    if b <= a:
                        continue
                    dev, cpu = span[a - offset : b - offset], host[a:b]
                    (cpu if to_host else dev).copy_(dev if to_host else cpu, non_blocking=cuda)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()

    def save(self) -> None:
        """Copy every weight byte to the host buffer (allocated on the first call)."""
        spans = self._spans()
        offsets, total = self._layout(spans)
        if self.buffer is None or self.buffer.nbytes < total:
            self.close()
            self.buffer = HostBuffer(total, pin=self.runner.device.type == "cuda")
            self.allocations += 1
        self.valid = False
        start = time.perf_counter()
        self._transfer(spans, offsets, to_host=True)
        self.last_save_s = time.perf_counter() - start
        self.valid = True

    def restore(self) -> bool:
        """Copy the backup into the (re-taken) weights memory; False, and nothing written, when no
        valid backup exists. A backup is consumed by its restore."""
        if not self.valid or self.buffer is None or self.buffer.tensor is None:
            return False
        spans = self._spans()
        offsets, total = self._layout(spans)
        if total > self.buffer.nbytes:
            raise RuntimeError("the weights' layout changed while they were released")
        start = time.perf_counter()
        self._transfer(spans, offsets, to_host=False)
        self.last_restore_s = time.perf_counter() - start
        self.valid = False
        return True

    def close(self) -> None:
        """Free the host buffer (a valid backup is lost: callers refuse while weights are released)."""
        self.valid = False
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class MemoryOccupation:
    """Which tags are released, how many bytes each gave back, and the weights' host copy."""

    def __init__(self, runner: OccupationTarget, enable_cpu_backup: bool,
                 ledger: MemoryLedger | None) -> None:
        self.runner = runner
        self.ledger = ledger
        self.enable_cpu_backup = enable_cpu_backup
        self._released: dict[str, int] = {}
        self._freed_sizes: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self.backup = WeightsBackup(runner)
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
                self.backup.save()
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
                storages = self._storages(tag)
                self._freed_sizes[tag] = [(st, st.nbytes()) for st in storages]
                for storage in storages:
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
            for storage, size in self._freed_sizes.pop(tag, []):
                storage.resize_(size)  # each storage at its size before release (shared ones too)
            if tag == "weights":
                self._restore_weights()
            else:
                for t in self._kv_tensors():
                    t.zero_()
            logger.info("resumed %s (%.1f MiB)", tag, nbytes / 2**20)

    def drop_cpu_backup(self) -> int:
        """Free the host buffer of the weights backup; returns the bytes given back. ValueError while
        the weights are released (their only copy is in it)."""
        if self.is_released("weights"):
            raise ValueError("the weights are released and their CPU backup is their only copy; "
                             "resume_memory_occupation(['weights']) first")
        freed = self.backup.host_bytes
        self.backup.close()
        return freed

    def close(self) -> None:
        """Free the host backup (engine shutdown)."""
        self.backup.close()

    def _restore_weights(self) -> None:
        if self.backup.restore():
            self.weights_need_refill = False
            requantized = False
            for module in self.runner.model.modules():  # fp8 copies, from the restored weights
                if getattr(module, "weight_fp8", None) is not None:
                    module.requantize()  # type: ignore[operator]
                    requantized = True
            if requantized and self.runner.device.type == "cuda":
                torch.cuda.current_stream(self.runner.device).synchronize()
            return
        params = list(self.runner.model.parameters())
        for p in params:
            p.data.zero_()
        self.weights_need_refill = True
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
