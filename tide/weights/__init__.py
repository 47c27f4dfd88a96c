"""Checkpoint loading and the one place that maps checkpoint names to tide's parameters."""

from tide.weights.loader import (
    checkpoint_files,
    init_dummy_weights,
    iter_checkpoint,
    load_checkpoint,
    read_checkpoint_shapes,
)
from tide.weights.mapping import WeightMap, WeightTarget

__all__ = [
    "WeightMap",
    "WeightTarget",
    "checkpoint_files",
    "init_dummy_weights",
    "iter_checkpoint",
    "load_checkpoint",
    "read_checkpoint_shapes",
]
