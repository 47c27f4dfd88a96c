"""Attention on GPUs with tide's Triton kernels (see `triton_kernels`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tide.layers.attention.base import AttentionBackend, register
from tide.layers.norm import GemmaRMSNorm

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch
    from tide.executor.model_runner import ModelRunner
    from tide.layers.attention.layer import Attention

DEFAULT_NUM_KV_SPLITS = 128


@register("triton")
class TritonAttnBackend(AttentionBackend):
    """Decode metadata lives in buffers sized for `max_batch_size`, so a captured CUDA graph keeps
    pointing at the same memory; extend metadata is built per batch."""

    supports_cuda_graph = True
    # Sliding layers read only the keys in their window (splits sized by the visible length, key
    # loops starting at the first visible block); scores are soft-capped in the kernels.
    supports_sliding_window = True
    supports_logit_cap = True
    # Triton's e4m3 type and the kernels' `cvt.*.e4m3x2` widening need sm_89 (Ada, Hopper) or newer.
    fp8_kv_min_capability = (8, 9)

    @classmethod
    def create(cls, runner: "ModelRunner") -> "TritonAttnBackend":
        mc = runner.model_config
        return cls(runner.num_heads, runner.num_kv_heads, mc.head_dim,
                   runner.max_batch_size, runner.device,
                   deterministic=runner.config.enable_deterministic_inference,
                   max_context_len=runner.context_len, dtype=runner.dtype)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_batch_size: int,
                 device: torch.device, max_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
                 deterministic: bool = False, max_context_len: int | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """`deterministic`: decode and extend both run `batch_invariant_triton.attention` (one
        kernel; a token's keys split at fixed positions and merged in order). With
        `max_context_len`, small decode batches run those splits in parallel programs (scratch
        for them is allocated here); without it every split runs in one program. `dtype`: the
        model's (the deterministic decode's row count is checked for it)."""
        from tide.layers.attention import triton_kernels

        self.kernels = triton_kernels
        self.deterministic = deterministic
        self._det_scratch = None
        if deterministic and max_context_len is not None:
            from tide.layers.batch_invariant_triton import DecodeSplitScratch

            limit = DecodeSplitScratch.parallel_batch_limit(num_kv_heads, device)
            batch = DecodeSplitScratch.scratch_batch(min(limit, max_batch_size), num_heads,
                                                     head_dim, max_context_len)
            self._det_scratch = DecodeSplitScratch(batch, num_heads, head_dim, max_context_len,
                                                   device)
        if deterministic:
            from tide.layers.batch_invariant_triton import decode_tiles_agree

            # Before any graph capture: whether decode programs may take fewer rows than extend's.
            decode_tiles_agree(num_heads, num_kv_heads, head_dim, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_kv_splits = max_kv_splits
        # Split-KV scratch, sized for the largest batch x splits any batch size uses (small batches
        # split more), and viewed per batch size: the views of a captured graph never move.
        rows = max(bs * self._splits(bs) for bs in range(1, max_batch_size + 1))
        self._mid_o = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
        self._mid_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        self._extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._decode_order: torch.Tensor | None = None  # deterministic decode: rows, longest first

    def store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention",
                 fb: "ForwardBatch", positions: torch.Tensor | None) -> torch.Tensor:
        """One fused launch: norm (Gemma-3) and rotate q in place, write rotated k and v into the
        KV pool."""
        rotary = layer.rotary
        if rotary is None or positions is None:
            return super().store_kv(q, k, v, layer, fb, positions)
        norms = layer.qk_norm
        if norms is not None and (norms[0].eps != norms[1].eps or type(norms[0]) is not type(norms[1])):
            return super().store_kv(q, k, v, layer, fb, positions)
        from tide.layers import triton_ops

        pool = fb.token_to_kv_pool
        triton_ops.rope_and_store_kv(
            positions, q, k, v, rotary.cos_cache, rotary.sin_cache, layer.num_heads,
            layer.num_kv_heads, layer.head_dim, fb.cache_loc(layer.layer_id),
            pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            qk_norm=None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps,
                                                isinstance(norms[0], GemmaRMSNorm)),
        )
        return q

    def _splits(self, bs: int) -> int:
        return self.kernels.num_kv_splits(bs * self.num_kv_heads, self.max_kv_splits)

    def _scratch(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        splits = self._splits(bs)
        n = bs * self.num_heads * splits
        return (self._mid_o[: n * self.head_dim].view(bs, self.num_heads, splits, self.head_dim),
                self._mid_lse[:n].view(bs, self.num_heads, splits))

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.is_decode:
            if self.deterministic:
                from tide.layers.batch_invariant_triton import decode_order

                # Once per step, on device (inside a captured graph too): every layer's programs
                # start with the longest requests. Batches whose splits run in parallel programs
                # (`_det_scratch`) do not use it.
                bs = fb.seq_lens.shape[0]
                parallel = self._det_scratch is not None and bs <= self._det_scratch.max_batch
                self._decode_order = None if parallel else decode_order(fb.seq_lens)
            return
        device = fb.input_ids.device
        starts = [0]
        for n in fb.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + n)
        meta = torch.tensor(
            [fb.prefix_lens_cpu, fb.extend_lens_cpu, starts], dtype=torch.int64
        ).to(device, non_blocking=True)
        self._extend = (meta[0], meta[1], meta[2], max(fb.extend_lens_cpu))

    def forward_decode(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        bs = fb.req_pool_indices.shape[0]
        q = q.view(bs, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        if self.deterministic:
            return self._deterministic(q, out, layer, fb, None).view(bs, -1)
        mid_o, mid_lse = self._scratch(bs)
        self.kernels.decode_attention(
            q,
            fb.token_to_kv_pool.get_key_buffer(layer.layer_id),
            fb.token_to_kv_pool.get_value_buffer(layer.layer_id),
            out,
            fb.req_to_token_for(layer.layer_id),
            fb.req_pool_indices,
            fb.seq_lens,
            mid_o,
            mid_lse,
            layer.scaling,
            sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap,
        )
        return out.view(bs, -1)

    def forward_extend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        assert self._extend is not None, "init_forward_metadata must run before the layers"
        prefix_lens, extend_lens, starts, max_len = self._extend
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        if self.deterministic:
            extend = (extend_lens, starts, max_len)
            return self._deterministic(q, out, layer, fb, extend).view(q.shape[0], -1)
        self.kernels.extend_attention(
            q,
            fb.token_to_kv_pool.get_key_buffer(layer.layer_id),
            fb.token_to_kv_pool.get_value_buffer(layer.layer_id),
            out,
            fb.req_to_token_for(layer.layer_id),
            fb.req_pool_indices,
            prefix_lens,
            extend_lens,
            starts,
            max_len,
            layer.scaling,
            sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap,
        )
        return out.view(q.shape[0], -1)

    def _deterministic(self, q: torch.Tensor, out: torch.Tensor, layer: "Attention",
                       fb: "ForwardBatch",
                       extend: tuple[torch.Tensor, torch.Tensor, int] | None) -> torch.Tensor:
        from tide.layers import batch_invariant_triton

        batch_invariant_triton.attention(
            q, fb.token_to_kv_pool.get_key_buffer(layer.layer_id),
            fb.token_to_kv_pool.get_value_buffer(layer.layer_id), out,
            fb.req_to_token_for(layer.layer_id), fb.req_pool_indices, fb.seq_lens, layer.scaling,
            extend=extend, scratch=self._det_scratch, sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap, longest_first=self._decode_order if extend is None else None,
        )
        return out
