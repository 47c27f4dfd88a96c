"""Weight updates of the denoiser (the RL handover), all-or-nothing at the validation level.

Names are the denoiser module's own parameter names (diffusers', e.g. `transformer_blocks.0.attn.
to_q.weight`). Every path first checks the complete list of (name, shape, dtype) — an unknown or
repeated name, a wrong shape, a dtype the path does not accept — and raises `ValueError` naming the
tensor before any parameter changes; then it writes every tensor the residency manager says holds the
weight (the live one and, for an offloaded or layerwise denoiser, its host copy, the source of truth).

- tensors (`update_weights_from_tensor`): `[(name, tensor), ...]`, flattened buckets, or their wire
  form (`tide.weights.serialize_named_tensors`); any subset of the parameters; the denoiser's exact
  dtype (as the LLM engine's tensor paths).
- disk (`update_weights_from_disk`): a diffusers component directory of safetensors (or the pipeline
  directory holding one under the denoiser's name); every parameter, cast to the denoiser's dtype
  like the initial load; headers are read and checked before any tensor data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tide.diffusion.residency import ComponentManager
from tide.weights.bucket import FlattenedBucket
from tide.weights.loader import checkpoint_files, read_checkpoint_shapes
from tide.weights.wire import deserialize_named_tensors

TENSOR_LOAD_FORMATS = (None, "flattened_bucket")
DISK_LOAD_FORMATS = (None, "auto", "safetensors")


class DenoiserWeights:
    """Validates and writes weight updates into component `name` of a pipeline's manager."""

    def __init__(self, manager: ComponentManager, name: str) -> None:
        self.manager = manager
        self.name = name
        self.module = manager.components[name].module
        self.params = dict(self.module.named_parameters())

    # ---- validation
    def check(self, metas: Sequence[tuple[str, Sequence[int], torch.dtype]], exact_dtype: bool,
              complete: bool) -> None:
        """ValueError naming the first tensor that does not fit the denoiser."""
        if not metas:
            raise ValueError("the update names no weights")
        seen: set[str] = set()
        for name, shape, dtype in metas:
            if name in seen:
                raise ValueError(f"weight {name!r} appears more than once in the update")
            seen.add(name)
            param = self.params.get(name)
            if param is None:
                raise ValueError(f"weight {name!r} is not a parameter of the {self.name}")
            if tuple(shape) != tuple(param.shape):
                raise ValueError(f"weight {name!r} has shape {list(shape)}, the {self.name}'s is "
                                 f"{list(param.shape)}")
            if exact_dtype and dtype != param.dtype:
                raise ValueError(f"weight {name!r} has dtype {dtype}, the {self.name}'s is "
                                 f"{param.dtype}")
            if not exact_dtype and not dtype.is_floating_point:
                raise ValueError(f"weight {name!r} has dtype {dtype}; expected a floating-point dtype")
        if complete:
            missing = sorted(set(self.params) - seen)
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise ValueError(f"the checkpoint lacks {len(missing)} parameter(s) of the "
                                 f"{self.name}: {missing[:3]}{more}")

    # ---- paths: each `prepare_*` validates everything and returns the function that writes
    def prepare_tensors(self, named: object = None, serialized: str | bytes | list[str] | None = None,
                        load_format: str | None = None) -> Callable[[], int]:
        if load_format not in TENSOR_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(TENSOR_LOAD_FORMATS)}, got "
                             f"{load_format!r}")
        if (named is None) == (serialized is None):
            raise ValueError("pass exactly one of named_tensors and serialized_named_tensors")
        if serialized is not None:
            if isinstance(serialized, list):
                if len(serialized) != 1:
                    raise ValueError(f"serialized_named_tensors must hold exactly one payload (one "
                                     f"rank), got {len(serialized)}")
                serialized = serialized[0]
            named = deserialize_named_tensors(serialized)
        pairs = self._pairs(named, load_format)
        self.check([(n, t.shape, t.dtype) for n, t in pairs], exact_dtype=True, complete=False)

        def apply() -> int:
            targets = self._targets()
            for name, tensor in pairs:
                self._write(targets[name], tensor)
            return len(pairs)

        return apply

    def prepare_disk(self, model_path: str, load_format: str | None = None) -> Callable[[], int]:
        if load_format not in DISK_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(DISK_LOAD_FORMATS)}, got "
                             f"{load_format!r}")
        path = resolve_component_dir(model_path, self.name)
        metas = read_checkpoint_shapes(path)
        self.check(metas, exact_dtype=False, complete=True)
        files = checkpoint_files(path)

        def apply() -> int:
            from safetensors import safe_open

            targets = self._targets()
            count = 0
            for file in files:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        self._write(targets[name], f.get_tensor(name))
                        count += 1
            return count

        return apply

    @staticmethod
    def _pairs(named: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        if load_format == "flattened_bucket":
            buckets = [named] if isinstance(named, FlattenedBucket) else named
            if not isinstance(buckets, (list, tuple)) or not all(
                    isinstance(b, FlattenedBucket) for b in buckets):
                raise ValueError("a flattened_bucket update must be a FlattenedBucket or a list of them")
            return [pair for b in buckets for pair in b.named_tensors()]
        if not isinstance(named, (list, tuple)) or not all(
                isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor) for item in named):
            raise ValueError("named_tensors must be a list of (name, tensor) pairs")
        return [(item[0], item[1]) for item in named]

    def _targets(self) -> dict[str, list[torch.Tensor]]:
        self.manager.synchronize()  # no copy from a host copy may be in flight while it is written
        return self.manager.write_targets(self.name)

    @staticmethod
    def _write(targets: list[torch.Tensor], tensor: torch.Tensor) -> None:
        with torch.no_grad(), torch.inference_mode(False):
            for target in targets:
                target.copy_(tensor)

    def get(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of parameter `name`, flattened."""
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"weight {name!r} is not a parameter of the {self.name}")
        if not isinstance(truncate_size, int) or isinstance(truncate_size, bool) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        return [float(v) for v in param.detach().reshape(-1)[:truncate_size].float().cpu()]


def resolve_component_dir(model_path: str, component: str) -> str:
    """`model_path` itself when it holds safetensors files; its `component` subdirectory when it is a
    pipeline directory (has a model_index.json). ValueError otherwise."""
    if not isinstance(model_path, str) or not model_path:
        raise ValueError("model_path must be a non-empty string")
    if not os.path.isdir(model_path):
        raise ValueError(f"model_path {model_path!r} is not a directory")
    if os.path.isfile(os.path.join(model_path, "model_index.json")):
        sub = os.path.join(model_path, component)
        if not os.path.isdir(sub):
            raise ValueError(f"model_path {model_path!r} is a pipeline directory without a "
                             f"{component!r} component")
        return sub
    return model_path
