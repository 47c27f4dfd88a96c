"""Weight updates (issue 5, CPU acceptance 1-3).

1. RL fidelity loop: an HF model is trained a few SGD steps at a time; after each round the new weights
   go into a live engine through one path (tensors, flattened buckets, serialized payloads, a gloo
   group fed by a separate trainer process, a checkpoint on disk), and tide's greedy tokens and chosen
   logprobs then equal HF's with the new weights, with the pushed `weight_version` on every output
   and no stale prefix KV reused.
2. Release flags: `empty_device_cache` runs exactly when `torch_empty_cache` / `empty_cache` asks for
   it, never otherwise; no other allocator `empty_cache` call exists in the package.
3. Atomicity: one bad tensor (shape, name, dtype) in an otherwise valid payload fails the whole update
   with a message naming it, and every parameter stays bit-identical — for every path, including a
   distributed update (which must still drain the trainer's broadcasts) and disk checkpoints.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tide
from conftest import (
    InThread,
    free_port,
    hf_greedy_logprobs,
    named_weights,
    random_prompts,
    sgd_steps,
    wait_until,
)
from tide.weights import flatten_by_dtype, serialize_named_tensors

MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROB_TOL = 1e-4
# Distinct first tokens, so no prompt is a cached prefix of another.
PROMPTS = [[100 + 50 * i] + p for i, p in enumerate(random_prompts(55, [4, 8, 13, 19]))]
TRAINER_GROUP = "rl_trainer"
JOIN_S = 60.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model_runner.model.named_parameters()}


def _assert_unchanged(engine, snap: dict[str, torch.Tensor]) -> None:
    changed = [
        n for n, p in engine.model_runner.model.named_parameters() if not torch.equal(p, snap[n])
    ]
    assert not changed, f"a failed update changed parameter(s) {changed}"


def _assert_engine_holds(engine, named: list[tuple[str, torch.Tensor]]) -> None:
    """Every checkpoint tensor reads back from the engine bit-identical (fused shards included)."""
    for name, t in named:
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=t.numel()))
        assert torch.equal(got.to(t.dtype), t.reshape(-1)), f"{name} differs from what was pushed"


def _perturbed(named, seed: int, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, t + scale * torch.randn(t.shape, generator=gen)) for n, t in named]


# ---------------------------------------------------------------------------------------------
# Trainer side of a gloo group: rank 0, broadcasting in `names` order (or one flat buffer per dtype)


def _broadcast_all(group, named, load_format) -> int:
    group.broadcast_weights(named, load_format)
    return len(named)


def _trainer_main(port: int, group_name: str, commands, replies) -> None:
    """A separate trainer process: join the group as rank 0, then broadcast what it is sent."""
    torch.set_num_threads(1)
    from tide.weights import deserialize_named_tensors, init_custom_process_group

    group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, group_name, timeout_s=JOIN_S)
    replies.put("joined")
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        load_format, payload = cmd
        replies.put(("sent", _broadcast_all(group, deserialize_named_tensors(payload), load_format)))


def _join_group(engine, group_name: str, trainer_init) -> object:
    """Join `group_name` from both sides at once (the rendezvous blocks until both arrive)."""
    port = free_port()
    trainer = InThread(trainer_init, port, name="trainer-join")
    joined = InThread(
        engine.init_weights_update_group, "127.0.0.1", port, 1, 2, group_name, "gloo",
        name="engine-join",
    ).result(JOIN_S)
    assert joined["success"], joined["message"]
    return trainer.result(JOIN_S)


def _receive(engine, named, group_name, load_format=None, **kwargs) -> dict:
    """The engine side of one distributed update (in a thread, so a hang fails the test)."""
    return InThread(
        engine.update_weights_from_distributed,
        [n for n, _ in named],
        [_dtype_name(t.dtype) for _, t in named],
        [list(t.shape) for _, t in named],
        group_name=group_name,
        load_format=load_format,
        name="engine-recv",
        **kwargs,
    ).result(JOIN_S)


# ---------------------------------------------------------------------------------------------
# 1. RL fidelity loop (qwen3: tied embeddings, q/k norms, fused qkv and gate_up)

PATHS = [
    "tensor",
    "flattened_bucket",
    "serialized",
    "serialized_bucket",
    "distributed",
    "distributed_bucket",
    "disk",
]


@pytest.fixture(scope="module")
def rl(checkpoints):
    import transformers

    engine = tide.Engine(str(checkpoints["qwen3"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["qwen3"], dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    yield SimpleNamespace(engine=engine, model=model)
    engine.shutdown()


@pytest.fixture(scope="module")
def trainer_process(rl):
    """A spawned trainer process joined to the engine's gloo group as rank 0."""
    ctx = multiprocessing.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(
        target=_trainer_main, args=(port, TRAINER_GROUP, commands, replies), daemon=True
    )
    proc.start()
    try:
        joined = InThread(
            rl.engine.init_weights_update_group, "127.0.0.1", port, 1, 2, TRAINER_GROUP, "gloo",
            name="engine-join",
        ).result(JOIN_S)
        assert joined["success"], joined["message"]
        assert replies.get(timeout=JOIN_S) == "joined"
        yield SimpleNamespace(commands=commands, replies=replies, proc=proc)
    finally:
        commands.put(None)
        rl.engine.destroy_weights_update_group(TRAINER_GROUP)
        proc.join(JOIN_S)
        if proc.is_alive():  # pragma: no cover - only after a failure
            proc.kill()


def _push(path: str, rl, named, version: str, tmp_path: Path, request) -> dict:
    engine = rl.engine
    if path == "tensor":
        return engine.update_weights_from_tensor(named_tensors=named, weight_version=version)
    if path == "flattened_bucket":
        return engine.update_weights_from_tensor(
            named_tensors=flatten_by_dtype(named), load_format="flattened_bucket",
            weight_version=version,
        )
    if path == "serialized":  # sglang's HTTP body: one payload per TP rank
        return engine.update_weights_from_tensor(
            serialized_named_tensors=[serialize_named_tensors(named)], weight_version=version
        )
    if path == "serialized_bucket":
        return engine.update_weights_from_tensor(
            serialized_named_tensors=serialize_named_tensors(flatten_by_dtype(named)),
            load_format="flattened_bucket",
            weight_version=version,
        )
    if path.startswith("distributed"):
        trainer = request.getfixturevalue("trainer_process")
        load_format = "flattened_bucket" if path == "distributed_bucket" else None
        trainer.commands.put((load_format, serialize_named_tensors(named)))
        result = _receive(engine, named, TRAINER_GROUP, load_format, weight_version=version)
        assert trainer.replies.get(timeout=JOIN_S) == ("sent", len(named))
        return result
    if path == "disk":
        out = tmp_path / "step"
        rl.model.save_pretrained(out)
        return engine.update_weights_from_disk(str(out), weight_version=version)
    raise AssertionError(path)


@pytest.mark.parametrize("path", PATHS)
def test_rl_loop_new_weights_match_hf(path, rl, tmp_path, request):
    engine, model = rl.engine, rl.model
    # Rollouts with the current weights; their KV is now in the radix cache.
    before = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    warm = engine.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=1))
    assert warm["meta_info"]["cached_tokens"] > 0, "prompt was not served from the radix cache"

    sgd_steps(model, steps=2, lr=0.5, seed=1 + PATHS.index(path))
    ref = [hf_greedy_logprobs(model, p, MAX_NEW) for p in PROMPTS]
    assert any(o["output_ids"] != r[0] for o, r in zip(before, ref)), (
        "training did not change any greedy output; the test could not detect a missed update"
    )

    version = f"rl-{path}"
    named = named_weights(model)
    res = _push(path, rl, named, version, tmp_path, request)
    assert res["success"], res["message"]
    assert res["num_paused_requests"] == 0

    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, ref)):
        assert out["output_ids"] == tokens, f"{path}: prompt {i} differs from HF with new weights"
        meta = out["meta_info"]
        assert meta["weight_version"] == version
        assert meta["cached_tokens"] == 0, f"{path}: prompt {i} reused KV from the old weights"
        ours = torch.tensor([lp for lp, _ in meta["output_token_logprobs"]])
        err = (ours - torch.tensor(logprobs)).abs().max().item()
        assert err <= LOGPROB_TOL, f"{path}: prompt {i} logprob error {err:.2e}"
    _assert_engine_holds(engine, named)
    engine.scheduler.check_invariants()


# ---------------------------------------------------------------------------------------------
# A llama engine for flags and atomicity (untied lm_head, llama3 rope)


@pytest.fixture(scope="module")
def upd(checkpoints, hf_model_for):
    engine = tide.Engine(str(checkpoints["llama"]))
    base = named_weights(hf_model_for("llama"))
    yield SimpleNamespace(engine=engine, base=base, path=checkpoints["llama"])
    engine.shutdown()


@pytest.fixture
def base_restored(upd):
    """Leaves the llama engine on its checkpoint weights, idle and unpaused, after the test."""
    yield upd
    engine = upd.engine
    if engine.handover.paused is not None:
        engine.continue_generation(torch_empty_cache=False)
    res = engine.update_weights_from_tensor(named_tensors=upd.base, weight_version="default")
    assert res["success"], res["message"]
    assert not engine.scheduler.has_work()
    engine.scheduler.check_invariants()


BAD_TARGET = "model.layers.1.self_attn.k_proj.weight"  # mid-payload, a shard of a fused parameter
UNKNOWN = "model.layers.1.mlp.extra_proj.weight"


def _with_one_bad(named, kind: str) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """`named` with one bad entry in the middle (valid tensors before and after it)."""
    out = list(named)
    i = next(k for k, (n, _) in enumerate(out) if n == BAD_TARGET)
    assert 0 < i < len(out) - 1
    t = out[i][1]
    if kind == "shape":
        out[i] = (BAD_TARGET, torch.randn(t.shape[0] + 1, *t.shape[1:]))
        return out, BAD_TARGET
    if kind == "dtype":
        out[i] = (BAD_TARGET, t.to(torch.bfloat16))
        return out, BAD_TARGET
    if kind == "name":
        out.insert(i, (UNKNOWN, torch.randn(8, 8)))
        return out, UNKNOWN
    raise AssertionError(kind)


# ---- 2. release flags


@pytest.fixture
def releases(monkeypatch):
    """Spy on `empty_device_cache` wherever tide looks it up. Each call records (reason, probe())
    where `releases.probe` may be set by the test; the real function still runs (a no-op on CPU)."""
    from tide.memory import release

    real = release.empty_device_cache
    spy = SimpleNamespace(calls=[], probe=lambda: None)

    def fake(device_module=None, *, reason, ledger):
        spy.calls.append((reason, spy.probe()))
        return real(device_module, reason=reason, ledger=ledger)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "tide" and getattr(module, "empty_device_cache", None) is real:
            monkeypatch.setattr(module, "empty_device_cache", fake)
            patched.append(name)
    assert {"tide.scheduler.worker", "tide.memory.occupation",
            "tide.memory.release"} <= set(patched)
    spy.reasons = lambda: [r for r, _ in spy.calls]
    return spy


UPDATE_PATHS = ["tensor", "flattened_bucket", "serialized", "disk"]


def _push_base(path: str, upd, **flags) -> dict:
    engine, named = upd.engine, upd.base
    if path == "tensor":
        return engine.update_weights_from_tensor(named_tensors=named, **flags)
    if path == "flattened_bucket":
        return engine.update_weights_from_tensor(
            named_tensors=flatten_by_dtype(named), load_format="flattened_bucket", **flags
        )
    if path == "serialized":
        return engine.update_weights_from_tensor(
            serialized_named_tensors=serialize_named_tensors(named), **flags
        )
    if path == "disk":
        return engine.update_weights_from_disk(str(upd.path), **flags)
    raise AssertionError(path)


@pytest.mark.parametrize("path", UPDATE_PATHS)
def test_update_empties_allocator_cache_only_when_asked(path, base_restored, releases):
    upd = base_restored
    for flush in (True, False):
        for torch_empty_cache in (False, True):
            releases.calls.clear()
            res = _push_base(path, upd, flush_cache=flush, torch_empty_cache=torch_empty_cache)
            assert res["success"], res["message"]
            expected = ["weight_update"] if torch_empty_cache else []
            assert releases.reasons() == expected, (path, flush, torch_empty_cache)
    releases.calls.clear()
    res = _push_base(path, upd)  # sglang's default: torch_empty_cache=False
    assert res["success"] and releases.calls == []


def test_failed_update_does_not_empty_cache(base_restored, releases):
    bad, _ = _with_one_bad(base_restored.base, "shape")
    res = base_restored.engine.update_weights_from_tensor(named_tensors=bad, torch_empty_cache=True)
    assert res["success"] is False
    assert releases.calls == []


def test_flush_cache_empties_allocator_cache_only_when_asked(base_restored, releases):
    engine = base_restored.engine
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert engine.flush_cache(empty_cache=False) is True
    assert releases.calls == []
    assert engine.scheduler.tree_cache.total_size() == 0  # flushed, just not emptied
    assert engine.flush_cache(empty_cache=True) is True
    assert releases.reasons() == ["flush_cache"]
    assert engine.flush_cache() is True  # default empty_cache=True
    assert releases.reasons() == ["flush_cache", "flush_cache"]

    # Busy (a request queued behind a pause): refused, and nothing is emptied.
    engine.pause_generation("abort")
    call = InThread(engine.generate, input_ids=PROMPTS[0], sampling_params=GREEDY, name="gen-q")
    wait_until(lambda: engine.scheduler.num_queued() == 1, what="the request to queue")
    releases.calls.clear()
    assert engine.flush_cache(empty_cache=True) is False
    assert engine.flush_cache(empty_cache=False) is False
    assert releases.calls == []
    engine.continue_generation(torch_empty_cache=False)
    assert len(call.result()["output_ids"]) == MAX_NEW
    assert releases.calls == []


def test_continue_generation_empties_cache_only_when_asked_and_while_paused(
    base_restored, releases
):
    engine = base_restored.engine
    releases.probe = lambda: engine.handover.paused
    for mode in ("abort", "retract", "in_place"):
        assert engine.pause_generation(mode)["success"]
        engine.continue_generation(torch_empty_cache=False)
        assert releases.calls == [], mode
        engine.pause_generation(mode)
        engine.continue_generation(torch_empty_cache=True)
        assert releases.calls == [("continue_generation", mode)], "emptied after resuming"
        releases.calls.clear()
    engine.pause_generation("in_place")
    engine.continue_generation()  # sglang's default: torch_empty_cache=True
    assert releases.calls == [("continue_generation", "in_place")]


def test_serving_and_pausing_never_empty_cache(base_restored, releases):
    engine = base_restored.engine
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # radix hits
    engine.generate(input_ids=PROMPTS[:2], sampling_params={"temperature": 0.8, "max_new_tokens": 4})
    for mode in ("abort", "retract", "in_place"):
        engine.pause_generation(mode)
        res = engine.update_weights_from_tensor(named_tensors=base_restored.base)
        assert res["success"], res["message"]
        engine.continue_generation(torch_empty_cache=False)
    engine.update_weight_version("v-test")
    engine.get_weights_by_name(BAD_TARGET, truncate_size=4)
    assert releases.calls == []


def test_update_flush_cache_flag_controls_radix_reset(base_restored):
    engine = base_restored.engine
    prompt = PROMPTS[2]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    res = engine.update_weights_from_tensor(named_tensors=base_restored.base, flush_cache=False)
    assert res["success"]
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # kept, as asked
    res = engine.update_weights_from_tensor(named_tensors=base_restored.base)  # flush_cache=True
    assert res["success"]
    assert engine.scheduler.tree_cache.total_size() == 0
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0


_ALLOCATOR_RELEASE_NAMES = {"empty_cache", "_cuda_emptyCache"}


def test_no_allocator_empty_cache_outside_device_module_ast():
    """Complements tests/test_memory_units.py's regex check: also catches aliased imports
    (`from torch.cuda import empty_cache`), `getattr(mod, "empty_cache")` and the raw C hook."""
    root = Path(tide.__file__).parent
    allowed = root / "memory" / "release.py"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == allowed:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Attribute) and node.attr in _ALLOCATOR_RELEASE_NAMES:
                hit = node.attr
            elif isinstance(node, ast.ImportFrom) and any(
                a.name in _ALLOCATOR_RELEASE_NAMES for a in node.names
            ):
                hit = "import"
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and any(
                    isinstance(a, ast.Constant) and a.value in _ALLOCATOR_RELEASE_NAMES
                    for a in node.args
                )
            ):
                hit = "getattr"
            if hit:
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}: {hit}")
    assert not offenders, "only tide.memory.empty_device_cache may release:\n" + "\n".join(offenders)
    # The check itself sees the one allowed use.
    assert "empty_cache" in allowed.read_text()


# ---- 3. atomicity


@pytest.mark.parametrize("kind", ["shape", "name", "dtype"])
@pytest.mark.parametrize("path", ["tensor", "flattened_bucket", "serialized", "serialized_bucket"])
def test_tensor_update_with_one_bad_tensor_changes_nothing(path, kind, base_restored):
    engine = base_restored.engine
    good = _perturbed(base_restored.base, seed=11)
    payload, bad = _with_one_bad(good, kind)
    snap = _snapshot(engine)
    version = engine.handover.weight_version
    if path == "tensor":
        res = engine.update_weights_from_tensor(named_tensors=payload, weight_version="bad")
    elif path == "flattened_bucket":
        res = engine.update_weights_from_tensor(
            named_tensors=flatten_by_dtype(payload), load_format="flattened_bucket",
            weight_version="bad",
        )
    elif path == "serialized":
        res = engine.update_weights_from_tensor(
            serialized_named_tensors=[serialize_named_tensors(payload)], weight_version="bad"
        )
    else:
        res = engine.update_weights_from_tensor(
            serialized_named_tensors=serialize_named_tensors(flatten_by_dtype(payload)),
            load_format="flattened_bucket",
            weight_version="bad",
        )
    assert res["success"] is False
    assert bad in res["message"], res["message"]
    _assert_unchanged(engine, snap)
    assert engine.handover.weight_version == version
    # The same payload without the bad entry goes through (the failure was that one tensor).
    res = engine.update_weights_from_tensor(named_tensors=good)
    assert res["success"], res["message"]
    _assert_engine_holds(engine, good)


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_tensor_update_with_an_uncopyable_tensor_changes_nothing(kind, base_restored):
    """Right name, shape and dtype, but nothing `copy_` can read (a meta or a sparse tensor) in the
    middle of the list: refused before the tensors ahead of it are written."""
    engine = base_restored.engine
    payload = _perturbed(base_restored.base, seed=13)
    k = len(payload) // 2
    name, tensor = payload[k]
    payload[k] = (name, tensor.to("meta") if kind == "meta" else tensor.to_sparse())
    snap = _snapshot(engine)
    version = engine.handover.weight_version
    res = engine.update_weights_from_tensor(named_tensors=payload, weight_version="bad")
    assert res["success"] is False and name in res["message"], res["message"]
    _assert_unchanged(engine, snap)
    assert engine.handover.weight_version == version


def test_an_update_that_fails_part_way_blocks_generation_until_a_full_refill(base_restored,
                                                                            monkeypatch):
    """A write that fails after others landed (here the third copy raises) leaves some parameters
    new and some old: the update fails, generation is refused with the reason (never served from
    the half-written weights), and a later update that covers every parameter lifts the block."""
    engine = base_restored.engine
    prompt = [3, 5, 7, 11]
    greedy = {"temperature": 0, "max_new_tokens": 4}
    before = engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
    weight_map = engine.worker.weight_updater.weight_map
    real_write, calls = weight_map.write, []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(weight_map, "write", failing_write)
    new = _perturbed(base_restored.base, seed=14)
    res = engine.update_weights_from_tensor(named_tensors=new, weight_version="torn")
    monkeypatch.setattr(weight_map, "write", real_write)
    assert res["success"] is False and "part-way" in res["message"], res["message"]
    with pytest.raises(ValueError, match="failed part-way"):
        engine.generate(input_ids=prompt, sampling_params=greedy)
    # Part of the weights is not enough; all of them lift the block.
    assert engine.update_weights_from_tensor(named_tensors=new[:3])["success"]
    with pytest.raises(ValueError, match="failed part-way"):
        engine.generate(input_ids=prompt, sampling_params=greedy)
    assert engine.update_weights_from_tensor(named_tensors=base_restored.base)["success"]
    assert engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"] == before


@pytest.mark.parametrize("version", ["", "v\n2", "x" * 257])
def test_update_with_a_bad_weight_version_changes_nothing(version, base_restored):
    engine = base_restored.engine
    snap = _snapshot(engine)
    before = engine.handover.weight_version
    with pytest.raises(ValueError, match="weight_version"):  # as any bad option, at the call
        engine.update_weights_from_tensor(
            named_tensors=_perturbed(base_restored.base, seed=15), weight_version=version)
    _assert_unchanged(engine, snap)
    assert engine.handover.weight_version == before
    assert engine.update_weight_version(version)["success"] is False


def _save_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per : (s + 1) * per]
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def _rewrite_header(shard: Path, edit) -> str:
    """Rewrite `shard`'s safetensors header through `edit(header) -> (header, name it spoils)`,
    keeping the header's length (so the data stays where it was); returns that name."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, spoiled = edit(json.loads(data[8 : 8 + n]))
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    shard.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n :])
    return spoiled


def _short_offsets(header):
    """The last tensor's byte range 4 bytes short of its shape (the file stays long enough)."""
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    header[name]["data_offsets"][1] -= 4
    return header, name


def _no_shape(header):
    name = next(k for k in header if k != "__metadata__")
    del header[name]["shape"]
    return header, name


BAD_HEADERS = {"short_offsets": _short_offsets, "no_shape": _no_shape,
               "list_header": lambda h: ([h], "model-00002-of-00003.safetensors")}


@pytest.mark.parametrize("kind", ["missing", "shape", "name", "dtype", "truncated_shard",
                                  *BAD_HEADERS])
def test_disk_update_with_bad_checkpoint_changes_nothing(kind, base_restored, tmp_path):
    engine = base_restored.engine
    tensors = dict(_perturbed(base_restored.base, seed=12))
    bad = BAD_TARGET
    shards = 1
    if kind == "missing":
        del tensors[bad]
    elif kind == "shape":
        t = tensors[bad]
        tensors[bad] = torch.randn(t.shape[0] + 1, *t.shape[1:])
    elif kind == "name":
        bad = UNKNOWN
        tensors[bad] = torch.randn(8, 8)
    elif kind == "dtype":
        tensors[bad] = torch.zeros(tensors[bad].shape, dtype=torch.int32)
    else:
        shards = 3
    ckpt = _save_checkpoint(tmp_path / kind, tensors, shards)
    if kind in BAD_HEADERS:
        # The middle shard's table is spoiled; the first shard, read before it, is fine.
        bad = _rewrite_header(ckpt / "model-00002-of-00003.safetensors", BAD_HEADERS[kind])
    if kind == "truncated_shard":
        # A trainer still writing its checkpoint: the last shard's header is complete, its data
        # is not. The first shards are fine, so a loader that writes as it reads half-updates.
        last = max(ckpt.glob("*.safetensors"))
        data = last.read_bytes()
        last.write_bytes(data[: len(data) - 64])
        bad = last.name
    snap = _snapshot(engine)
    version = engine.handover.weight_version
    raised = None
    try:
        res = engine.update_weights_from_disk(str(ckpt), weight_version="bad")
    except Exception as e:  # noqa: BLE001 - reported below, after the atomicity check
        raised = e
    _assert_unchanged(engine, snap)
    assert engine.handover.weight_version == version
    assert raised is None, (
        f"update_weights_from_disk raised {type(raised).__name__}: {raised} "
        "instead of returning success=False"
    )
    assert res["success"] is False
    assert bad in res["message"], res["message"]


def test_disk_update_rejects_non_directory(base_restored, tmp_path):
    snap = _snapshot(base_restored.engine)
    res = base_restored.engine.update_weights_from_disk(str(tmp_path / "nope"))
    assert res["success"] is False and "nope" in res["message"]
    _assert_unchanged(base_restored.engine, snap)


# ---- distributed atomicity, with a trainer thread on the other end of a gloo group

THREAD_GROUP = "atomicity_group"


@pytest.fixture(scope="module")
def thread_group(upd):
    from tide.weights import init_custom_process_group

    group = _join_group(
        upd.engine,
        THREAD_GROUP,
        lambda port: init_custom_process_group(
            "gloo", "127.0.0.1", port, 0, 2, THREAD_GROUP, timeout_s=JOIN_S
        ),
    )
    yield group
    upd.engine.destroy_weights_update_group(THREAD_GROUP)


def test_weights_update_group_admin_errors(upd, thread_group):
    engine = upd.engine
    again = engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, THREAD_GROUP, "gloo")
    assert again["success"] is False and THREAD_GROUP in again["message"]
    snap = _snapshot(engine)
    res = engine.update_weights_from_distributed(
        [BAD_TARGET], ["float32"], [[64, 64]], group_name="no_such_group"
    )
    assert res["success"] is False and "no_such_group" in res["message"]
    assert engine.destroy_weights_update_group("no_such_group")["success"] is False
    _assert_unchanged(engine, snap)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["per_tensor", "bucket"])
@pytest.mark.parametrize("kind", ["shape", "name", "dtype"])
def test_distributed_update_with_one_bad_tensor_drains_and_changes_nothing(
    kind, load_format, base_restored, thread_group, releases
):
    engine = base_restored.engine
    payload, bad = _with_one_bad(_perturbed(base_restored.base, seed=13), kind)
    snap = _snapshot(engine)
    version = engine.handover.weight_version
    sender = InThread(_broadcast_all, thread_group, payload, load_format, name="trainer-send")
    res = _receive(engine, payload, THREAD_GROUP, load_format, weight_version="bad",
                   torch_empty_cache=True)
    assert sender.result(JOIN_S) == len(payload), "the trainer was left waiting on a broadcast"
    assert res["success"] is False
    assert bad in res["message"], res["message"]
    _assert_unchanged(engine, snap)
    assert engine.handover.weight_version == version
    assert releases.calls == []

    # The group is still in step: the next (valid) update lands bit-exact.
    good = _perturbed(base_restored.base, seed=14)
    sender = InThread(_broadcast_all, thread_group, good, load_format, name="trainer-send")
    res = _receive(engine, good, THREAD_GROUP, load_format, weight_version="good",
                   torch_empty_cache=True)
    assert sender.result(JOIN_S) == len(good)
    assert res["success"], res["message"]
    assert engine.handover.weight_version == "good"
    assert releases.reasons() == ["weight_update"]
    _assert_engine_holds(engine, good)



def test_tensor_update_naming_a_weight_twice_changes_nothing(base_restored):
    """A repeated name (first with a wrong dtype, then a valid one) is refused, not half-applied."""
    engine = base_restored.engine
    good = _perturbed(base_restored.base, seed=21)
    name, tensor = good[3]
    payload = good[:3] + [(name, tensor.double())] + good[3:]
    snap = _snapshot(engine)
    res = engine.update_weights_from_tensor(named_tensors=payload, weight_version="dup")
    assert not res["success"] and name in res["message"] and "more than once" in res["message"]
    _assert_unchanged(engine, snap)


def test_tied_output_head_in_an_update_is_checked_like_the_embedding():
    """A tied model's `lm_head.weight` is its embedding: not written, but a tensor of the wrong
    shape or dtype is refused (it was dropped unchecked and the update reported success)."""
    engine = tide.Engine(dtype="float32", max_total_tokens=2048)  # the demo model: tied
    try:
        embedding = engine.get_weights_by_name("model.embed_tokens.weight", 16)
        shape = tuple(engine.model_runner.model.model.embed_tokens.weight.shape)
        for bad in (torch.zeros(3), torch.zeros(shape[0] + 1, shape[1]),
                    torch.zeros(shape, dtype=torch.int32)):
            out = engine.update_weights_from_tensor([("lm_head.weight", bad)], weight_version="v9")
            assert not out["success"] and "lm_head.weight" in out["message"], out
        ok = engine.update_weights_from_tensor([("lm_head.weight", torch.ones(shape))],
                                               weight_version="v10")
        assert ok["success"], ok
        assert engine.get_weights_by_name("model.embed_tokens.weight", 16) == embedding
    finally:
        engine.shutdown()
