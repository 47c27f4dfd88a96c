"""Reference attention: SDPA per request over K/V gathered through `req_to_token`. Runs anywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tide.layers.attention.base import AttentionBackend, register

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch
    from tide.layers.attention.layer import Attention


@register("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    def forward_extend(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch"
    ) -> torch.Tensor:
        return self._run(q, layer, fb, causal=True)

    def forward_decode(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch"
    ) -> torch.Tensor:
        return self._run(q, layer, fb, causal=False)

    def _run(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch", causal: bool
    ) -> torch.Tensor:
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        k_cache = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = fb.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = fb.req_to_token_pool.req_to_token
        start = 0
        for i, seq_len in enumerate(fb.seq_lens_cpu):
            n_new = fb.extend_lens_cpu[i] if causal else 1
            slots = req_to_token[fb.req_pool_indices[i], :seq_len]
            k = k_cache[slots].transpose(0, 1)  # [Hk, S, D]
            v = v_cache[slots].transpose(0, 1)
            qi = q[start : start + n_new].transpose(0, 1)  # [Hq, N, D]
            mask = None
            if causal and n_new > 1:
                prefix = seq_len - n_new
                rows = torch.arange(n_new, device=q.device).unsqueeze(1) + prefix
                cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
                mask = cols <= rows
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[start : start + n_new] = o.squeeze(0).transpose(0, 1)
            start += n_new
        return out.view(-1, layer.num_heads * layer.head_dim)
