"""Attention backend interface and registry."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tide.executor.forward_batch import ForwardBatch
    from tide.executor.model_runner import ModelRunner
    from tide.layers.attention.layer import Attention
    from tide.model_config import ModelConfig

logger = logging.getLogger(__name__)


class AttentionBackend:
    """Stores a batch's new K/V in the KV pool and computes attention over the cached K/V.

    A backend reads cached K/V only through `req_to_token` (request slot x position -> KV slot) and
    writes new K/V only at `forward_batch.out_cache_loc`, on every device: models never write the pool.
    """

    supports_cuda_graph = False
    # Model features a backend must implement exactly before a model that uses them may run on it
    # (`select_attention_backend` checks): per-layer sliding windows and attention soft-capping.
    supports_sliding_window = False
    supports_logit_cap = False
    # The oldest CUDA compute capability whose fp8 (e4m3) K/V this backend's kernels can read
    # (None: any). `select_attention_backend` keeps an fp8 cache off backends that need newer GPUs.
    fp8_kv_min_capability: tuple[int, int] | None = None

    @classmethod
    def create(cls, runner: "ModelRunner") -> "AttentionBackend":
        return cls()

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata once, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "Attention",
        forward_batch: "ForwardBatch",
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hk*D] (before RoPE when the layer has a rotary table); returns
        [T, Hq*D]."""
        q = self.store_kv(q, k, v, layer, forward_batch, positions)
        if forward_batch.is_decode:
            return self.forward_decode(q, layer, forward_batch)
        return self.forward_extend(q, layer, forward_batch)

    def store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "Attention",
        forward_batch: "ForwardBatch",
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Norm q and k per head (`layer.qk_norm`, if any), rotate them with the layer's rotary
        table (if any) at `positions`, write k and v into
        the KV pool at `out_cache_loc` (its SWA slots for a sliding layer of a two-pool cache), and
        return q as attention reads it."""
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            q = q_norm(q.reshape(-1, layer.num_heads, layer.head_dim)).reshape(q.shape)
            k = k_norm(k.reshape(-1, layer.num_kv_heads, layer.head_dim)).reshape(k.shape)
        rotary = layer.rotary
        if rotary is not None:
            if positions is None:
                raise ValueError("a layer with a rotary table needs the tokens' positions")
            q_rot, k = rotary(
                positions,
                q.reshape(-1, layer.num_heads, layer.head_dim),
                k.reshape(-1, layer.num_kv_heads, layer.head_dim),
            )
            q = q_rot.reshape(-1, layer.num_heads * layer.head_dim)
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.cache_loc(layer.layer_id),
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.head_dim),
        )
        return q

    def forward_extend(
        self, q: torch.Tensor, layer: "Attention", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(
        self, q: torch.Tensor, layer: "Attention", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        raise NotImplementedError


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _REGISTRY[name] = cls
        return cls

    return wrap


def select_attention_backend(
    name: str, device_type: str, model_config: "ModelConfig",
    fp8_kv_capability: tuple[int, int] | None = None,
) -> type[AttentionBackend]:
    """The backend class for option `attention_backend=name` and this model.

    "auto" picks triton on CUDA unless the model uses a feature the triton backend does not
    declare (`supports_sliding_window`, `supports_logit_cap`; both backends declare both today), or
    the KV cache is fp8 on a GPU older than its fp8 kernels need: then torch_native, which does the
    exact math everywhere. A backend named explicitly that cannot run the model is refused with a
    ValueError rather than run with the wrong math or fail in its kernels. `fp8_kv_capability`: the
    CUDA device's compute capability when the KV cache is fp8 (None otherwise).
    """
    needs = _needed_features(model_config)
    if name == "auto":
        if device_type == "cuda":
            cls = get_attention_backend_class("triton")
            missing = _missing(cls, needs)
            too_old = _fp8_too_old(cls, fp8_kv_capability)
            if not missing and too_old is None:
                return cls
            logger.info("attention_backend auto: torch_native, since triton %s",
                        too_old or f"does not support {' or '.join(missing)} yet")
        return get_attention_backend_class("torch_native")
    cls = get_attention_backend_class(name)
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' runs on CUDA devices (or under Triton's "
                         f"interpreter, TRITON_INTERPRET=1), not {device_type}; use "
                         "attention_backend='auto' or 'torch_native'")
    missing = _missing(cls, needs)
    if missing:
        raise ValueError(
            f"attention_backend {name!r} does not support {' or '.join(missing)} yet, which "
            f"{model_config.architecture} uses; use attention_backend='torch_native' or 'auto'"
        )
    too_old = _fp8_too_old(cls, fp8_kv_capability)
    if too_old is not None:
        raise ValueError(f"kv_cache_dtype 'fp8_e4m3' with attention_backend {name!r}: {name} "
                         f"{too_old}; use kv_cache_dtype='auto' or attention_backend='torch_native'")
    return cls


def _fp8_too_old(cls: type[AttentionBackend], capability: tuple[int, int] | None) -> str | None:
    """Why `cls` cannot read an fp8 KV cache on a GPU of `capability` (None: it can)."""
    need = cls.fp8_kv_min_capability
    if capability is None or need is None or tuple(capability) >= need:
        return None
    return (f"reads fp8 K/V only on GPUs of compute capability {need[0]}.{need[1]} or newer "
            f"(this one is {capability[0]}.{capability[1]})")


def _needed_features(model_config: "ModelConfig") -> list[str]:
    needs = []
    if model_config.has_sliding_layers:
        needs.append("sliding-window attention")
    if model_config.attn_logit_softcapping is not None:
        needs.append("attention logit soft-capping")
    return needs


def _missing(cls: type[AttentionBackend], needs: list[str]) -> list[str]:
    supported = {
        "sliding-window attention": cls.supports_sliding_window,
        "attention logit soft-capping": cls.supports_logit_cap,
    }
    return [n for n in needs if not supported[n]]


def get_attention_backend_class(name: str) -> type[AttentionBackend]:
    if name == "triton" and name not in _REGISTRY:
        try:
            from tide.layers.attention import triton_backend  # noqa: F401
        except ImportError as e:
            raise ValueError(f"attention_backend 'triton' needs triton and CUDA: {e}") from e
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {sorted(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]
