"""The wire format of tensor payloads (`/update_weights_from_tensor`, `/update_weights_from_ipc`).

A payload is base64 text of `MAGIC` followed by one msgpack map, decoded by msgspec into the typed
structs below and validated field by field. Nothing in it is ever executed: there is no pickle, no
class or function name, no code path chosen by the sender other than the two tensor kinds.

    {"type": "named_tensors",     "tensors": [{"name", "tensor"}, ...]}        [(name, tensor), ...]
    {"type": "flattened_bucket",  "bucket": {"flattened_tensor", "metadata"}}  FlattenedBucket
    {"type": "flattened_buckets", "buckets": [bucket, ...]}                    [FlattenedBucket, ...]

A tensor is one of:

- `host`: a CPU tensor by value, as a safetensors file holding exactly one tensor (its dtype and
  shape are in the safetensors header). The decoded tensor is a writable view of the received bytes.
- `cuda_ipc`: a CUDA tensor by reference: the fields `torch.multiprocessing.reductions.reduce_tensor`
  produces for it (device, memory handle, storage size and offset, the view's size, stride and
  offset, dtype, ref-counter handle and slot, event handle). The receiver maps the sender's memory
  with torch's `rebuild_cuda_tensor`, called with these validated, typed values only. Same host
  only; the sender keeps the tensor alive until the receiver has copied it.

Limits (a ValueError names the field that breaks one): dtypes from `DTYPES` only; at most
`MAX_NDIM` dimensions of at most `MAX_DIM` elements; byte counts and offsets below `MAX_BYTES`;
names of at most `MAX_NAME_CHARS`; at most `MAX_TENSORS` tensors; a view must lie inside its storage;
bucket entries must lie inside their buffer; the ref-counter slot must be inside torch's
ref-counter file. Anything else — another format, a pickle stream, an unknown field — is refused.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import torch

from tide.weights.bucket import FlattenedBucket, TensorMeta

MAGIC = b"TIDE-TENSORS/1\n"
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_BYTES = 1 << 48
MAX_NAME_CHARS = 1024
MAX_TENSORS = 1 << 20
_MAX_HEADER_BYTES = 1 << 16  # a one-tensor safetensors header is a few hundred bytes
_MAX_IPC_HANDLE_BYTES = 1 << 20  # torch's memory handle: 66 bytes, more for expandable segments
_IPC_EVENT_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
_IPC_REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
# What torch names its shared-memory ref-counter files (at::NewProcessWideShmHandle).
_REF_COUNTER_HANDLE = re.compile(rb"/torch_[0-9]{1,20}_[0-9]{1,20}_[0-9]{1,20}")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTypeName = Literal["float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
                    "int8", "uint8", "int16", "int32", "int64", "bool"]
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8,
    "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}

Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Shape = Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class HostTensor(msgspec.Struct, tag="host", frozen=True, forbid_unknown_fields=True):
    """A CPU tensor by value: a safetensors file that holds exactly one tensor."""

    safetensors: bytearray


class CudaIpcTensor(msgspec.Struct, tag="cuda_ipc", frozen=True, forbid_unknown_fields=True):
    """A CUDA tensor by reference: what `reduce_tensor` gives for it, field by field."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=_MAX_IPC_HANDLE_BYTES)]
    storage_size_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BYTES)]
    storage_offset_bytes: Count
    dtype: DTypeName
    size: Shape
    stride: Annotated[list[Count], msgspec.Meta(max_length=MAX_NDIM)]
    storage_offset: Count  # the view's first element within the storage, in elements
    ref_counter_handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=_IPC_REF_COUNTER_SLOTS)]
    event_handle: Annotated[bytes, msgspec.Meta(min_length=_IPC_EVENT_HANDLE_BYTES,
                                                max_length=_IPC_EVENT_HANDLE_BYTES)]
    event_sync_required: bool


TensorData = HostTensor | CudaIpcTensor


class NamedTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    tensor: TensorData


class BucketEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of a bucket: `flattened_tensor[offset : offset + numel]` viewed as `shape` (the
    bucket's dtype)."""

    name: Name
    shape: Shape
    offset: Count
    numel: Count


class Bucket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    flattened_tensor: TensorData
    metadata: Annotated[list[BucketEntry], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]


class NamedTensorsPayload(msgspec.Struct, tag="named_tensors", frozen=True,
                          forbid_unknown_fields=True):
    tensors: Annotated[list[NamedTensor], msgspec.Meta(max_length=MAX_TENSORS)]


class BucketPayload(msgspec.Struct, tag="flattened_bucket", frozen=True,
                    forbid_unknown_fields=True):
    bucket: Bucket


class BucketListPayload(msgspec.Struct, tag="flattened_buckets", frozen=True,
                        forbid_unknown_fields=True):
    buckets: Annotated[list[Bucket], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]


Payload = NamedTensorsPayload | BucketPayload | BucketListPayload
_DECODER = msgspec.msgpack.Decoder(Payload)
_ENCODER = msgspec.msgpack.Encoder()

# The parameters of torch.multiprocessing.reductions.rebuild_cuda_tensor, which are also the
# positions of the arguments reduce_tensor returns for a CUDA tensor.
REBUILD_CUDA_TENSOR_PARAMS = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
    "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)

DecodedPayload = list[tuple[str, torch.Tensor]] | FlattenedBucket | list[FlattenedBucket]


# ---------------------------------------------------------------- encoding
def serialize_named_tensors(obj: Any) -> str:
    """`obj` — a list of (name, tensor) pairs, a `FlattenedBucket`, or a list of them — as base64
    text. CPU tensors travel by value; CUDA tensors as CUDA IPC handles (keep them alive until the
    receiver has copied them). Raises ValueError for anything else."""
    return base64.b64encode(MAGIC + _ENCODER.encode(_to_wire(obj))).decode("ascii")


def _to_wire(obj: Any) -> Payload:
    if isinstance(obj, FlattenedBucket):
        return BucketPayload(_bucket_to_wire(obj))
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(b, FlattenedBucket) for b in obj):
            return BucketListPayload([_bucket_to_wire(b) for b in obj])
        tensors = []
        for item in obj:
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError("serialize_named_tensors takes a list of (name, tensor) pairs, a "
                                 "FlattenedBucket, or a list of FlattenedBuckets")
            tensors.append(NamedTensor(item[0], tensor_to_wire(item[1])))
        return NamedTensorsPayload(tensors)
    raise ValueError("serialize_named_tensors takes a list of (name, tensor) pairs, a "
                     f"FlattenedBucket, or a list of FlattenedBuckets, got {type(obj).__name__}")


def _bucket_to_wire(bucket: FlattenedBucket) -> Bucket:
    entries = [BucketEntry(m.name, list(m.shape), m.offset, m.numel) for m in bucket.metadata]
    return Bucket(tensor_to_wire(bucket.flattened_tensor), entries)


def tensor_to_wire(tensor: torch.Tensor) -> TensorData:
    """A CPU tensor by value, a CUDA tensor as its IPC handle (an empty one by value)."""
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent; allowed: {sorted(DTYPES)}")
    tensor = tensor.detach()
    if tensor.is_cuda and tensor.untyped_storage().nbytes() > 0:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(tensor)
        if rebuild is not rebuild_cuda_tensor:
            raise ValueError(f"a {tensor.layout} CUDA tensor cannot be sent as an IPC handle")
        return cuda_ipc_from_reduce_args(args)
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"only CPU and CUDA tensors can be sent, got one on {tensor.device}")
    from safetensors.torch import save

    return HostTensor(bytearray(save({"tensor": tensor.cpu().contiguous()})))


def cuda_ipc_from_reduce_args(args: Sequence[Any]) -> CudaIpcTensor:
    """The struct for the argument tuple `reduce_tensor` returns with `rebuild_cuda_tensor`."""
    if len(args) != len(REBUILD_CUDA_TENSOR_PARAMS):
        raise ValueError(f"reduce_tensor gave {len(args)} arguments, expected "
                         f"{len(REBUILD_CUDA_TENSOR_PARAMS)}")
    a = dict(zip(REBUILD_CUDA_TENSOR_PARAMS, args))
    return CudaIpcTensor(
        device=int(a["storage_device"]),
        handle=bytes(a["storage_handle"]),
        storage_size_bytes=int(a["storage_size_bytes"]),
        storage_offset_bytes=int(a["storage_offset_bytes"]),
        dtype=_DTYPE_NAMES[a["dtype"]],  # type: ignore[arg-type]
        size=[int(d) for d in a["tensor_size"]],
        stride=[int(s) for s in a["tensor_stride"]],
        storage_offset=int(a["tensor_offset"]),
        ref_counter_handle=bytes(a["ref_counter_handle"]),
        ref_counter_offset=int(a["ref_counter_offset"]),
        event_handle=bytes(a["event_handle"]),
        event_sync_required=bool(a["event_sync_required"]),
    )


# ---------------------------------------------------------------- decoding
def deserialize_named_tensors(payload: str | bytes) -> DecodedPayload:
    """Decode `serialize_named_tensors` output: a list of (name, tensor) pairs, a FlattenedBucket,
    or a list of them. Raises ValueError naming the problem for anything else; nothing in the
    payload runs."""
    raw = _b64decode(payload)
    if not raw.startswith(MAGIC):
        if raw[:1] == b"\x80":
            raise ValueError("the tensor payload is a pickle stream; pickles are refused (they can "
                             "run code). Make payloads with tide.weights.serialize_named_tensors")
        raise ValueError("the tensor payload is not in tide's tensor format (make it with "
                         "tide.weights.serialize_named_tensors)")
    try:
        wire = _DECODER.decode(memoryview(raw)[len(MAGIC):])
    except msgspec.ValidationError as e:
        raise ValueError(f"the tensor payload is malformed: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"the tensor payload is not valid msgpack: {e}") from None
    return payload_from_wire(wire)


def _b64decode(payload: Any) -> bytes:
    if not isinstance(payload, (str, bytes)):
        raise ValueError(f"the tensor payload must be base64 text, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the tensor payload is not valid base64: {e}") from None


def payload_from_wire(wire: Payload) -> DecodedPayload:
    """Check every cross-field rule and build the tensors (CUDA IPC handles are opened here)."""
    if isinstance(wire, NamedTensorsPayload):
        return [(t.name, tensor_from_wire(t.tensor, f"tensors[{i}] ({t.name!r})"))
                for i, t in enumerate(wire.tensors)]
    if isinstance(wire, BucketPayload):
        return _bucket_from_wire(wire.bucket, "bucket")
    return [_bucket_from_wire(b, f"buckets[{i}]") for i, b in enumerate(wire.buckets)]


def _bucket_from_wire(wire: Bucket, where: str) -> FlattenedBucket:
    flat = tensor_from_wire(wire.flattened_tensor, f"{where}.flattened_tensor")
    if flat.dim() != 1:
        raise ValueError(f"{where}.flattened_tensor must be 1-D, got shape {list(flat.shape)}")
    metadata = [TensorMeta(e.name, tuple(e.shape), flat.dtype, e.offset, e.numel)
                for e in wire.metadata]
    bucket = FlattenedBucket(flat, metadata)
    try:
        bucket.named_tensors()  # every entry fits the buffer and its shape
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return bucket


def tensor_from_wire(wire: TensorData, where: str = "tensor") -> torch.Tensor:
    if isinstance(wire, HostTensor):
        return _load_host(wire.safetensors, where)
    return _open_cuda_ipc(wire, where)


def _load_host(buf: bytearray, where: str) -> torch.Tensor:
    """The one tensor of a safetensors file, as a view of `buf` (no copy)."""
    if len(buf) < 8:
        raise ValueError(f"{where}: safetensors data is shorter than its 8-byte header length")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(buf):
        raise ValueError(f"{where}: safetensors header length {header_len} does not fit the data")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: safetensors header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: safetensors header must be a JSON object")
    entries = [v for k, v in header.items() if k != "__metadata__"]
    if len(entries) != 1 or not isinstance(entries[0], dict):
        raise ValueError(f"{where}: safetensors data must hold exactly one tensor")
    entry = entries[0]
    if set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{where}: safetensors entry needs exactly dtype, shape and data_offsets")
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"{where}: safetensors dtype {entry['dtype']!r} is not allowed; allowed: "
                         f"{sorted(_SAFETENSORS_DTYPES)}")
    shape = _check_shape(entry["shape"], f"{where}.shape")
    numel = math.prod(shape)
    data_len = len(buf) - 8 - header_len
    offsets = entry["data_offsets"]
    if offsets != [0, data_len] or not all(type(o) is int for o in offsets):
        raise ValueError(f"{where}: safetensors data_offsets must be [0, {data_len}], got "
                         f"{offsets!r}")
    if numel * dtype.itemsize != data_len:
        raise ValueError(f"{where}: shape {shape} of {_DTYPE_NAMES[dtype]} needs "
                         f"{numel * dtype.itemsize} bytes, the data has {data_len}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=8 + header_len).view(shape)


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
        type(d) is int and 0 <= d <= MAX_DIM for d in shape
    ):
        raise ValueError(f"{where} must be a list of at most {MAX_NDIM} integers in "
                         f"[0, {MAX_DIM}], got {str(shape)[:100]}")
    return shape


def check_cuda_ipc(wire: CudaIpcTensor, where: str = "tensor") -> None:
    """The rules between fields (each field's own type and range is checked when decoding)."""
    if len(wire.stride) != len(wire.size):
        raise ValueError(f"{where}: stride has {len(wire.stride)} entries, size has "
                         f"{len(wire.size)}")
    if not _REF_COUNTER_HANDLE.fullmatch(wire.ref_counter_handle):
        raise ValueError(f"{where}: ref_counter_handle is not a torch ref-counter file name")
    if wire.storage_offset_bytes + wire.storage_size_bytes > MAX_BYTES:
        raise ValueError(f"{where}: storage_offset_bytes + storage_size_bytes exceeds {MAX_BYTES}")
    itemsize = DTYPES[wire.dtype].itemsize
    if math.prod(wire.size) == 0:
        end = wire.storage_offset
    else:
        end = wire.storage_offset + 1 + sum((d - 1) * s for d, s in zip(wire.size, wire.stride))
    if end * itemsize > wire.storage_size_bytes:
        raise ValueError(f"{where}: the view (size {wire.size}, stride {wire.stride}, offset "
                         f"{wire.storage_offset}) reaches byte {end * itemsize}, past the storage's "
                         f"{wire.storage_size_bytes} bytes")


def rebuild_cuda_tensor_args(wire: CudaIpcTensor) -> tuple[Any, ...]:
    """The arguments for torch's `rebuild_cuda_tensor`, in its parameter order."""
    return (
        torch.Tensor, torch.Size(wire.size), tuple(wire.stride), wire.storage_offset,
        torch.storage.TypedStorage, DTYPES[wire.dtype], wire.device, wire.handle,
        wire.storage_size_bytes, wire.storage_offset_bytes, False, wire.ref_counter_handle,
        wire.ref_counter_offset, wire.event_handle, wire.event_sync_required,
    )


def _open_cuda_ipc(wire: CudaIpcTensor, where: str) -> torch.Tensor:
    check_cuda_ipc(wire, where)
    if not torch.cuda.is_available():
        raise ValueError(f"{where} is a CUDA IPC handle, but this process has no CUDA device "
                         "(send CPU tensors instead)")
    if wire.device >= torch.cuda.device_count():
        raise ValueError(f"{where}: device {wire.device} does not exist here "
                         f"({torch.cuda.device_count()} CUDA devices)")
    from torch.multiprocessing import reductions

    try:
        tensor = reductions.rebuild_cuda_tensor(*rebuild_cuda_tensor_args(wire))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{where}: the CUDA IPC handle could not be opened: {e}") from None
    # (torch's rebuild always gives a CUDA tensor; the CPU tests record the call with a stand-in)
    mapped = _mapped_bytes(tensor.untyped_storage().data_ptr(), wire) if tensor.is_cuda else None
    if mapped is not None:
        del tensor  # the refused mapping is not kept alive by the error's traceback
        raise ValueError(f"{where}: storage_size_bytes {wire.storage_size_bytes} runs past the end "
                         f"of the CUDA memory its handle maps ({mapped} bytes from the storage's "
                         "start)")
    return tensor


def _mapped_bytes(start: int, wire: CudaIpcTensor) -> int | None:
    """None when the `storage_size_bytes` from `start` are mapped device memory; else how many
    bytes from `start` are. Mapped means: the driver's address range of the storage's first byte,
    and of each range that begins where the last one ends (a sender with expandable segments shares
    memory mapped as consecutive pages, each its own range). torch maps `storage_size_bytes` as
    told: reading past mapped memory is an illegal address, which ends the process's CUDA context.
    Unchecked (None) where the driver API is not at hand."""
    end = start + wire.storage_size_bytes
    reach = start
    while reach < end:
        span = _allocation_range(reach, wire.device)
        if span is None:
            return None
        base, size = span
        if base > reach or base + size <= reach:  # not a range holding `reach`
            return reach - start
        reach = base + size
    return None


def _allocation_range(ptr: int, device: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation holding `ptr` (`cuMemGetAddressRange`); (ptr, 0)
    where nothing is mapped there; None where neither `cuda.bindings` nor the driver library can be
    loaded."""
    with torch.cuda.device(device):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            return _allocation_range_ctypes(ptr)
        err, base, size = cu.cuMemGetAddressRange(ptr)
        if err != cu.CUresult.CUDA_SUCCESS:  # nothing is mapped there
            return ptr, 0
        return int(base), int(size)


def _allocation_range_ctypes(ptr: int) -> tuple[int, int] | None:
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:  # nothing is mapped there
        return ptr, 0
    return base.value, size.value


__all__ = [
    "DTYPES",
    "MAGIC",
    "MAX_BYTES",
    "MAX_DIM",
    "MAX_NDIM",
    "MAX_NAME_CHARS",
    "MAX_TENSORS",
    "Bucket",
    "BucketEntry",
    "BucketListPayload",
    "BucketPayload",
    "CudaIpcTensor",
    "HostTensor",
    "NamedTensor",
    "NamedTensorsPayload",
    "check_cuda_ipc",
    "cuda_ipc_from_reduce_args",
    "deserialize_named_tensors",
    "payload_from_wire",
    "rebuild_cuda_tensor_args",
    "serialize_named_tensors",
    "tensor_from_wire",
    "tensor_to_wire",
]
