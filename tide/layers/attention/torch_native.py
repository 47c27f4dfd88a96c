"""Reference attention over K/V gathered through `req_to_token`, one request at a time. Runs anywhere.

Sliding-window layers gather only the keys a query block can see: queries go in blocks of
`sliding_window` rows, and a block starting at position s reads keys s - window + 1 .. its last
position, so the work per token is O(window) at any context length (not a full-length mask).

Deterministic mode (`enable_deterministic_inference`): every query row attends on its own, over
exactly the keys it can see, as a decode step does. A token's attention is then the same sequence of
operations whether it is computed in one prefill, in any chunk of a chunked prefill, on top of a
cached prefix, or as a decode step, whatever else is in the batch (this also makes the trainer-side
reference `tide.rl.logprobs`, one prefill over prompt + output, equal the engine's decode steps).
It costs one attention call per prompt token per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tide.layers.attention.base import AttentionBackend, register

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch
    from tide.executor.model_runner import ModelRunner
    from tide.layers.attention.layer import Attention


@register("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    supports_sliding_window = True
    supports_logit_cap = True

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    @classmethod
    def create(cls, runner: "ModelRunner") -> "TorchNativeAttnBackend":
        return cls(deterministic=runner.config.enable_deterministic_inference)

    def forward_extend(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch"
    ) -> torch.Tensor:
        return self._run(q, layer, fb, fb.extend_lens_cpu)

    def forward_decode(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch"
    ) -> torch.Tensor:
        return self._run(q, layer, fb, [1] * len(fb.seq_lens_cpu))

    def _run(
        self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch", new_lens: list[int]
    ) -> torch.Tensor:
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        k_cache = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = fb.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = fb.req_to_token_for(layer.layer_id)  # SWA slots for a two-pool sliding layer
        window = layer.sliding_window
        start = 0
        for i, seq_len in enumerate(fb.seq_lens_cpu):
            n_new = new_lens[i]
            prefix = seq_len - n_new
            row = req_to_token[fb.req_pool_indices[i]]
            if self.deterministic:
                block = 1
            else:
                block = window if window is not None else max(n_new, 1)
            for s in range(0, n_new, block):
                e = min(s + block, n_new)
                q_pos = prefix + s  # position of the block's first query
                kv_pos = 0 if window is None else max(0, q_pos - window + 1)
                slots = row[kv_pos : prefix + e]
                # An fp8 cache's values are widened to the query's dtype (a no-op otherwise).
                out[start + s : start + e] = attend(
                    q[start + s : start + e], k_cache[slots].to(q.dtype),
                    v_cache[slots].to(q.dtype), q_pos, kv_pos, layer,
                )
            start += n_new
        return out.view(-1, layer.num_heads * layer.head_dim)


def visible_mask(
    q_pos: int, n_q: int, kv_pos: int, n_kv: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[n_q, n_kv] bool: may the query at position q_pos + r see the key at position kv_pos + c?
    Causal, and with a window: r's position - c's position < sliding_window."""
    rows = torch.arange(q_pos, q_pos + n_q, device=device).unsqueeze(1)
    cols = torch.arange(kv_pos, kv_pos + n_kv, device=device).unsqueeze(0)
    mask = cols <= rows
    if sliding_window is not None:
        mask &= cols > rows - sliding_window
    return mask


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: int, kv_pos: int, layer: "Attention"
) -> torch.Tensor:
    """Attention of queries q [N, Hq, D] at positions q_pos.. over keys/values k, v [S, Hk, D] at
    positions kv_pos..; returns [N, Hq, D]."""
    n_q, n_kv = q.shape[0], k.shape[0]
    mask = None
    if n_q > 1 or kv_pos + n_kv - 1 > q_pos or (
        layer.sliding_window is not None and q_pos - kv_pos >= layer.sliding_window
    ):
        mask = visible_mask(q_pos, n_q, kv_pos, n_kv, layer.sliding_window, q.device)
    qh = q.transpose(0, 1)  # [Hq, N, D]
    kh = k.transpose(0, 1)  # [Hk, S, D]
    vh = v.transpose(0, 1)
    if layer.logit_cap is None:
        o = F.scaled_dot_product_attention(
            qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads,
        ).squeeze(0)
        return o.transpose(0, 1)
    # Soft-capped scores: cap * tanh(s / cap), then the mask, then softmax in fp32 (transformers'
    # order). q heads of one kv head's group ride together: [Hk, G * N, D].
    group = layer.num_heads // layer.num_kv_heads
    qg = qh.reshape(layer.num_kv_heads, group * n_q, -1)
    scores = torch.matmul(qg, kh.transpose(1, 2)) * layer.scaling  # [Hk, G * N, S]
    cap = layer.logit_cap
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.view(layer.num_kv_heads, group, n_q, n_kv).masked_fill(~mask, float("-inf"))
        scores = scores.view(layer.num_kv_heads, group * n_q, n_kv)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(probs, vh)  # [Hk, G * N, D]
    return o.view(layer.num_heads, n_q, -1).transpose(0, 1)
