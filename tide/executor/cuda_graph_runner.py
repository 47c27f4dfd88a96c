"""CUDA-graph decode: one graph per batch-size bucket, replayed over static input buffers.

A batch of size n runs in the smallest bucket >= n; the extra rows are a dummy request (the reserved
request slot, whose row maps every position to KV slot 0, sequence length 1, writing its K/V to slot 0).
Hybrid sliding-window models (two KV pools) also take `out_cache_loc_swa`, the new tokens' SWA slots,
translated on device once per step before the replay (padded rows: SWA slot 0, the SWA pool's dummy
slot), so the captured graph never translates full slots itself.
All graphs share one memory pool, read their inputs from one `DecodeInputBuffers` and write their
logits into one shared buffer (so the pool holds only transients). The buffer has the model's dtype:
the LM head writes its product there directly, and the argmax reads it at half the bytes of fp32
(the sampler widens rows to fp32 where it needs them, which gives the same values: every model-dtype
value is exact in fp32). With the memory saver on CUDA that buffer is an address-stable `VmmRegion`,
released and re-taken with the `cuda_graph` tag.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tide.executor.forward_batch import ForwardBatch, ForwardMode
from tide.memory.swa import SWAKVPool

if TYPE_CHECKING:
    from tide.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def default_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs] or [max_bs]


@dataclass
class DecodeInputBuffers:
    """Static device inputs of the captured decode graphs (sized for the largest bucket).

    `out_cache_loc_swa` (int32) exists only for a two-pool KV cache. Every replay overwrites all
    `bucket` rows it reads, padded rows included, so no row keeps a slot of an earlier batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    out_cache_loc_swa: torch.Tensor | None = None

    @classmethod
    def create(cls, max_bs: int, device: torch.device, dummy_req_slot: int,
               swa: bool = False) -> "DecodeInputBuffers":
        """Allocate once; every graph reads views of these tensors. `swa`: a two-pool KV cache."""

        def full(value: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.full((max_bs,), value, dtype=dtype, device=device)

        return cls(full(0), full(0), full(dummy_req_slot), full(1), full(0),
                   full(0, torch.int32) if swa else None)

    def fields(self) -> list[torch.Tensor]:
        out = [self.input_ids, self.positions, self.req_pool_indices, self.seq_lens,
               self.out_cache_loc]
        return out + ([self.out_cache_loc_swa] if self.out_cache_loc_swa is not None else [])

    def populate_from_forward_batch(self, fb: ForwardBatch) -> None:
        """Copy the batch's (already bucket-padded) inputs in, one grouped copy per dtype pair."""
        sources = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc]
        if self.out_cache_loc_swa is not None:
            if fb.out_cache_loc_swa is None:
                raise ValueError("a two-pool decode batch needs out_cache_loc_swa")
            sources.append(fb.out_cache_loc_swa)
        groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dst, src in zip(self.fields(), sources):
            dsts, srcs = groups.setdefault((dst.dtype, src.dtype), ([], []))
            dsts.append(dst[: src.shape[0]])
            srcs.append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)


class CudaGraphRunner:
    def __init__(self, runner: "ModelRunner", batch_sizes: list[int]) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.buffers = DecodeInputBuffers.create(
            self.max_bs, runner.device, runner.req_to_token_pool.dummy_slot,
            swa=isinstance(runner.token_to_kv_pool, SWAKVPool),
        )
        vocab = runner.model_config.vocab_size
        self.logits_region = None
        if runner.use_vmm:
            from tide.memory.vmm import VmmRegion, region_nbytes

            shape = ((self.max_bs, vocab), runner.dtype)
            self.logits_region = VmmRegion(region_nbytes([shape]), runner.device)
            self.logits = self.logits_region.tensor(*shape)
        else:
            self.logits = torch.empty(self.max_bs, vocab, dtype=runner.dtype, device=runner.device)
        # Each replay also leaves every row's argmax here, so greedy sampling needs no extra launch.
        self.greedy_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.suspended = False  # the `cuda_graph` memory is released: replay nothing
        self.pool: tuple[int, int] | None = None
        self.capture()

    def bucket(self, bs: int) -> int | None:
        """The captured batch size that serves `bs` (None: run eager, also while suspended)."""
        if not self.graphs or self.suspended:
            return None
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def _forward_batch(self, bs: int) -> ForwardBatch:
        b = self.buffers
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=b.input_ids[:bs],
            positions=b.positions[:bs],
            req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs],
            out_cache_loc=b.out_cache_loc[:bs],
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            attn_backend=self.runner.attn_backend,
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            logits_out=self.logits[:bs],
            out_cache_loc_swa=(b.out_cache_loc_swa[:bs] if b.out_cache_loc_swa is not None
                               else None),
        )

    def release(self) -> None:
        """Drop every graph, its memory pool and the logits buffer (decode runs eager until
        `capture()` again). Not for a `logits_region`, which is unmapped instead."""
        self.graphs.clear()
        self.pool = None
        self.logits.untyped_storage().resize_(0)

    @torch.inference_mode()
    def capture(self) -> None:
        from tide.layers import triton_ops

        storage = self.logits.untyped_storage()
        if storage.nbytes() == 0:  # freed by release()
            storage.resize_(self.logits.numel() * self.logits.element_size())
        self.pool = torch.cuda.graph_pool_handle()
        model = self.runner.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                fb = self._forward_batch(bs)
                backend = self.runner.attn_backend
                for _ in range(2):
                    backend.init_forward_metadata(fb)
                    model(fb.input_ids, fb.positions, fb)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    fb.record_decode_slots()
                    # Decode metadata is built on device from the static buffers, inside the graph.
                    backend.init_forward_metadata(fb)
                    model(fb.input_ids, fb.positions, fb)
                    triton_ops.argmax_rows(self.logits[:bs], self.greedy_ids[:bs])
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def replay(self, fb: ForwardBatch, real_bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`fb` is padded to a bucket size; returns logits and argmax ids of the first `real_bs`
        rows (views of shared buffers, valid until the next replay)."""
        bs = fb.input_ids.shape[0]
        self.buffers.populate_from_forward_batch(fb)
        self.graphs[bs].replay()
        return self.logits[:real_bs], self.greedy_ids[:real_bs]
