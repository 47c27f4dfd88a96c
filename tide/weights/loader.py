"""Reading HF safetensors checkpoints (single file, sharded with an index, or several files)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from tide.weights.mapping import WeightMap, WeightTarget

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PROGRESS_BYTES = 1 << 30
_MAX_READERS = 8


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    paths = [os.path.join(model_path, n) for n in files]
    if not paths:
        raise ValueError(f"model_path {model_path!r} has no *.safetensors weights")
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint shard {path!r} named in the index is missing")
    return paths


def read_checkpoint_shapes(model_path: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor, read from the file headers only."""
    out = []
    for path in checkpoint_files(model_path):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"weight {name!r} has unsupported dtype {info['dtype']}")
            out.append((name, tuple(info["shape"]), dtype))
    return out


def load_checkpoint(model: nn.Module, model_path: str, show_progress: bool | None = None) -> None:
    """Validate the whole checkpoint against the model (names, shapes, completeness), then load it."""
    weight_map = WeightMap(model)
    targets = {t.name: t for t in weight_map.plan(read_checkpoint_shapes(model_path), True)}
    write_checkpoint(weight_map, targets, model_path, show_progress)
    _sync(model)


def write_checkpoint(
    weight_map: WeightMap,
    targets: dict[str, WeightTarget],
    model_path: str,
    show_progress: bool | None = None,
) -> None:
    """Copy every validated tensor of the checkpoint into the model, one reader thread per shard
    (reading from the page cache and the host-to-device copies overlap across shards)."""
    files = checkpoint_files(model_path)
    if show_progress is None:
        show_progress = sum(os.path.getsize(p) for p in files) >= _PROGRESS_BYTES

    def load_file(path: str) -> None:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                target = targets.get(name)
                if target is not None:
                    weight_map.write(target, f.get_tensor(name))

    workers = min(len(files), _MAX_READERS)
    bar = tqdm(total=len(files), desc="loading weights", unit="shard", disable=not show_progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(load_file, p) for p in files]:
            future.result()
            bar.update(1)
    bar.close()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights at the real shapes, made on the parameters' own device (for benchmarks)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-0.02, 0.02, generator=gen)


def _sync(model: nn.Module) -> None:
    param = next(model.parameters())
    if param.device.type == "cuda":
        torch.cuda.current_stream(param.device).synchronize()
