"""Attention backends behind one interface, found by name."""

from __future__ import annotations

from tide.layers.attention.base import (
    AttentionBackend,
    get_attention_backend_class,
    register,
    select_attention_backend,
)

__all__ = ["AttentionBackend", "get_attention_backend_class", "register", "select_attention_backend"]

# Register the built-in backends.
from tide.layers.attention import torch_native as _torch_native  # noqa: F401
