"""Reading HF safetensors checkpoints (single file, sharded with an index, or several files)."""

from __future__ import annotations

import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
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
        header, _ = _read_header(path)
        for name, info in header.items():
            out.append((name, tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]]))
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
    staging: "PinnedStaging | None" = None,
) -> None:
    """Copy every validated tensor of the checkpoint into the model. Reader threads each take a
    share of the tensors. For CUDA parameters of the checkpoint's dtype, bytes go page cache ->
    pinned staging buffer -> device with async copies (each thread double-buffers on its own stream);
    anything else (casts, CPU models) goes through `WeightMap.write`."""
    files = checkpoint_files(model_path)
    if show_progress is None:
        show_progress = sum(os.path.getsize(p) for p in files) >= _PROGRESS_BYTES
    work: list[tuple[str, str, dict[str, Any], int]] = []
    for path in files:
        header, data_start = _read_header(path)
        work.extend((path, name, header[name], data_start) for name in header if name in targets)
    device = next(iter(weight_map.params.values())).device
    own_staging = staging is None and device.type == "cuda"
    if own_staging:
        staging = PinnedStaging(device)
    workers = max(1, min(len(work), _MAX_READERS))
    bar = tqdm(total=len(work), desc="loading weights", unit="tensor", disable=not show_progress)
    maps: dict[str, mmap.mmap] = {}
    try:
        for path in files:
            with open(path, "rb") as f:
                maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

        def load_share(worker: int, share: list[tuple[str, str, dict[str, Any], int]]) -> None:
            lane = staging.lane(worker) if staging is not None else None
            for path, name, info, data_start in share:
                begin, end = info["data_offsets"]
                raw = torch.frombuffer(maps[path], dtype=torch.uint8, count=end - begin,
                                       offset=data_start + begin)
                dtype = _SAFETENSORS_DTYPES[info["dtype"]]
                target = targets[name]
                dest = weight_map.rows(target)
                own = _own_bytes(target, raw, dtype.itemsize)
                if (lane is not None and own is not None and dest.dtype == dtype
                        and dest.is_contiguous()):
                    lane.copy(own, dest.view(-1).view(torch.uint8))
                else:
                    weight_map.write(target, raw.view(dtype).view(info["shape"]))
                bar.update(1)
            if lane is not None:
                lane.finish()

        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(load_share, i, work[i::workers]) for i in range(workers)]
            for future in futures:
                future.result()
    finally:
        bar.close()
        for m in maps.values():
            m.close()
        if own_staging and staging is not None:
            staging.close()


def _own_bytes(target: WeightTarget, raw: torch.Tensor, itemsize: int) -> torch.Tensor | None:
    """The bytes of `raw` (a whole checkpoint tensor) this rank holds, when they are contiguous (no
    tensor-parallel split, or a split of the leading dim); None otherwise."""
    if target.split is None:
        return raw
    dim, start, size = target.split
    if dim != 0:
        return None
    row = itemsize
    for d in target.shape[1:]:
        row *= d
    return raw[start * row : (start + size) * row]


class PinnedStaging:
    """Per-reader pairs of pinned host buffers and a copy stream each; reusable across loads."""

    CHUNK = 32 << 20

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lanes: dict[int, _Lane] = {}

    def lane(self, worker: int) -> "_Lane":
        if worker not in self._lanes:
            self._lanes[worker] = _Lane(self.device, self.CHUNK)
        return self._lanes[worker]

    def close(self) -> None:
        self._lanes.clear()


class _Lane:
    def __init__(self, device: torch.device, chunk: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.chunk = chunk
        self.turn = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host bytes `src` -> device bytes `dst`, through the two pinned buffers in turn."""
        for off in range(0, src.numel(), self.chunk):
            n = min(self.chunk, src.numel() - off)
            i = self.turn
            self.turn ^= 1
            event = self.events[i]
            if event is not None:
                event.synchronize()  # the device has finished reading this buffer
            buf = self.bufs[i][:n]
            buf.copy_(src[off : off + n])
            with torch.cuda.stream(self.stream):
                dst[off : off + n].copy_(buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event

    def finish(self) -> None:
        self.stream.synchronize()


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """The tensor table of a safetensors file and where its data starts; ValueError naming the file
    and the tensor if the table is malformed (not an object of entries with a known `dtype`, a
    `shape` of non-negative ints and `data_offsets` [begin, end] spanning exactly the shape's bytes)
    or the file is shorter than its table says. Checked before anything is read into a model."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint shard {path!r} is not a valid safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint shard {path!r} is not a valid safetensors file: its header "
                         "is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        end = max(end, _check_entry(path, name, info))
    if 8 + n + end > size:
        raise ValueError(f"checkpoint shard {path!r} is truncated ({size} bytes, needs {8 + n + end})")
    return header, 8 + n


def _check_entry(path: str, name: str, info: Any) -> int:
    """The end offset of tensor `name`'s bytes, once its header entry is checked (`_read_header`)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"checkpoint shard {path!r}: tensor {name!r} has {what}")

    if not isinstance(info, dict):
        raise bad("a header entry that is not an object")
    code = info.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise bad(f"unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r}, not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {offsets} spanning {offsets[1] - offsets[0]} bytes; its shape "
                  f"{shape} of {str(dtype).removeprefix('torch.')} needs {nbytes}")
    return offsets[1]


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights at the real shapes, made on the parameters' own device (for benchmarks)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        fill = getattr(param, "dummy_value", None)  # a norm whose identity is not 1 (Gemma: 0)
        if fill is not None:
            param.fill_(fill)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-0.02, 0.02, generator=gen)


def _sync(model: nn.Module) -> None:
    param = next(model.parameters())
    if param.device.type == "cuda":
        torch.cuda.current_stream(param.device).synchronize()
