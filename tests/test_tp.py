"""Tensor parallelism on CPU (gloo): TP=2 against TP=1 on tiny fp32 checkpoints.

Greedy tokens equal and logprobs within 1e-5 for Llama, Qwen2 (q/k/v bias), Qwen3 (tied embeddings),
a hybrid-SWA Gemma-3, and a GQA model with fewer KV heads than ranks (with a vocabulary the ranks do
not divide and biases on every projection);
batches mix a cached prefix and a chunked prompt, so the request-table writes reach every rank. Every
weight-update path at TP=2 gives what the same update gives at TP=1; an update that fails on one rank
changes no rank; release/resume act on every rank (with a CPU backup, each rank's host buffer is
reused across cycles and every rank refuses updates while released). The hybrid-SWA model also goes
through release/resume, flush and an update while paused in place. In deterministic mode the ranks'
sum is batch-invariant at three ranks too.

Run alone: `python -m pytest -q tests/test_tp.py` (about a minute on two cores).
"""

from __future__ import annotations

import pytest
import tide
import torch
from tide.weights import flatten_by_dtype, init_custom_process_group, serialize_named_tensors

from conftest import (
    InThread,
    build_checkpoint,
    free_port,
    named_weights,
    random_prompts,
    sgd_steps,
)

JOIN_S = 60.0
LOGPROB_TOL = 1e-5
OPTIONS = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8,
               chunked_prefill_size=16)
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
_BASE = random_prompts(7, [5, 20, 40])
# The third prompt extends the second: its prefix comes from the radix cache; 40 tokens are chunked.
PROMPTS = [_BASE[0], _BASE[1], _BASE[1] + _BASE[2][:12], _BASE[2]]


def _run(engine, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _assert_same(got, want) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        diff = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
        assert diff <= LOGPROB_TOL, f"logprobs differ by {diff}"


def _close(got, want) -> bool:
    """Same greedy tokens and logprobs within LOGPROB_TOL (a cached prefix or another chunking moves
    fp32 logprobs by ~1e-7)."""
    try:
        _assert_same(got, want)
    except AssertionError:
        return False
    return True


def _parity(path, **options) -> None:
    with tide.Engine(str(path), tp_size=1, **OPTIONS, **options) as one:
        want = _run(one)
    with tide.Engine(str(path), tp_size=2, **OPTIONS, **options) as two:
        assert two.get_server_info()["max_total_tokens"] == OPTIONS["max_total_tokens"]
        _assert_same(_run(two), want)
        _assert_same(_run(two), want)  # again: prefixes now come from the radix cache


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory):
    """One KV head (replicated on both ranks), an odd vocabulary (padded on the last rank), and
    biases on every projection (row-parallel ones are added once, after the all-reduce)."""
    return build_checkpoint(tmp_path_factory.mktemp("gqa") / "m", "llama", num_key_value_heads=1,
                            vocab_size=509, attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_tp1(arch, checkpoints):
    _parity(checkpoints[arch])


def test_tp2_matches_tp1_fewer_kv_heads_than_ranks(gqa_path):
    _parity(gqa_path)


def test_overlap_schedule_at_tp2_gives_the_one_step_tokens(llama_path):
    # Overlapped decode steps reach rank 1 with their input ids still in a tensor (the previous
    # step's tokens), sent with the KV slots in one broadcast over the rank group.
    import test_overlap

    greedy = dict(GREEDY, max_new_tokens=14)

    def make():
        return test_overlap._reqs(PROMPTS + random_prompts(3, [9, 30]), [greedy] * 6,
                                  logprobs=True)

    with tide.Engine(str(llama_path), tp_size=2, **OPTIONS) as engine:
        base = test_overlap._run(engine, make(), overlap=False)
        over = test_overlap._run(engine, make(), overlap=True)
    assert over["overlapped"] > 0, "no decode step was launched ahead"
    assert over["out"] == base["out"]
    with tide.Engine(str(llama_path), tp_size=1, **OPTIONS) as one:
        want = test_overlap._run(one, make(), overlap=False)
    for rid, (ids, *_rest) in want["out"].items():
        assert base["out"][rid][0] == ids


def test_tp_size_the_model_cannot_split_is_refused(llama_path):
    with pytest.raises(ValueError, match="tp_size 3"):
        tide.Engine(str(llama_path), tp_size=3, **OPTIONS)
    with pytest.raises(ValueError, match="tp_size"):
        tide.Engine(str(llama_path), tp_size=0, **OPTIONS)


def test_every_rank_counts_its_gpu_from_the_same_first_one(monkeypatch):
    # A rank makes its own GPU current before it builds its model: resolving `cuda` again there
    # must not count from that GPU (rank 1 of 2 would ask for cuda:2).
    from tide.config import EngineConfig
    from tide.executor.model_runner import resolve_device
    from tide.scheduler.tp_worker import pin_first_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    config = pin_first_device(EngineConfig(model_path="m", load_format="dummy", device="cuda", tp_size=2))
    assert config.device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)  # rank 1 made cuda:2 current
    assert [resolve_device(config.device, r) for r in (0, 1)] == [torch.device("cuda", 1),
                                                                  torch.device("cuda", 2)]
    with pytest.raises(ValueError, match="tp_size needs GPUs 2..3"):
        pinned = pin_first_device(EngineConfig(model_path="m", load_format="dummy", device="cuda:2"))
        resolve_device(pinned.device, 1)


# ---- weight updates: the same update at TP=1 and TP=2 gives the same outputs


class Pair:
    def __init__(self, path) -> None:
        self.one = tide.Engine(str(path), tp_size=1, **OPTIONS)
        self.two = tide.Engine(str(path), tp_size=2, **OPTIONS)

    def both(self, method: str, *args, **kwargs) -> None:
        for engine in (self.one, self.two):
            res = getattr(engine, method)(*args, **kwargs)
            assert res["success"], res["message"]

    def assert_same(self) -> list:
        want = _run(self.one)
        _assert_same(_run(self.two), want)
        return want


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """Two trained variants of the llama checkpoint: named tensors and a saved directory each."""
    import transformers

    out = []
    for seed in (1, 2):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints["llama"], dtype=torch.float32)
        sgd_steps(model, steps=2, lr=0.5, seed=seed)
        path = tmp_path_factory.mktemp(f"trained{seed}")
        model.save_pretrained(path)
        out.append((named_weights(model), path))
    return out


@pytest.fixture(scope="module")
def pair(checkpoints):
    p = Pair(checkpoints["llama"])
    yield p
    p.one.shutdown()
    p.two.shutdown()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_every_update_path_at_tp2_matches_tp1(pair, trained, checkpoints):
    before = pair.assert_same()
    (a, a_path), (b, _) = trained
    pair.both("update_weights_from_disk", str(a_path))
    after_disk = pair.assert_same()
    assert not _close(after_disk, before)
    pair.both("update_weights_from_tensor", named_tensors=b)
    assert not _close(pair.assert_same(), after_disk)
    pair.both("update_weights_from_tensor", named_tensors=flatten_by_dtype(a),
              load_format="flattened_bucket")
    assert _close(pair.assert_same(), after_disk)
    pair.both("update_weights_from_tensor", serialized_named_tensors=serialize_named_tensors(b))
    after_b = pair.assert_same()
    # sglang's form: one payload per rank (here TP=1 gets one, TP=2 two).
    payload = serialize_named_tensors(a)
    for engine, n in ((pair.one, 1), (pair.two, 2)):
        res = engine.update_weights_from_tensor(serialized_named_tensors=[payload] * n)
        assert res["success"], res["message"]
    assert _close(pair.assert_same(), after_disk)
    # get_weights_by_name gathers every rank's part (column, row and vocabulary splits).
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight",
                 "lm_head.weight"):
        n = dict(a)[name].numel()
        assert pair.two.get_weights_by_name(name, n) == pair.one.get_weights_by_name(name, n)
        assert torch.equal(torch.tensor(pair.two.get_weights_by_name(name, n)),
                           dict(a)[name].reshape(-1))
    pair.both("update_weights_from_tensor", named_tensors=b)
    assert _close(pair.assert_same(), after_b)
    pair.both("update_weights_from_disk", str(checkpoints["llama"]))
    assert _close(pair.assert_same(), before)


def test_distributed_update_at_tp2_matches_tp1(pair, trained, checkpoints):
    """One trainer group spans the trainer (rank 0), the TP=1 engine (rank 1) and the two ranks of
    the TP=2 engine (rank_offset 2: ranks 2 and 3). Flattened buffers travel in the smallest pieces,
    so tensors straddle pieces and the two receive buffers, including tensors a rank keeps part of."""
    from tide.weights.distributed import MIN_BUCKET_BYTES

    port, name = free_port(), "tp_trainer"
    trainer = InThread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 4, name,
                       timeout_s=JOIN_S, bucket_bytes=MIN_BUCKET_BYTES, name="trainer-join")
    joins = [InThread(pair.one.init_weights_update_group, "127.0.0.1", port, 1, 4, name, "gloo"),
             InThread(pair.two.init_weights_update_group, "127.0.0.1", port, 2, 4, name, "gloo")]
    for j in joins:
        res = j.result(JOIN_S)
        assert res["success"], res["message"]
    group = trainer.result(JOIN_S)
    (a, _), _ = trained
    before = pair.assert_same()
    try:
        for load_format in (None, "flattened_bucket"):
            names = [n for n, _ in a]
            dtypes = [_dtype_name(t.dtype) for _, t in a]
            shapes = [list(t.shape) for _, t in a]
            recv = [InThread(e.update_weights_from_distributed, names, dtypes, shapes,
                             group_name=name, load_format=load_format)
                    for e in (pair.one, pair.two)]
            if load_format == "flattened_bucket":
                group.broadcast_flattened(*(b.flattened_tensor for b in flatten_by_dtype(a)))
            else:
                group.broadcast_weights(a)
            for r in recv:
                res = r.result(JOIN_S)
                assert res["success"], res["message"]
            assert not _close(pair.assert_same(), before)
            for n, t in a:  # bit-exact on every rank, gathered
                assert torch.equal(torch.tensor(pair.two.get_weights_by_name(n, t.numel())),
                                   t.reshape(-1)), n
            pair.both("update_weights_from_disk", str(checkpoints["llama"]))
    finally:
        pair.both("destroy_weights_update_group", name)


def _rank_parts(path, named, rank: int, size: int):
    """Rank `rank`'s part of every tensor, as a trainer that shards for tide would send it."""
    from tide.model_config import ModelConfig
    from tide.models import get_model_class
    from tide.parallel import TpGroup, tp_context
    from tide.weights.mapping import WeightMap, local_part

    config = ModelConfig.from_dir(str(path))
    with torch.device("meta"), tp_context(TpGroup(rank, size)):
        model = get_model_class(config.architecture)(config)
    weight_map = WeightMap(model)
    out = []
    for name, t in named:
        target = weight_map.resolve(name)
        if target is not None:
            out.append((name, local_part(target, t).contiguous()))
    return out


def test_sharded_per_rank_payloads_at_tp2_match_full_update_at_tp1(pair, trained, checkpoints):
    before = pair.assert_same()
    (a, _), _ = trained
    path = checkpoints["llama"]
    res = pair.one.update_weights_from_tensor(serialized_named_tensors=serialize_named_tensors(a))
    assert res["success"], res["message"]
    payloads = [serialize_named_tensors(_rank_parts(path, a, r, 2)) for r in range(2)]
    res = pair.two.update_weights_from_tensor(serialized_named_tensors=payloads,
                                              load_format="sharded")
    assert res["success"], res["message"]
    after = pair.assert_same()
    assert not _close(after, before)
    # Full tensors declared as parts are refused on every rank, naming the tensor.
    full = serialize_named_tensors(a)
    res = pair.two.update_weights_from_tensor(serialized_named_tensors=[full, full],
                                              load_format="sharded")
    assert res["success"] is False and "this rank's part" in res["message"], res["message"]
    assert _close(pair.assert_same(), after)
    pair.both("update_weights_from_disk", str(path))


def test_update_that_fails_on_one_rank_changes_no_rank(pair, trained):
    """Rank 1's payload has a bad shape: rank 0 validated its own, yet applies nothing."""
    before = pair.assert_same()
    (a, _), _ = trained
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(n, t[:, :-1] if n == name else t) for n, t in a]
    snap = {n: pair.two.get_weights_by_name(n, 64) for n, _ in a}
    res = pair.two.update_weights_from_tensor(
        serialized_named_tensors=[serialize_named_tensors(a), serialize_named_tensors(bad)],
        weight_version="bad")
    assert res["success"] is False
    assert "rank 1" in res["message"] and name in res["message"], res["message"]
    assert pair.two.handover.weight_version != "bad"
    assert {n: pair.two.get_weights_by_name(n, 64) for n, _ in a} == snap
    assert _close(pair.assert_same(), before)


def test_release_and_resume_act_on_every_rank(checkpoints, trained):
    path = checkpoints["llama"]
    with tide.Engine(str(path), tp_size=1, **OPTIONS) as one:
        want = _run(one)
    with tide.Engine(str(path), tp_size=2, enable_memory_saver=True, **OPTIONS) as two:
        assert two.pause_generation("retract")["success"]
        res = two.release_memory_occupation()
        assert res["success"], res["message"]
        per_rank = two.worker.memory_occupation.released_bytes_per_rank()
        assert len(per_rank) == 2 and all(r["weights"] > 0 and r["kv_cache"] > 0 for r in per_rank)
        with pytest.raises(ValueError, match="released"):
            two.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert two.resume_memory_occupation()["success"]
        # No CPU backup: every rank's weights came back zeroed; a full push refills all of them.
        assert two.get_weights_by_name("model.layers.1.mlp.down_proj.weight", 8) == [0.0] * 8
        assert two.continue_generation()["success"]
        with pytest.raises(ValueError, match="push new weights"):
            two.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        original = named_weights(_hf(path))
        res = two.update_weights_from_tensor(named_tensors=original)
        assert res["success"], res["message"]
        _assert_same(_run(two), want)
        # Every rank's ledger holds its own release points.
        ledgers = two.worker.rank_ledgers()
        assert len(ledgers) == 2
        for ledger in ledgers:
            assert ledger["mark_counts"].get("release", 0) == 1, ledger["mark_counts"]
            assert ledger["mark_counts"].get("resume", 0) == 1, ledger["mark_counts"]
        assert ledgers[0]["pid"] != ledgers[1]["pid"]
        rank1 = two.worker._procs[0]
        assert rank1.poll() is None
    assert rank1.poll() is not None  # shutdown stopped the rank process


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_server_at_tp2_serves_reports_per_rank_and_stops_every_rank(llama_path, tmp_path):
    """`tide serve --tp-size 2`: the scheduler process starts rank 1; /generate matches the engine at
    TP=1; /metrics has per-rank memory; SIGTERM leaves no process behind."""
    from prometheus_client.parser import text_string_to_metric_families

    from server_utils import ServerProcess

    with tide.Engine(str(llama_path), tp_size=1, **OPTIONS) as one:
        want = _run(one, PROMPTS[:1])
    srv = ServerProcess(llama_path, "--tp-size", "2", "--device", "cpu", "--dtype", "float32",
                        "--max-total-tokens", "1024", log_dir=tmp_path)
    try:
        srv.wait_ready()
        out = srv.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": GREEDY,
                                     "return_logprob": True}).json()
        got = [(out["output_ids"], [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])]
        _assert_same(got, want)
        ranks = {}
        for family in text_string_to_metric_families(srv.get("/metrics").text):
            if family.name == "tide:rank_memory_allocated_bytes":
                ranks = {s.labels["rank"]: s.value for s in family.samples}
        assert set(ranks) == {"0", "1"} and all(v > 0 for v in ranks.values()), ranks
        assert len(srv.group_pids(settle=0)) >= 3  # server, scheduler, rank 1
    finally:
        srv.proc.send_signal(15)
        srv.proc.wait(30)
        left = srv.group_pids()
        srv.stop()
    assert left == [], left


# ---- deterministic mode: the ranks' sum does not depend on the batch


def _all_reduce_rows(rank: int, size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from tide.parallel import TpGroup

    torch.set_num_threads(1)  # a forked child: no intra-op pool of the parent's
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        pg = dist.distributed_c10d._get_default_group()
        gen = torch.Generator().manual_seed(rank)
        # Values over seven decades: a different order of the ranks' adds shows in the last bits.
        rows = torch.randn(300, 48, generator=gen) * 10.0 ** torch.randint(-3, 4, (300, 48),
                                                                          generator=gen)
        result = {}
        for invariant in (False, True):
            group = TpGroup(rank, size, pg, batch_invariant=invariant)
            result[invariant] = [group.all_reduce(rows[:m].clone()) for m in (1, 5, 64, 300)]
        group = TpGroup(rank, size, pg, batch_invariant=True)
        result["bf16"] = [group.all_reduce(rows[:m].bfloat16()) for m in (1, 64, 300)]
        parts = [None] * size
        dist.all_gather_object(parts, rows)
        if rank == 0:
            torch.save({"result": result, "parts": parts}, f"{out_dir}/rows.pt")
    finally:
        dist.destroy_process_group()


def test_deterministic_all_reduce_of_three_ranks_is_batch_invariant(tmp_path):
    """With three ranks gloo's (and NCCL's) all-reduce adds the ranks in an order that follows how
    the buffer is cut, so a row's sum changed with the number of rows reduced with it. In
    deterministic mode every rank adds the gathered parts in rank order: bit-equal for any batch."""
    import torch.multiprocessing as mp

    mp.start_processes(_all_reduce_rows, args=(3, free_port(), str(tmp_path)), nprocs=3,
                       start_method="fork")
    saved = torch.load(tmp_path / "rows.pt")
    parts = saved["parts"]
    ordered = parts[0] + parts[1] + parts[2]
    for got in saved["result"][True]:
        assert torch.equal(got, ordered[: got.shape[0]])
    for got in saved["result"][False]:  # the backend's sum: right up to rounding
        torch.testing.assert_close(got, ordered[: got.shape[0]])
    # bf16: in rank order in fp32, rounded once, as the one-shot kernel sums smaller tensors
    once = sum(p.bfloat16().float() for p in parts).bfloat16()
    for got in saved["result"]["bf16"]:
        assert torch.equal(got, once[: got.shape[0]])


def test_release_resume_with_cpu_backup_reuses_every_ranks_buffer(checkpoints, trained):
    """enable_cpu_backup at TP=2: two release/resume cycles; every rank allocates its host backup
    once and restores from it; while released every rank refuses an update (rank 1 too, with its own
    payload), and after resume updates go through on all ranks."""
    from tide.scheduler.tp_worker import RankError

    path = checkpoints["llama"]
    (a, _), _ = trained
    with tide.Engine(str(path), tp_size=1, **OPTIONS) as one:
        want = _run(one)
    with tide.Engine(str(path), tp_size=2, enable_memory_saver=True, enable_cpu_backup=True,
                     **OPTIONS) as two:
        payload = serialize_named_tensors(a)
        for cycle in range(2):
            assert two.release_memory_occupation()["success"]
            res = two.update_weights_from_tensor(named_tensors=a)
            assert res["success"] is False and "released" in res["message"], res["message"]
            with pytest.raises(RankError) as refused:
                two.worker.call_each("prepare", [(10_000 + cycle, "serialized", (payload, None))] * 2)
            assert set(refused.value.errors) == {0, 1}
            assert all("released" in m for _, m in refused.value.errors.values())
            assert two.resume_memory_occupation()["success"]
            _assert_same(_run(two), want)  # every rank's weights came back from its backup
        report = two.worker.rank_memory()
        assert [r["cpu_backup_allocations"] for r in report] == [1, 1], report
        assert all(r["cpu_backup_bytes"] > 0 for r in report)
        res = two.update_weights_from_tensor(serialized_named_tensors=[payload, payload])
        assert res["success"], res["message"]
        assert not _close(_run(two), want)


def test_tp2_matches_tp1_hybrid_swa_gemma3(tmp_path):
    """Gemma-3 (sliding and full layers) at TP=2, with mixed batches and a CPU backup: outputs equal
    TP=1, and still do after a full release/resume, a flush, and a weight update made while
    generation is paused in place (TP=1 given the same update)."""
    import threading

    import transformers

    from test_swa_models import build_swa_checkpoint

    path = build_swa_checkpoint(tmp_path / "gemma3", "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sgd_steps(hf, steps=1, lr=0.5, seed=3)
    new = named_weights(hf)
    options = dict(OPTIONS, enable_mixed_chunk=True, enable_memory_saver=True,
                   enable_cpu_backup=True)
    with tide.Engine(str(path), tp_size=1, **options) as one:
        want = _run(one)
        assert one.update_weights_from_tensor(named_tensors=new)["success"]
        want_new = _run(one)
    assert not _close(want_new, want)
    with tide.Engine(str(path), tp_size=2, **options) as two:
        _assert_same(_run(two), want)
        _assert_same(_run(two), want)  # again: prefixes now come from the radix cache
        assert two.release_memory_occupation()["success"]
        assert two.resume_memory_occupation()["success"]
        _assert_same(_run(two), want)
        assert two.flush_cache() is True
        _assert_same(_run(two), want)
        done = threading.Event()
        longer = {**GREEDY, "max_new_tokens": 24}
        worker = threading.Thread(target=lambda: (two.generate(input_ids=PROMPTS,
                                                               sampling_params=longer),
                                                  done.set()))
        worker.start()
        assert two.pause_generation("in_place")["success"]
        res = two.update_weights_from_tensor(named_tensors=new)
        assert res["success"], res["message"]
        assert two.continue_generation()["success"]
        worker.join(JOIN_S)
        assert done.is_set()
        _assert_same(_run(two), want_new)


class _FakeOneShot:
    """Stands in for the one-shot kernel on CPU: records which path the norm took."""

    def __init__(self, serves: bool) -> None:
        self.serves, self.calls = serves, []

    def fits(self, x):
        return False  # plain sums go to the (fake) process group below

    def fits_rows(self, x, residual):
        return self.serves

    def add_rmsnorm(self, x, residual, weight, eps):
        self.calls.append("fused")
        return torch.full_like(x, 7.0), torch.full_like(x, 8.0)


class _SumByTwo:
    """A process group of two ranks whose peer holds the same tensor: a sum doubles it."""

    def allreduce(self, tensors, opts):
        tensors[0].mul_(2)
        return self

    def wait(self):
        return True


def test_norm_after_a_row_parallel_projection_sums_in_the_fused_launch_or_else_first():
    """`RMSNorm(x, residual, tp)` with x a rank's partial product: the one-shot kernel's fused sum +
    add + norm when it serves x, else the plain sum and then the norm (the same numbers)."""
    from tide.layers.norm import RMSNorm
    from tide.parallel import TpGroup

    norm = RMSNorm(8, 1e-6)
    torch.manual_seed(0)
    norm.weight.data = torch.rand(8) + 0.5
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    fused = _FakeOneShot(serves=True)
    out = norm(x, r, TpGroup(rank=0, size=2, pg=_SumByTwo(), one_shot=fused))
    assert fused.calls == ["fused"] and torch.equal(out[0], torch.full_like(x, 7.0))
    plain = _FakeOneShot(serves=False)
    got = norm(x.clone(), r, TpGroup(rank=0, size=2, pg=_SumByTwo(), one_shot=plain))
    want = norm(2 * x, r)
    assert plain.calls == [] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(norm(x, r, TpGroup())[0], norm(x, r)[0])  # one rank: nothing to sum


def test_projections_with_a_bias_sum_their_own_output():
    """The sum moves into the next norm only where nothing is added after it (a bias is)."""
    from tide.layers.linear import RowParallelLinear
    from tide.model_config import ModelConfig
    from tide.models.llama import deferred_sum
    from tide.parallel import TpGroup, tp_context

    def config(**extra):
        return ModelConfig.from_hf_dict(dict(
            architectures=["LlamaForCausalLM"], hidden_size=8, intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
            **extra))

    group = TpGroup(rank=0, size=2, pg=_SumByTwo())
    with tp_context(group):
        assert deferred_sum(config()) is group
        assert deferred_sum(config(attention_bias=True)) is None
        assert deferred_sum(config(mlp_bias=True)) is None
        biased = RowParallelLinear(8, 4, bias=True)
    assert deferred_sum(config()) is None  # one rank
    with pytest.raises(ValueError, match="bias"):
        biased(torch.randn(1, 4), reduce=False)


class _Pipe:
    """One end of a rank's control connection: what it will receive, and what was sent on it."""

    def __init__(self, incoming) -> None:
        self.incoming, self.sent = list(incoming), []

    def poll(self) -> bool:
        return bool(self.incoming)

    def recv(self):
        return self.incoming.pop(0)

    def send(self, msg) -> None:
        self.sent.append(msg)


def _rank0_group(pipe):
    """A `TpWorkerGroup` of two ranks around `pipe` (no processes, no model)."""
    import threading
    from types import SimpleNamespace

    from tide.scheduler.tp_worker import TpWorkerGroup

    group = object.__new__(TpWorkerGroup)
    group.tp_size, group._conns, group._lock, group._broken = 2, [pipe], threading.Lock(), None
    group.runtime = SimpleNamespace(ping=lambda: 3)
    group.req_to_token_pool = SimpleNamespace(take_writes=lambda: [])
    group.tp = SimpleNamespace(broadcast=lambda payload: None)
    return group


def _prefill_batch():
    from types import SimpleNamespace

    from tide.executor.forward_batch import ForwardMode

    return SimpleNamespace(out_cache_loc=torch.tensor([4]), is_decode=False, input_ids=[9],
                           mode=ForwardMode.EXTEND, positions=[0], req_pool_indices=[0],
                           prefix_lens=[0], extend_lens=[1], score=None)


def test_a_forward_that_fails_on_a_child_stops_every_later_step():
    """A child whose forward raised tells rank 0 (its collectives may no longer line up with rank
    0's: the one-shot sum would add mismatched calls silently). Rank 0 then refuses that step and
    every later one with an error naming the rank, whether the report comes before a batch or ahead
    of a call's reply; the call still gets its reply."""
    from tide.scheduler.tp_worker import _serve

    class FailingRuntime:
        def forward(self, batch):
            raise ValueError("boom")

    child = _Pipe([("forward", {}), ("shutdown",)])
    _serve(child, FailingRuntime())
    assert child.sent == [("forward_failed", "ValueError: boom")]

    pipe = _Pipe(child.sent)  # the report waits on rank 0's end
    group = _rank0_group(pipe)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"rank 1: forward failed \(ValueError: boom\).*restart"):
            group.forward_launch(_prefill_batch())
    assert pipe.sent == []  # no batch went out

    pipe = _Pipe([("forward_failed", "RuntimeError: x"), (True, 7)])
    group = _rank0_group(pipe)
    assert group.call("ping") == [3, 7]
    with pytest.raises(RuntimeError, match="rank 1: forward failed"):
        group.forward(_prefill_batch())


def test_a_child_whose_forwards_succeed_sends_nothing_back():
    from tide.scheduler.tp_worker import _serve

    class Runtime:
        def __init__(self):
            self.batches = []

        def forward(self, batch):
            self.batches.append(batch)

    runtime, child = Runtime(), _Pipe([("forward", {"n": 1}), ("forward", {"n": 2}), ("shutdown",)])
    _serve(child, runtime)
    assert runtime.batches == [{"n": 1}, {"n": 2}] and child.sent == []
    pipe = _Pipe([])
    group = _rank0_group(pipe)
    group.local = type("Local", (), {"forward_launch": lambda self, batch: "launched"})()
    assert group.forward_launch(_prefill_batch()) == "launched"
    assert [msg[0] for msg in pipe.sent] == ["forward"]


def test_async_generate_on_ranks(llama_path):
    """`async_generate` steps a TP=2 engine from its background thread (the ranks' sockets used from
    another thread than the one that made them): concurrent calls give `generate`'s outputs."""
    import asyncio

    with tide.Engine(str(llama_path), tp_size=2, **OPTIONS) as engine:
        want = _run(engine)

        async def main() -> list:
            return await asyncio.gather(*[engine.async_generate(
                input_ids=p, sampling_params=GREEDY, return_logprob=True) for p in PROMPTS])

        outs = asyncio.run(main())
    got = [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
           for o in outs]
    _assert_same(got, want)
