"""Checkpoint name -> tide parameter (and row shard of a fused parameter).

Every weight path (initial load, and later updates from disk, tensors, a process group or IPC) goes
through `WeightMap`, so validation happens the same way everywhere: `plan()` checks every name, shape
and dtype before anything is written, and `write()` only ever runs on a validated plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

# (fused param name, checkpoint name, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor (of `shape`) goes: rows [row_start, row_start + local_shape[0]) of
    `param_name`. Under tensor parallelism this rank holds only `split` = (dim, start, size) of it:
    `local_shape` is `shape` with `size` at `dim`."""

    name: str
    param_name: str
    shard: str | int | None
    row_start: int
    shape: tuple[int, ...]
    split: tuple[int, int, int] | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.split is None:
            return self.shape
        dim, _, size = self.split
        return (*self.shape[:dim], size, *self.shape[dim + 1:])


class WeightMap:
    """A model may define `map_checkpoint_name(name) -> str | None` (a static method) to rename
    checkpoint tensors before the fused-name mapping, or drop them with None (e.g. the vision tower
    of a multimodal checkpoint whose text tower tide serves)."""

    def __init__(self, model: nn.Module) -> None:
        # Derived parameters (an fp8 copy of a weight, `tide.layers.fp8`) are no checkpoint's.
        self.params: dict[str, nn.Parameter] = {
            name: p for name, p in model.named_parameters() if not getattr(p, "derived", False)}
        config = getattr(model, "config", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.rename: Callable[[str], str | None] | None = getattr(model, "map_checkpoint_name", None)

    def resolve(self, name: str) -> WeightTarget | None:
        """The target of checkpoint tensor `name`, or None for tensors tide ignores."""
        key = name
        if self.rename is not None:
            renamed = self.rename(name)
            if renamed is None:
                return None
            key = renamed
        if key.endswith(IGNORED_SUFFIXES) or (self.tied and key == "lm_head.weight"):
            return None
        for fused, part, shard in STACKED_PARAMS:
            if f".{part}." in key:
                param_name = key.replace(f".{part}.", f".{fused}.")
                param = self.params.get(param_name)
                offsets = getattr(param, "shard_offsets", None)
                if param is None or offsets is None:
                    break
                start, size = offsets[shard]
                return _target(name, param_name, shard, start, param, (size, *param.shape[1:]))
        param = self.params.get(key)
        if param is None:
            raise ValueError(f"weight {name!r} is not a parameter of this model")
        return _target(name, key, None, 0, param, tuple(param.shape))

    def required(self) -> set[tuple[str, str | int | None]]:
        """Every (param, shard) a complete checkpoint must provide."""
        out: set[tuple[str, str | int | None]] = set()
        for name, param in self.params.items():
            offsets = getattr(param, "shard_offsets", None)
            if offsets is None:
                out.add((name, None))
            else:
                out.update((name, shard) for shard in offsets)
        return out

    def plan(
        self,
        shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
        require_complete: bool = False,
        sharded: bool = False,
    ) -> list[WeightTarget]:
        """Validate (name, shape, dtype) triples; raise ValueError naming the first bad weight.
        `sharded`: the tensors are this rank's parts already (shapes are `local_shape`s)."""
        targets: list[WeightTarget] = []
        written_by: dict[tuple[str, str | int | None], str] = {}
        for name, shape, dtype in shapes:
            target = self.resolve(name)
            if target is None:
                # A tied model's output head is its embedding: not written (the embedding's own
                # tensor is), but checked like it, so a wrong tensor is not reported as taken.
                target = self._tied_head(name)
                if target is not None:
                    _check_shape_dtype(name, shape, dtype, target, sharded)
                continue
            other = written_by.setdefault((target.param_name, target.shard), name)
            if other != name:
                raise ValueError(
                    f"weights {other!r} and {name!r} both map to {target.param_name!r}"
                    + (f" shard {target.shard!r}" if target.shard is not None else "")
                )
            _check_shape_dtype(name, shape, dtype, target, sharded)
            targets.append(target)
        if require_complete:
            missing = self.required() - {(t.param_name, t.shard) for t in targets}
            if missing:
                names = sorted(_describe(p, s) for p, s in missing)
                raise ValueError(f"checkpoint is missing weight(s) {names[:8]}" + (
                    f" and {len(names) - 8} more" if len(names) > 8 else ""))
        return targets

    def _tied_head(self, name: str) -> WeightTarget | None:
        """The embedding's target, for the output head `name` of a tied model; else None."""
        key = self.rename(name) if self.rename is not None else name
        if not (self.tied and key == "lm_head.weight"):
            return None
        embedding = next((n for n in self.params if n.endswith("embed_tokens.weight")), None)
        return None if embedding is None else self.resolve(embedding)

    def rows(self, target: WeightTarget) -> torch.Tensor:
        """The parameter memory `target` writes to (a view)."""
        param = self.params[target.param_name]
        return param.data[target.row_start : target.row_start + target.local_shape[0]]

    def write(self, target: WeightTarget, tensor: torch.Tensor, sharded: bool = False) -> None:
        """Copy this rank's part of checkpoint tensor `tensor` (with `sharded`: `tensor` is that
        part) into the model."""
        part = tensor if sharded else local_part(target, tensor)
        self.rows(target).copy_(part, non_blocking=True)


def local_part(target: WeightTarget, tensor: torch.Tensor) -> torch.Tensor:
    """The part of the full checkpoint tensor `tensor` that this rank holds (a view)."""
    if target.split is None:
        return tensor
    dim, start, size = target.split
    return tensor.narrow(dim, start, size)


def _target(name: str, param_name: str, shard: str | int | None, row_start: int,
            param: nn.Parameter, local_shape: tuple[int, ...]) -> WeightTarget:
    split = getattr(param, "tp_split", {}).get(shard)
    if split is None:
        return WeightTarget(name, param_name, shard, row_start, local_shape)
    dim, start, size, full = split
    shape = (*local_shape[:dim], full, *local_shape[dim + 1:])
    return WeightTarget(name, param_name, shard, row_start, shape, (dim, start, size))


def _describe(param_name: str, shard: str | int | None) -> str:
    if shard is None:
        return param_name
    for fused, part, sid in STACKED_PARAMS:
        if sid == shard and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{part}.")
    return f"{param_name}[{shard}]"


def _check_shape_dtype(name: str, shape: tuple[int, ...], dtype: torch.dtype, target: WeightTarget,
                       sharded: bool) -> None:
    """ValueError naming checkpoint tensor `name` unless it has `target`'s shape (this rank's part
    with `sharded`) and a floating dtype."""
    expected = target.local_shape if sharded else target.shape
    if tuple(shape) != expected:
        raise ValueError(
            f"weight {name!r} has shape {tuple(shape)}, expected {expected}"
            + (" (this rank's part)" if sharded and target.split is not None else "")
        )
    if not dtype.is_floating_point:
        raise ValueError(f"weight {name!r} has dtype {dtype}, expected a floating dtype")
