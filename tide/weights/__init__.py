"""Checkpoint loading and the one place that maps checkpoint names to tide's parameters."""

from tide.weights.bucket import FlattenedBucket, flatten_by_dtype
from tide.weights.distributed import WeightUpdateGroup, init_custom_process_group
from tide.weights.loader import (
    checkpoint_files,
    init_dummy_weights,
    load_checkpoint,
    read_checkpoint_shapes,
)
from tide.weights.mapping import WeightMap, WeightTarget
from tide.weights.wire import deserialize_named_tensors, serialize_named_tensors

__all__ = [
    "FlattenedBucket",
    "WeightUpdateGroup",
    "deserialize_named_tensors",
    "flatten_by_dtype",
    "init_custom_process_group",
    "serialize_named_tensors",
    "WeightMap",
    "WeightTarget",
    "checkpoint_files",
    "init_dummy_weights",
    "load_checkpoint",
    "read_checkpoint_shapes",
]
