"""Flattened buckets: many tensors of one dtype packed into one contiguous 1-D buffer, plus
(name, shape, dtype, offset, numel) metadata — one copy per dtype instead of one per tensor.

How buckets and named tensors travel between processes (`serialize_named_tensors`) is
`tide.weights.wire`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int


@dataclass
class FlattenedBucket:
    """Tensors of one dtype in one buffer. Invariant: `metadata[i]` describes
    `flattened_tensor[offset : offset + numel]`, reshaped to `shape`."""

    flattened_tensor: torch.Tensor
    metadata: list[TensorMeta]

    @classmethod
    def from_named_tensors(cls, named: Sequence[tuple[str, torch.Tensor]]) -> "FlattenedBucket":
        if not named:
            raise ValueError("a flattened bucket needs at least one tensor")
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
        metadata, offset = [], 0
        for name, t in named:
            metadata.append(TensorMeta(name, tuple(t.shape), t.dtype, offset, t.numel()))
            offset += t.numel()
        flat = torch.cat([t.reshape(-1) for _, t in named])
        return cls(flat, metadata)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer (no copy); raises ValueError if the metadata does not fit it."""
        flat = self.flattened_tensor
        if flat.dim() != 1:
            raise ValueError("flattened_tensor must be 1-D")
        out = []
        for m in self.metadata:
            if m.dtype != flat.dtype:
                raise ValueError(f"weight {m.name!r}: metadata dtype {m.dtype} != buffer {flat.dtype}")
            numel = 1
            for d in m.shape:
                numel *= d
            if numel != m.numel or m.offset < 0 or m.offset + m.numel > flat.numel():
                raise ValueError(f"weight {m.name!r}: metadata does not fit the flattened buffer")
            out.append((m.name, flat[m.offset : m.offset + m.numel].view(m.shape)))
        return out


def flatten_by_dtype(named: Sequence[tuple[str, torch.Tensor]]) -> list[FlattenedBucket]:
    """One bucket per dtype, in first-seen order."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault(t.dtype, []).append((name, t))
    return [FlattenedBucket.from_named_tensors(g) for g in groups.values()]
