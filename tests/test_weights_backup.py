"""The weights' host backup (`tide.memory.occupation.WeightsBackup`) on its own, on CPU: parameters
that share one storage, a parameter viewing its storage at an offset, byte-exact round trips through
a freed and re-taken storage, one buffer across cycles, and a backup consumed by its restore."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tide.memory.host import HostBuffer
from tide.memory.occupation import MemoryOccupation


def _model() -> nn.Module:
    model = nn.Module()
    base = torch.randn(6, 5)
    model.a = nn.Parameter(base[:2], requires_grad=False)  # two parameters on one storage
    model.b = nn.Parameter(base[2:], requires_grad=False)  # (at an offset)
    model.c = nn.Parameter(torch.randn(7).to(torch.bfloat16), requires_grad=False)
    model.register_buffer("not_a_weight", torch.arange(3.0))
    return model


def _occupation(model: nn.Module) -> MemoryOccupation:
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, weights_region=None,
                             use_vmm=False, cuda_graph_runner=None)
    return MemoryOccupation(runner, enable_cpu_backup=True, ledger=None)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_round_trip_through_freed_storages_is_byte_exact_and_reuses_one_buffer():
    model = _model()
    occupation = _occupation(model)
    backup = occupation.backup
    for cycle in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # new weights between cycles: the next backup must carry them
        want = _state(model)
        occupation.release(["weights"])
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert backup.valid
        occupation.resume(["weights"])
        assert not backup.valid
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), (cycle, name)
        assert model.b.storage_offset() == 10 and model.a.untyped_storage().data_ptr() == (
            model.b.untyped_storage().data_ptr())
        if cycle == 0:
            ptr = backup.buffer.tensor.data_ptr()
    assert backup.allocations == 1 and backup.buffer.tensor.data_ptr() == ptr
    # 2 spans: the shared fp32 storage (30 floats) and the bf16 one, each 256-aligned
    assert backup.host_bytes == 256 + 14
    assert torch.equal(model.not_a_weight, torch.arange(3.0))


def test_copies_split_at_the_host_buffers_chunks(monkeypatch):
    """Small chunks: every span is copied in pieces that never straddle two chunks, byte-exact."""
    import tide.memory.occupation as occupation_module

    made = []

    def small_chunks(nbytes: int, pin: bool) -> HostBuffer:
        made.append(HostBuffer(nbytes, pin, chunk_bytes=48))
        return made[-1]

    monkeypatch.setattr(occupation_module, "HostBuffer", small_chunks)
    model = _model()
    occupation = _occupation(model)
    want = _state(model)
    occupation.release(["weights"])
    assert len(made) == 1 and len(made[0].chunks) == 6  # 270 bytes in chunks of 48
    host = made[0].tensor
    shared = torch.cat([want["a"].reshape(-1), want["b"].reshape(-1)])
    assert torch.equal(host[:120], shared.view(torch.uint8))  # the shared storage, as bytes
    occupation.resume(["weights"])
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_restore_without_a_valid_backup_writes_nothing():
    model = _model()
    occupation = _occupation(model)
    assert occupation.backup.restore() is False
    occupation.release(["weights"])
    occupation.resume(["weights"])
    with torch.no_grad():
        model.c.fill_(3.0)
    assert occupation.backup.restore() is False  # consumed by the resume
    assert torch.equal(model.c, torch.full((7,), 3.0, dtype=torch.bfloat16))


def test_close_frees_the_buffer_and_the_next_save_allocates_again():
    model = _model()
    occupation = _occupation(model)
    occupation.release(["weights"])
    occupation.resume(["weights"])
    assert occupation.drop_cpu_backup() == 270
    assert occupation.backup.buffer is None and occupation.backup.host_bytes == 0
    want = _state(model)
    occupation.release(["weights"])
    occupation.resume(["weights"])
    assert occupation.backup.allocations == 2
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_host_buffer_checks_its_size_and_closes_once():
    for bad in (0, -1, 1.5, True):
        try:
            HostBuffer(bad, pin=False)  # type: ignore[arg-type]
        except ValueError as e:
            assert "nbytes" in str(e)
        else:
            raise AssertionError(f"nbytes={bad!r} was accepted")
    buf = HostBuffer(4096, pin=False)
    assert buf.tensor is not None and buf.tensor.numel() == 4096 and not buf.pinned
    buf.close()
    buf.close()
    assert buf.closed


class _FakeCudart:
    """Records cudaHostRegister/Unregister calls (CPU hosts have no CUDA runtime)."""

    def __init__(self, fail_calls: tuple[int, ...] = ()) -> None:
        self.fail_calls = fail_calls
        self.calls: list[tuple[int, int, int]] = []
        self.live: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append((ptr, size, flags))
        if len(self.calls) - 1 in self.fail_calls:
            return 1  # cudaErrorInvalidValue
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.live[ptr]
        return 0


def test_pinned_buffer_registers_whole_pages_chunk_by_chunk_once(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    page = 2 << 20
    buf = HostBuffer(5 * page + 100, pin=True, chunk_bytes=page)
    assert buf.tensor.numel() == 5 * page + 100 and fake.calls == []  # nothing pinned yet
    seen = []
    for lo, hi in buf.pin_chunks():
        seen.append((lo, hi))
        assert len(fake.calls) == len(seen)  # each chunk is pinned just before it is handed out
    assert seen == [(i * page, min((i + 1) * page, 5 * page + 100)) for i in range(6)]
    base = buf.tensor.data_ptr()
    assert [(p - base, n, f) for p, n, f in fake.calls] == [(i * page, page, 1) for i in range(6)]
    assert buf.registered and buf.alloc_s > 0
    assert list(buf.pin_chunks()) == seen and len(fake.calls) == 6  # pinned once
    buf.tensor[-1] = 7  # the memory is usable
    buf.close()
    assert fake.live == {} and buf.closed


def test_a_chunk_the_runtime_refuses_stays_pageable_and_the_rest_is_pinned(monkeypatch):
    fake = _FakeCudart(fail_calls=(1,))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    buf = HostBuffer(3 << 21, pin=True, chunk_bytes=2 << 20)
    assert len(list(buf.pin_chunks())) == 3
    assert not buf.registered and len(fake.live) == 2
    buf.close()
    assert fake.live == {}
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostBuffer(4096, pin=True, chunk_bytes=4096)


def test_fp8_copies_are_not_backed_up_and_are_recomputed_on_restore():
    from tide.layers.linear import Linear

    model = nn.Module()
    model.proj = Linear(32, 16)
    with torch.no_grad():
        model.proj.weight.normal_()
    model.proj.use_fp8()
    fp8_bits = model.proj.weight_fp8.view(torch.uint8).clone()
    scales = model.proj.weight_scale.clone()
    weight = model.proj.weight.detach().clone()
    occupation = _occupation(model)
    occupation.release(["weights"])
    assert occupation.backup.host_bytes == 16 * 32 * 4  # the fp32 weight only
    occupation.resume(["weights"])
    assert torch.equal(model.proj.weight, weight)
    assert torch.equal(model.proj.weight_fp8.view(torch.uint8), fp8_bits)
    assert torch.equal(model.proj.weight_scale, scales)


@pytest.mark.parametrize("derived_last", [True, False])
def test_a_region_backup_ends_where_the_derived_parameters_begin(derived_last):
    """With the memory saver the weights are one region, checkpoint parameters first: the backup
    span stops at the first derived one; in any other layout it keeps the whole region."""
    region_bytes = torch.zeros(1024, dtype=torch.uint8)
    first, second = region_bytes[:512], region_bytes[512:]
    model = nn.Module()
    model.w = nn.Parameter((second if not derived_last else first).view(torch.float32)[:128],
                           requires_grad=False)
    model.w_fp8 = nn.Parameter((first if not derived_last else second)[:256], requires_grad=False)
    model.w_fp8.derived = True
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, use_vmm=True,
                             cuda_graph_runner=None,
                             weights_region=SimpleNamespace(used_bytes=lambda: region_bytes))
    spans = MemoryOccupation(runner, enable_cpu_backup=True, ledger=None).backup._spans()
    assert len(spans) == 1 and spans[0].data_ptr() == region_bytes.data_ptr()
    assert spans[0].numel() == (512 if derived_last else 1024)
