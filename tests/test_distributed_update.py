"""`update_weights_from_distributed` over gloo, on CPU: the group handshake (warm-up collective and
the agreed piece size), flattened updates in pieces that split tensors across two receive buffers,
per-tensor updates, and the refusals (no handshake, bad piece size, weights released) that must still
leave the trainer in step."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import transformers

import tide
from conftest import InThread, free_port, named_weights, sgd_steps
from tide.weights import init_custom_process_group
from tide.weights.distributed import (
    HANDSHAKE_MAGIC,
    MIN_BUCKET_BYTES,
    PROTOCOL_VERSION,
    UpdateHeader,
)
from tide.weights.receive import BroadcastReceiver, PartDest, piece_copies

JOIN_S = 60.0


def _pair(bucket_bytes: int, name: str = "g", coalesce_tensors: int = 0):
    """A trainer (rank 0, in a thread) and an engine-side (rank 1) group joined at once."""
    port = free_port()
    trainer = InThread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, name,
                       timeout_s=JOIN_S, bucket_bytes=bucket_bytes,
                       coalesce_tensors=coalesce_tensors, name="trainer-join")
    engine_side = init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, name, timeout_s=JOIN_S)
    return trainer.result(JOIN_S), engine_side


def test_piece_copies_cover_every_element_exactly_once():
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.choice([0, 1, 2, 7, 64, 100, 333]) for _ in range(rng.randint(1, 9))]
        total = sum(numels)
        step = rng.randint(1, max(1, total + 3))
        pieces = [(s, min(total, s + step)) for s in range(0, max(total, 1), step)]
        flat = torch.arange(total)
        out = [torch.full((n,), -1) for n in numels]
        for (start, end), copies in zip(pieces, piece_copies(numels, pieces)):
            for c in copies:
                target = out[c.index][c.dst_start : c.dst_start + c.src_end - c.src_start]
                assert (target == -1).all(), "an element was written twice"
                target.copy_(flat[start:end][c.src_start : c.src_end])
        assert torch.equal(torch.cat(out), flat), (numels, step)


class _RecordingGroup:
    """A stand-in NCCL backend that records the bytes of each broadcast (a tuple per NCCL group)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.grouped: list[int] | None = None

    def broadcast(self, tensors, opts):
        nbytes = tensors[0].numel() * tensors[0].element_size()
        (self.grouped if self.grouped is not None else self.calls).append(nbytes)
        return _Done()

    def _start_coalescing(self) -> None:
        self.grouped = []

    def _end_coalescing(self):
        self.calls.append(tuple(self.grouped or ()))
        self.grouped = None
        return _Done()


class _Done:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("coalesce, group", [(0, ()), (1, ()), (5, (512 << 10,) * 5),
                                             (1024, (512 << 10,) * 64)])
def test_nccl_warm_up_sends_every_message_kind_an_update_sends(coalesce, group):
    """NCCL connects each protocol, and sets up grouped launches, on first use: the handshake's
    warm-up sends one small, medium and large message, then one NCCL group of up to 64 tensors
    where per-tensor updates travel in groups."""
    from tide.weights.distributed import WARMUP_BYTES, WARMUP_SIZES, WeightUpdateGroup

    pg = _RecordingGroup()
    group_ = WeightUpdateGroup("g", "nccl", 1, 2, pg, None, coalesce_tensors=coalesce)
    group_._warm_up(torch.empty(WARMUP_BYTES, dtype=torch.uint8), timedelta(seconds=1))
    assert pg.calls[: len(WARMUP_SIZES)] == [4 << 10, 256 << 10, 4 << 20, 32 << 20]
    assert pg.calls[len(WARMUP_SIZES):] == ([group] if group else [])


def test_handshake_agrees_on_rank_0s_piece_size():
    trainer, engine_side = _pair(bucket_bytes=64 << 10)
    assert trainer.bucket_bytes == engine_side.bucket_bytes == 64 << 10
    assert engine_side.pieces(40_000, 4) == [(0, 16384), (16384, 32768), (32768, 40000)]
    trainer, engine_side = _pair(bucket_bytes=0)
    assert engine_side.bucket_bytes == 0 and engine_side.pieces(40_000, 4) == [(0, 40_000)]


def test_handshake_agrees_on_rank_0s_coalescing_and_per_tensor_updates_arrive():
    """Rank 0's `coalesce_tensors` is every rank's (gloo groups then still send one broadcast per
    tensor: only NCCL groups calls); a per-tensor update in runs of 3 arrives whole, a drained
    tensor and a non-contiguous destination included."""
    trainer, engine_side = _pair(bucket_bytes=64 << 10, coalesce_tensors=3)
    assert trainer.coalesce_tensors == engine_side.coalesce_tensors == 3
    gen = torch.Generator().manual_seed(2)
    named = [(f"t{i}", torch.randn(5 + i, 7, generator=gen)) for i in range(7)]
    dests = [torch.zeros_like(t) for _, t in named]
    dests[2] = None  # drained
    dests[4] = torch.zeros(7, 9).t()  # through a buffer
    sender = InThread(trainer.broadcast_weights, named, name="trainer-send")
    receiver = BroadcastReceiver(engine_side)
    header = receiver.receive_header()
    assert header == UpdateHeader(False, tuple((t.numel(), t.dtype) for _, t in named))
    receiver.receive_tensors([(tuple(t.shape), t.dtype, d) for (_, t), d in zip(named, dests)])
    receiver.finish()
    sender.result(JOIN_S)
    for (n, t), d in zip(named, dests):
        if d is not None:
            assert torch.equal(d, t), n
    with pytest.raises(ValueError, match="coalesce_tensors"):
        init_custom_process_group("gloo", "127.0.0.1", free_port(), 0, 2, "g", timeout_s=5,
                                  coalesce_tensors=-1)


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_parts_of_tensors_arrive_exactly(flattened):
    """What a tensor-parallel rank keeps: row parts (a range of the flat buffer, copied straight from
    the pieces) and column parts (strided: staged one tensor at a time), in pieces that split them
    across both receive buffers, beside whole tensors and a drained one."""
    trainer, engine_side = _pair(bucket_bytes=16 << 10)
    gen = torch.Generator().manual_seed(3)
    named = [(f"t{i}", torch.randn(shape, generator=gen)) for i, shape in
             enumerate([(90, 40), (64, 100), (3000,), (70, 90), (33, 65), (40, 100), (0, 8)])]
    # (destination, expected): rows 30..75 of t0, columns 20..70 of t1, t2 whole, t3 drained,
    # columns 0..32 of t4, rows 10..40 of t5 (across the boundary of the 4096-element pieces at
    # 24576), and the no rows of an empty t6.
    cuts = [(0, 30, 45), (1, 20, 50), None, "drop", (1, 0, 32), (0, 10, 30), (0, 0, 0)]
    dests, expected = [], []
    for (_, t), cut in zip(named, cuts):
        if cut == "drop":
            dests.append(None)
            expected.append(None)
        elif cut is None:
            dests.append(torch.zeros_like(t))
            expected.append(t)
        else:
            part = t.narrow(*cut)
            rows = torch.zeros(part.shape)
            dests.append(PartDest(rows, tuple(t.shape), *cut))
            expected.append(part)
    if flattened:
        sender = InThread(trainer.broadcast_flattened, torch.cat([t.reshape(-1) for _, t in named]),
                          name="trainer-send")
    else:
        sender = InThread(trainer.broadcast_weights, named, name="trainer-send")
    receiver = BroadcastReceiver(engine_side)
    assert receiver.receive_header().flattened == flattened
    if flattened:
        receiver.receive_flattened(torch.float32, [(d, t.numel()) for (_, t), d in zip(named, dests)])
    else:
        receiver.receive_tensors([(tuple(t.shape), t.dtype, d) for (_, t), d in zip(named, dests)])
    receiver.finish()
    sender.result(JOIN_S)
    for (name, _), d, want in zip(named, dests, expected):
        if want is not None:
            got = d.rows if isinstance(d, PartDest) else d
            assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="outside"):
        PartDest(torch.zeros(5, 8), (10, 8), 0, 6, 5)
    with pytest.raises(ValueError, match="cannot hold"):
        PartDest(torch.zeros(5, 7), (10, 8), 0, 5, 5)


@pytest.mark.parametrize("bad", [1, MIN_BUCKET_BYTES - 1, -5, True, 1.5, (4 << 30) + 1])
def test_bad_bucket_bytes_is_refused_before_joining(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        init_custom_process_group("gloo", "127.0.0.1", free_port(), 0, 2, "g", timeout_s=5,
                                  bucket_bytes=bad)


@pytest.mark.parametrize("header,needle", [
    ([0, 0, 0, 0], "no handshake"),
    ([HANDSHAKE_MAGIC, PROTOCOL_VERSION + 1, 1 << 20, 0], "protocol"),
    ([HANDSHAKE_MAGIC, PROTOCOL_VERSION, 3, 0], "bucket_bytes"),
    ([HANDSHAKE_MAGIC, PROTOCOL_VERSION, 1 << 20, -2], "coalesce_tensors"),
])
def test_a_rank_0_without_tides_handshake_is_refused(header, needle):
    """A trainer that made its side by hand (no handshake, another protocol, a bad piece size or
    grouping) is told so at init, instead of the first update reading a tiny broadcast as weights."""
    port = free_port()

    def foreign_rank_0():
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=JOIN_S))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("tide/g", store), 0, 2,
                                   timedelta(seconds=JOIN_S))
        opts = dist.BroadcastOptions()
        pg.broadcast([torch.tensor(header, dtype=torch.int64)], opts).wait()
        return store, pg

    trainer = InThread(foreign_rank_0, name="foreign-trainer")
    with pytest.raises(RuntimeError, match=needle):
        init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, "g", timeout_s=JOIN_S)
    trainer.result(JOIN_S)


def test_flattened_pieces_use_two_buffers_and_split_tensors_exactly():
    """Pieces of several tensors alternate between two receive buffers; a piece inside one
    destination lands in it directly."""
    trainer, engine_side = _pair(bucket_bytes=16 << 10)
    gen = torch.Generator().manual_seed(1)
    named = [("a", torch.randn(3000, generator=gen)), ("b", torch.randn(50, 70, generator=gen)),
             ("c", torch.randn(9000, generator=gen).to(torch.bfloat16)),
             ("d", torch.randn(10_001, generator=gen)), ("skip", torch.randn(5000, generator=gen)),
             ("e", torch.randn(40, 30, generator=gen))]
    dests = {n: torch.zeros_like(t) for n, t in named}
    dests["skip"] = None  # drained, never written
    dests["e"] = torch.zeros(30, 40).t()  # not contiguous: assembled, then written whole
    sender = InThread(trainer.broadcast_weights, named, "flattened_bucket", name="trainer-send")
    receiver = BroadcastReceiver(engine_side)
    # One flat buffer per dtype, first-seen order: fp32 (all but c), then bf16 (c).
    assert receiver.receive_header() == UpdateHeader(
        True, ((sum(t.numel() for n, t in named if n != "c"), torch.float32),
               (9000, torch.bfloat16)))
    order: dict[torch.dtype, list] = {}
    for n, t in named:
        order.setdefault(t.dtype, []).append((dests[n], t.numel()))
    for dtype, items in order.items():
        receiver.receive_flattened(dtype, items)
    receiver.finish()
    sender.result(JOIN_S)
    for n, t in named:
        if dests[n] is not None:
            assert torch.equal(dests[n], t), n
    # fp32: 22 701 elements = 6 pieces of 4096; the two inside d land in place, the rest take
    # 2 buffers. bf16: 9000 = 2 pieces of 8192, both inside c: in place, no buffer.
    assert receiver.pieces_in_place == 4
    assert receiver.buffers_allocated == 2


def _one_storage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed tensors shaped like `tensors`, back to back in one storage, in order (as
    `enable_memory_saver` lays out the parameters)."""
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _receive_flat(trainer, engine_side, named, dests) -> BroadcastReceiver:
    """The trainer sends `named` flattened (one fp32 buffer); the engine side receives it into
    `dests` (one per tensor). Returns the receiver, done."""
    sender = InThread(trainer.broadcast_weights, named, "flattened_bucket", name="trainer-send")
    receiver = BroadcastReceiver(engine_side)
    receiver.receive_header()
    receiver.receive_flattened(torch.float32, [(d, t.numel()) for d, (_, t) in zip(dests, named)])
    receiver.finish()
    sender.result(JOIN_S)
    return receiver


def test_flattened_pieces_land_in_place_where_the_parameters_are_one_run():
    """Pieces whose tensors lie back to back in one storage, in the trainer's order, are received
    straight into them; a piece that also holds a tensor stored elsewhere, a drained one or a
    column part goes through a buffer. Every written element is exact either way."""
    trainer, engine_side = _pair(bucket_bytes=16 << 10)  # 4096 fp32 elements a piece
    gen = torch.Generator().manual_seed(3)
    named = [(n, torch.randn(shape, generator=gen)) for n, shape in (
        ("a", (64, 64)), ("b", (5000,)), ("c", (3000,)), ("d", (100, 41)), ("e", (4096,)),
        ("f", (9000,)), ("g", (40, 30)), ("h", (8192,)))]
    sizes = [t.numel() for _, t in named]
    pieces = engine_side.pieces(sum(sizes), 4)
    # All in one run: every piece lands in place, no buffer is taken.
    run = _one_storage([t for _, t in named])
    receiver = _receive_flat(trainer, engine_side, named, run)
    assert receiver.pieces_in_place == len(pieces) and receiver.buffers_allocated == 0
    assert all(torch.equal(d, t) for d, (_, t) in zip(run, named))
    # Broken runs: c elsewhere, e drained, g a column part (staged); f..h one run again.
    dests: list = _one_storage([t for _, t in named])
    dests[2] = torch.zeros(3000)
    dests[4] = None
    dests[6] = PartDest(torch.zeros(40, 10), (40, 30), 1, 10, 10)
    receiver = _receive_flat(trainer, engine_side, named, dests)
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    clean = [i for i, (lo, hi) in enumerate(pieces)
             if not any(starts[j] < hi and lo < starts[j + 1] for j in (2, 4, 6))]
    assert 0 < receiver.pieces_in_place == len(clean) < len(pieces)
    assert receiver.buffers_allocated == 2
    for d, (_, t) in zip(dests, named):
        if isinstance(d, PartDest):
            assert torch.equal(d.rows, t[:, 10:20])
        elif d is not None:
            assert torch.equal(d, t)
    # One storage, but not the trainer's layout: a gap after b, c and d swapped, f in bf16 (a
    # copy converts it). Only the pieces inside a, inside b, and inside h stay in place.
    region = torch.zeros(sum(sizes) + 64)
    at, views = 0, {}
    for n, size in (("a", 4096), ("b", 5000), ("gap", 64), ("d", 4100), ("c", 3000),
                    ("e", 4096), ("g", 1200), ("h", 8192)):
        views[n] = region[at : at + size]
        at += size
    views["f"] = torch.zeros(9000, dtype=torch.bfloat16)
    dests = [views[n].view(t.shape) for n, t in named]
    receiver = _receive_flat(trainer, engine_side, named, dests)
    assert receiver.pieces_in_place == 4  # [0, 4096) a, [4096, 8192) b, both pieces of h
    for d, (_, t) in zip(dests, named):
        assert torch.equal(d, t.to(d.dtype)), d.dtype


# ---------------------------------------------------------------------------------------------
# Through the engine


@pytest.fixture(scope="module")
def rig(checkpoints):
    path = checkpoints["qwen3"]
    engine = tide.Engine(str(path), enable_memory_saver=True, enable_cpu_backup=True,
                         max_total_tokens=2048)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    port = free_port()
    trainer = InThread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, "wu",
                       timeout_s=JOIN_S, bucket_bytes=MIN_BUCKET_BYTES, name="trainer-join")
    joined = engine.init_weights_update_group("127.0.0.1", port, 1, 2, "wu", "gloo")
    assert joined["success"], joined["message"]
    group = trainer.result(JOIN_S)
    assert engine.worker.weight_updater.groups["wu"].bucket_bytes == MIN_BUCKET_BYTES
    yield engine, hf, group
    engine.shutdown()


def _push(engine, group, named, load_format):
    sender = InThread(group.broadcast_weights, named, load_format, name="trainer-send")
    res = InThread(engine.update_weights_from_distributed, [n for n, _ in named],
                   ["float32"] * len(named), [list(t.shape) for _, t in named], group_name="wu",
                   load_format=load_format, name="engine-recv").result(JOIN_S)
    sender.result(JOIN_S)  # every broadcast was received: the trainer is not left waiting
    return res


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["per_tensor", "flattened"])
def test_engine_update_lands_bit_exact_in_small_pieces(rig, load_format):
    engine, hf, group = rig
    sgd_steps(hf, steps=1, lr=0.3, seed=7 if load_format else 8)
    named = named_weights(hf)
    res = _push(engine, group, named, load_format)
    assert res["success"], res["message"]
    for name, t in named:
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=t.numel()))
        assert torch.equal(got, t.reshape(-1)), name


def test_update_while_weights_are_released_drains_and_is_refused(rig):
    engine, hf, group = rig
    before = {n: p.detach().clone() for n, p in engine.model_runner.model.named_parameters()}
    sgd_steps(hf, steps=1, lr=0.3, seed=9)
    assert engine.release_memory_occupation(["weights"])["success"]
    try:
        for load_format in (None, "flattened_bucket"):
            res = _push(engine, group, named_weights(hf), load_format)
            assert not res["success"] and "weights are released" in res["message"]
    finally:
        assert engine.resume_memory_occupation(["weights"])["success"]
    for n, p in engine.model_runner.model.named_parameters():
        assert torch.equal(p, before[n]), n  # the backup came back, not a partial update
    res = _push(engine, group, named_weights(hf), "flattened_bucket")  # still in step
    assert res["success"], res["message"]


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model_runner.model.named_parameters()}


def _assert_params(engine, before: dict[str, torch.Tensor]) -> None:
    for n, p in engine.model_runner.model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["per_tensor", "flattened"])
@pytest.mark.parametrize("case", ["drop", "extra", "float64", "bad_shape_type", "load_format"])
def test_a_request_that_does_not_match_the_broadcast_drains_it_and_writes_nothing(
        rig, load_format, case):
    """The trainer sends something else than the request declares (one tensor fewer or more, a
    float64 tensor the engine cannot take), or the request is malformed: the engine drains exactly
    what the update header announced, writes nothing, and the group stays in step (gloo would have
    aborted the process on the next size mismatch)."""
    engine, hf, group = rig
    sgd_steps(hf, steps=1, lr=0.3, seed=11)
    named = named_weights(hf)
    declared = list(named)
    sent = list(named)
    dtypes = ["float32"] * len(named)
    shapes: list = [list(t.shape) for _, t in named]
    fmt = load_format
    if case == "drop":
        sent = sent[:-1]
    elif case == "extra":
        sent = sent + [("extra", torch.randn(5, 3))]
    elif case == "float64":
        sent[1] = (sent[1][0], sent[1][1].double())
        dtypes[1] = "float64"
    elif case == "bad_shape_type":
        shapes[0] = [None]
    else:
        fmt = "safetensors"
    before = _params(engine)
    sender = InThread(group.broadcast_weights, sent, load_format, name="trainer-send")
    res = InThread(engine.update_weights_from_distributed, [n for n, _ in declared], dtypes,
                   shapes, group_name="wu", load_format=fmt, name="engine-recv").result(JOIN_S)
    sender.result(JOIN_S)  # the trainer is not left waiting
    assert not res["success"], res
    if case in ("drop", "extra"):
        assert "rank 0 broadcasts" in res["message"], res["message"]
    _assert_params(engine, before)
    res = _push(engine, group, named, load_format)  # still in step
    assert res["success"], res["message"]


def test_no_receive_buffers_are_held_for_parameters_in_one_region(monkeypatch):
    """Joining a group takes (and leaves cached) two piece buffers, unless the parameters are one
    region: an update flattened in module order then lands in place and needs none."""
    from types import SimpleNamespace

    from tide.weights.update import WeightUpdater

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    updater = WeightUpdater(model, torch.device("cpu"))
    taken: list[torch.device] = []
    monkeypatch.setattr(updater, "_streams", lambda device: taken.append(device) or (None, None))
    group = SimpleNamespace(bucket_bytes=1 << 20, device=torch.device("cpu"))
    updater._warm_receive_pool(group)
    assert taken == [torch.device("cpu")]
    params = list(model.parameters())
    for p, view in zip(params, _one_storage([p.detach() for p in params])):
        p.data = view
    updater._warm_receive_pool(group)
    assert len(taken) == 1
    # Parts kept under tensor parallelism, or a parameter stored elsewhere: buffers are needed.
    params[2].tp_split = {None: (1, 0, 4, 8)}
    updater._warm_receive_pool(group)
    assert len(taken) == 2
    del params[2].tp_split
    params[3].data = torch.zeros(params[3].numel() + 1)[1:].view(params[3].shape)
    updater._warm_receive_pool(group)
    assert len(taken) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_flattened_update_in_model_order_lands_in_place(checkpoints, arch, monkeypatch):
    """With the parameters in one region (as `enable_memory_saver` lays them out) a trainer that
    flattens its model's parameters in module order sends the engine's own memory layout (fused
    q/k/v and gate/up rows follow each other): every piece lands in place, and the model is the
    trainer's exactly."""
    from tide.weights import receive

    path = checkpoints[arch]  # qwen3: q/k norms after o_proj, embeddings tied to the head
    engine = tide.Engine(str(path), max_total_tokens=1024)
    try:
        params = list(engine.model_runner.model.parameters())
        for p, view in zip(params, _one_storage([p.detach() for p in params])):
            view.copy_(p.detach())
            p.data = view
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        sgd_steps(hf, steps=1, lr=0.3, seed=11)
        named = named_weights(hf)
        port = free_port()
        trainer = InThread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, "run",
                           timeout_s=JOIN_S, bucket_bytes=64 << 10, name="trainer-join")
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "run", "gloo")["success"]
        group = trainer.result(JOIN_S)
        runs = []
        real = receive._one_run
        monkeypatch.setattr(receive, "_one_run", lambda *a: runs.append(real(*a)) or runs[-1])
        sender = InThread(group.broadcast_weights, named, "flattened_bucket", name="trainer-send")
        res = engine.update_weights_from_distributed(
            [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named],
            group_name="run", load_format="flattened_bucket")
        sender.result(JOIN_S)
        assert res["success"], res["message"]
        total = sum(t.numel() for _, t in named)
        assert len(runs) == len(group.pieces(total, 4)) > 1
        assert all(r is not None for r in runs)
        for name, t in named:
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=t.numel()))
            assert torch.equal(got, t.reshape(-1)), name
        engine.destroy_weights_update_group("run")
        group.close()
    finally:
        engine.shutdown()


def test_a_trainer_that_stops_mid_update_blocks_generation_until_a_full_refill(rig):
    """Rank 0 announces an update, sends part of it and goes silent: the receive times out with
    some parameters written. The update fails, generation is refused with the reason instead of
    running on half-written weights, and a complete update (any path) lifts the block."""
    engine, hf, _ = rig
    port = free_port()
    trainer = InThread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, "die",
                       timeout_s=JOIN_S, name="trainer-join")
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "die", "gloo")["success"]
    group = trainer.result(JOIN_S)
    engine.worker.weight_updater.groups["die"].timeout = timedelta(seconds=2)
    sgd_steps(hf, steps=1, lr=0.3, seed=12)
    named = named_weights(hf)

    def send_part() -> None:
        group.send_update_header(UpdateHeader(False, tuple((t.numel(), t.dtype) for _, t in named)))
        for _, t in named[:3]:
            group.broadcast(t.contiguous())

    sender = InThread(send_part, name="trainer-send")
    try:
        res = engine.update_weights_from_distributed(
            [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named],
            group_name="die")
        sender.result(JOIN_S)
        assert not res["success"] and "part-way" in res["message"], res["message"]
        with pytest.raises(ValueError, match="failed part-way"):
            engine.generate(input_ids=[3, 5, 7], sampling_params={"max_new_tokens": 2})
        assert engine.update_weights_from_tensor(named_tensors=named)["success"]
        out = engine.generate(input_ids=[3, 5, 7], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
    finally:
        engine.destroy_weights_update_group("die")
        group.close()
