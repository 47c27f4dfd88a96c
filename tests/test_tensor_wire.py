"""The tensor wire format (`tide.weights.wire`): round trips, strict validation, no pickle.

CPU only: CUDA IPC structs are checked with handcrafted values, and the call into torch's
`rebuild_cuda_tensor` is checked with a recording stand-in (the real mapping runs in
tests/test_gpu.py::test_update_weights_from_ipc on a GPU host).
"""

from __future__ import annotations

import base64
import inspect

import msgspec
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from server_utils import assert_pickle_is_live, pickle_exploit_payload

from tide.weights import FlattenedBucket, deserialize_named_tensors, flatten_by_dtype
from tide.weights import serialize_named_tensors
from tide.weights import wire


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return [
        ("f32", base.clone()),
        ("f16", torch.randn(3, 4, generator=gen).half()),
        ("bf16", torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16)),
        ("f64", torch.randn(7, generator=gen).double()),
        ("i8", torch.randint(-128, 127, (9,), generator=gen, dtype=torch.int8)),
        ("i64", torch.randint(0, 1 << 40, (2, 2), generator=gen)),
        ("bool", torch.rand(5, generator=gen) > 0.5),
        ("fp8", torch.randn(4, generator=gen).to(torch.float8_e4m3fn)),
        ("strided", base[1:5, ::2]),  # a non-contiguous view of a larger storage
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 3)),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no equality kernel: compare as fp32
        a, b = a.float(), b.float()
    return torch.equal(a, b)


def _encode(obj: dict) -> str:
    """A payload made by hand: MAGIC + msgpack of `obj`, base64."""
    return base64.b64encode(wire.MAGIC + msgspec.msgpack.encode(obj)).decode()


def _host(t: torch.Tensor) -> dict:
    return {"type": "host", "safetensors": st_save({"tensor": t.contiguous()})}


def _ipc(**changes) -> dict:
    """A well-formed CUDA IPC struct (the values reduce_tensor gives, made up)."""
    fields = {
        "type": "cuda_ipc", "device": 0, "handle": b"\x01\x00" + bytes(range(64)),
        "storage_size_bytes": 4096, "storage_offset_bytes": 512, "dtype": "bfloat16",
        "size": [16, 8], "stride": [8, 1], "storage_offset": 64,
        "ref_counter_handle": b"/torch_4242_123456789_0", "ref_counter_offset": 3,
        "event_handle": bytes(64), "event_sync_required": True,
    }
    fields.update(changes)
    return fields


# ---------------------------------------------------------------- round trips
def test_named_tensors_round_trip_every_dtype():
    named = _named()
    out = deserialize_named_tensors(serialize_named_tensors(named))
    assert isinstance(out, list) and [n for n, _ in out] == [n for n, _ in named]
    for (name, sent), (_, got) in zip(named, out):
        assert _same(sent, got), name
    # The decoded tensors are independent, writable copies.
    out[0][1].add_(1.0)
    assert torch.equal(out[0][1], named[0][1] + 1.0)


def test_duplicate_names_and_order_survive():
    named = [("w", torch.ones(2)), ("v", torch.zeros(3)), ("w", torch.full((2,), 2.0))]
    out = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in out] == ["w", "v", "w"]
    assert torch.equal(out[2][1], named[2][1])


def test_buckets_and_lists_of_buckets_round_trip():
    named = _named()
    buckets = flatten_by_dtype(named)
    assert len(buckets) == 8
    got = deserialize_named_tensors(serialize_named_tensors(buckets))
    assert isinstance(got, list) and all(isinstance(b, FlattenedBucket) for b in got)
    flat = [nt for b in got for nt in b.named_tensors()]
    want = [nt for b in buckets for nt in b.named_tensors()]
    assert [n for n, _ in flat] == [n for n, _ in want]
    for (name, a), (_, b) in zip(want, flat):
        assert _same(a, b), name
    one = deserialize_named_tensors(serialize_named_tensors(buckets[2]))
    assert isinstance(one, FlattenedBucket) and one.metadata == buckets[2].metadata
    assert torch.equal(one.flattened_tensor, buckets[2].flattened_tensor)
    assert one.flattened_tensor.dtype == torch.bfloat16


def test_host_tensors_are_plain_safetensors():
    t = torch.randn(3, 2).to(torch.bfloat16)
    raw = base64.b64decode(serialize_named_tensors([("x", t)]))
    assert raw.startswith(wire.MAGIC)
    body = msgspec.msgpack.decode(raw[len(wire.MAGIC):])
    assert body["type"] == "named_tensors" and body["tensors"][0]["tensor"]["type"] == "host"
    loaded = st_load(body["tensors"][0]["tensor"]["safetensors"])
    assert list(loaded) == ["tensor"] and torch.equal(loaded["tensor"], t)
    # ...and bytes written by safetensors itself decode (metadata in the header is allowed).
    payload = _encode({"type": "named_tensors", "tensors": [
        {"name": "y", "tensor": {"type": "host",
                                 "safetensors": st_save({"w": t}, metadata={"k": "v"})}}]})
    assert torch.equal(deserialize_named_tensors(payload)[0][1], t)


def test_serialize_rejects_what_it_cannot_carry():
    for obj in ({"a": torch.zeros(1)}, [("x", 3)], [("x", torch.zeros(1), 1)], "text", 5,
                [(1, torch.zeros(1))]):
        with pytest.raises(ValueError, match="serialize_named_tensors takes"):
            serialize_named_tensors(obj)
    with pytest.raises(ValueError, match="cannot be sent"):
        serialize_named_tensors([("c", torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="only CPU and CUDA"):
        serialize_named_tensors([("m", torch.zeros(2, device="meta"))])


# ---------------------------------------------------------------- nothing runs
def test_crafted_pickle_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle_exploit_payload(marker)
    assert_pickle_is_live(payload, marker)
    with pytest.raises(ValueError, match="pickle stream; pickles are refused"):
        deserialize_named_tensors(payload)
    # Hidden where tensor bytes go, or behind the magic, it is still only data.
    raw = base64.b64decode(payload)
    for smuggled in (
        _encode({"type": "named_tensors", "tensors": [
            {"name": "w", "tensor": {"type": "host", "safetensors": raw}}]}),
        base64.b64encode(wire.MAGIC + raw).decode(),
    ):
        with pytest.raises(ValueError):
            deserialize_named_tensors(smuggled)
    assert not marker.exists()


def test_engine_refuses_a_crafted_pickle(llama_engine, tmp_path):
    marker = tmp_path / "pwned-engine"
    payload = pickle_exploit_payload(marker)
    name = "model.norm.weight"
    before = llama_engine.get_weights_by_name(name)
    for result in (llama_engine.update_weights_from_tensor(serialized_named_tensors=payload),
                   llama_engine.update_weights_from_tensor(serialized_named_tensors=[payload],
                                                           load_format="flattened_bucket"),
                   llama_engine.update_weights_from_ipc(payload)):
        assert result["success"] is False and "pickle" in result["message"], result
    assert not marker.exists()
    assert llama_engine.get_weights_by_name(name) == before
    # The same route takes the real format.
    named = [(name, torch.tensor(before) + 1.0)]
    assert llama_engine.update_weights_from_tensor(
        serialized_named_tensors=serialize_named_tensors(named))["success"]
    assert llama_engine.update_weights_from_ipc(
        serialize_named_tensors(flatten_by_dtype([(name, torch.tensor(before))])))["success"]
    assert llama_engine.get_weights_by_name(name) == before


# ---------------------------------------------------------------- strict validation
GOOD = torch.arange(6, dtype=torch.float32)


def _two_tensor_file() -> bytes:
    return st_save({"a": torch.zeros(2), "b": torch.zeros(2)})


def _with_header(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


MALFORMED = [
    ("not base64", "not base64 !!", "not valid base64"),
    ("no magic", base64.b64encode(b"hello").decode(), "not in tide's tensor format"),
    ("not msgpack", base64.b64encode(wire.MAGIC + b"\xc1").decode(), "not valid msgpack"),
    ("unknown payload type", _encode({"type": "python_object", "tensors": []}), "$.type"),
    ("unknown field", _encode({"type": "named_tensors", "tensors": [], "code": "x"}),
     "unknown field `code`"),
    ("tensor not a struct", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": 3}]}), "$.tensors[0].tensor"),
    ("name not a string", _encode({"type": "named_tensors", "tensors": [
        {"name": 5, "tensor": _host(GOOD)}]}), "$.tensors[0].name"),
    ("name too long", _encode({"type": "named_tensors", "tensors": [
        {"name": "x" * 2000, "tensor": _host(GOOD)}]}), "$.tensors[0].name"),
    ("safetensors dtype not allowed", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": st_save(
            {"t": torch.zeros(2, dtype=torch.complex64)})}}]}), "dtype 'C64' is not allowed"),
    ("two tensors in one file", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _two_tensor_file()}}]}),
     "exactly one tensor"),
    ("header length past the data", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": (10**6).to_bytes(8, "little")}}]}),
     "header length"),
    ("huge shape", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _with_header(
            b'{"t":{"dtype":"F32","shape":[1' + b"0" * 400 + b'],"data_offsets":[0,4]}}',
            bytes(4))}}]}), "shape must be a list"),
    ("too many dims", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _with_header(
            b'{"t":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}',
            bytes(4))}}]}), "at most 8"),
    ("data shorter than shape", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _with_header(
            b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}', bytes(8))}}]}),
     "needs 16 bytes"),
    ("offsets not covering the data", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _with_header(
            b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8))}}]}),
     "data_offsets must be [0, 8]"),
    ("deep JSON header", _encode({"type": "named_tensors", "tensors": [
        {"name": "w", "tensor": {"type": "host", "safetensors": _with_header(
            b"[" * 60000)}}]}), "header"),
    ("bucket entry past the buffer", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD),
        "metadata": [{"name": "w", "shape": [2, 2], "offset": 4, "numel": 4}]}}),
     "does not fit the flattened buffer"),
    ("bucket entry numel vs shape", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD),
        "metadata": [{"name": "w", "shape": [2, 2], "offset": 0, "numel": 5}]}}),
     "does not fit"),
    ("bucket buffer not 1-D", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD.view(2, 3)),
        "metadata": [{"name": "w", "shape": [6], "offset": 0, "numel": 6}]}}), "must be 1-D"),
    ("bucket without entries", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD), "metadata": []}}), "$.bucket.metadata"),
    ("offset beyond the limit", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD),
        "metadata": [{"name": "w", "shape": [1], "offset": 2**63 - 1, "numel": 1}]}}),
     "$.bucket.metadata[0].offset"),
    ("negative dimension", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD),
        "metadata": [{"name": "w", "shape": [-1], "offset": 0, "numel": 1}]}}),
     "$.bucket.metadata[0].shape[0]"),
    ("boolean as an integer", _encode({"type": "flattened_bucket", "bucket": {
        "flattened_tensor": _host(GOOD),
        "metadata": [{"name": "w", "shape": [1], "offset": True, "numel": 1}]}}), "got `bool`"),
    ("empty bucket list", _encode({"type": "flattened_buckets", "buckets": []}), "$.buckets"),
]


@pytest.mark.parametrize("payload,needle", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_payloads_raise_value_error(payload, needle):
    with pytest.raises(ValueError) as info:
        deserialize_named_tensors(payload)
    assert needle in str(info.value), str(info.value)


def test_non_text_payload_is_refused():
    with pytest.raises(ValueError, match="must be base64 text"):
        deserialize_named_tensors(123)  # type: ignore[arg-type]


# ---------------------------------------------------------------- CUDA IPC structs
BAD_IPC = [
    ("stride length", {"stride": [8]}, "stride has 1 entries"),
    ("view past the storage", {"size": [16, 8], "storage_offset": 2000}, "past the storage"),
    ("strided view past the storage", {"size": [300, 8], "stride": [8, 1]}, "past the storage"),
    ("ref-counter slot outside torch's file", {"ref_counter_offset": 10000},
     "$.tensors[0].tensor.ref_counter_offset"),
    ("ref-counter handle not torch's", {"ref_counter_handle": b"/../../etc/passwd"},
     "ref_counter_handle is not a torch ref-counter file name"),
    ("ref-counter handle with a NUL", {"ref_counter_handle": b"/torch_1_2_3\x00x"},
     "ref_counter_handle"),
    ("event handle size", {"event_handle": bytes(63)}, "$.tensors[0].tensor.event_handle"),
    ("negative device", {"device": -1}, "$.tensors[0].tensor.device"),
    ("dtype outside the allow-list", {"dtype": "complex64"}, "$.tensors[0].tensor.dtype"),
    ("dtype as a torch name", {"dtype": "torch.float32"}, "$.tensors[0].tensor.dtype"),
    ("too many dims", {"size": [1] * 9, "stride": [1] * 9}, "$.tensors[0].tensor.size"),
    ("empty memory handle", {"handle": b""}, "$.tensors[0].tensor.handle"),
    ("empty storage", {"storage_size_bytes": 0}, "$.tensors[0].tensor.storage_size_bytes"),
    ("storage beyond the limit", {"storage_offset_bytes": wire.MAX_BYTES, "size": [1],
                                  "stride": [1], "storage_offset": 0},
     "storage_offset_bytes + storage_size_bytes"),
    ("handle as text", {"handle": "abc"}, "$.tensors[0].tensor.handle"),
    ("event flag as an integer", {"event_sync_required": 1},
     "$.tensors[0].tensor.event_sync_required"),
    ("extra field", {"tensor_cls": "os.system"}, "unknown field `tensor_cls`"),
]


def _ipc_payload(**changes) -> str:
    return _encode({"type": "named_tensors", "tensors": [{"name": "w", "tensor": _ipc(**changes)}]})


@pytest.fixture
def no_rebuild(monkeypatch):
    """torch's rebuild_cuda_tensor must not be reached by refused structs."""
    from torch.multiprocessing import reductions

    def fail(*args, **kwargs):
        raise AssertionError("rebuild_cuda_tensor was called")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fail)


@pytest.mark.parametrize("changes,needle", [b[1:] for b in BAD_IPC], ids=[b[0] for b in BAD_IPC])
def test_bad_cuda_ipc_structs_are_refused_before_torch(monkeypatch, no_rebuild, changes, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError) as info:
        deserialize_named_tensors(_ipc_payload(**changes))
    assert needle in str(info.value), str(info.value)


def test_cuda_ipc_without_a_cuda_device_is_a_value_error(no_rebuild):
    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device")
    with pytest.raises(ValueError, match="no CUDA device"):
        deserialize_named_tensors(_ipc_payload())


def test_cuda_ipc_device_must_exist(monkeypatch, no_rebuild):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 3 does not exist"):
        deserialize_named_tensors(_ipc_payload(device=3))


def test_rebuild_signature_matches_torch():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = tuple(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params == wire.REBUILD_CUDA_TENSOR_PARAMS


def test_cuda_ipc_fields_reach_torch_in_order(monkeypatch):
    """reduce_tensor's argument tuple -> struct -> wire -> the same values, in rebuild_cuda_tensor's
    order, with torch's own classes (never a class named by the sender)."""
    from torch.multiprocessing import reductions

    reduce_args = (
        torch.Tensor, torch.Size([128]), (1,), 64, torch.storage.TypedStorage,
        torch.bfloat16, 0, b"\x01\x00" + bytes(range(64)), 4096, 512, False,
        b"/torch_4242_123456789_0", 3, bytes(range(64)), True,
    )
    calls = []

    def record(*args):
        calls.append(args)
        return torch.zeros(args[1], dtype=args[5])

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    struct = wire.cuda_ipc_from_reduce_args(reduce_args)
    bucket_wire = wire.BucketPayload(wire.Bucket(struct, [
        wire.BucketEntry("a", [8, 8], 0, 64), wire.BucketEntry("b", [64], 64, 64)]))
    payload = base64.b64encode(wire.MAGIC + msgspec.msgpack.encode(bucket_wire)).decode()
    bucket = deserialize_named_tensors(payload)
    assert calls == [reduce_args]
    assert isinstance(bucket, FlattenedBucket) and bucket.flattened_tensor.shape == (128,)
    assert [(n, tuple(t.shape)) for n, t in bucket.named_tensors()] == [("a", (8, 8)), ("b", (64,))]
    calls.clear()
    named = deserialize_named_tensors(base64.b64encode(
        wire.MAGIC + msgspec.msgpack.encode(wire.NamedTensorsPayload(
            [wire.NamedTensor("w", struct)]))).decode())
    assert calls == [reduce_args] and named[0][0] == "w"


def test_cuda_ipc_open_failure_is_a_value_error(monkeypatch):
    from torch.multiprocessing import reductions

    def refuse(*args):
        raise RuntimeError("CUDA error: invalid argument")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="could not be opened: CUDA error"):
        deserialize_named_tensors(_ipc_payload())
