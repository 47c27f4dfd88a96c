"""Tensor parallel on two GPUs (marker `gpu`; skipped with fewer than two): NCCL collectives, inside
the captured decode graphs too.

TP=2 against TP=1 in fp32 (greedy tokens equal, logprobs close) with CUDA graphs and eagerly; a tensor
update and an IPC update (one payload per rank, each rank mapping its own handles) at TP=2; release
and resume of every tag on both GPUs with the memory saver. With four GPUs: TP=4 = TP=1 with CUDA
graphs, and deterministic mode at tp_size 4 is batch-invariant.

Run on a 2-GPU host: `python -m pytest -q -m gpu tests/test_tp_gpu.py`.
"""

from __future__ import annotations

import pytest
import tide
import torch

from conftest import build_checkpoint, named_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 90, 130)]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
OPTIONS = dict(dtype="float32", max_total_tokens=16384, max_running_requests=32,
               attention_backend="torch_native")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tpgpu") / "m", "llama", hidden_size=512,
                            intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=2048)


def _run(engine):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _assert_close(got, want, tol: float = 1e-3) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= tol


@pytest.fixture(scope="module")
def reference(path):
    engine = tide.Engine(str(path), tp_size=1, disable_cuda_graph=True, **OPTIONS)
    out = _run(engine)
    engine.shutdown()
    del engine
    return out


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graph", "eager"])
def test_tp2_matches_tp1(path, reference, graphs):
    # Graphs need the Triton backend (the torch-native one is never captured).
    options = dict(OPTIONS, attention_backend="triton") if graphs else OPTIONS
    with tide.Engine(str(path), tp_size=2, disable_cuda_graph=not graphs, **options) as engine:
        assert (engine.model_runner.cuda_graph_runner is not None) == graphs
        assert str(engine.model_runner.device) == "cuda:0"
        _assert_close(_run(engine), reference)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_tp4_matches_tp1_in_graphs(path, reference):
    """Four ranks with CUDA graphs: the one-shot sums and the fused sum + norm's row channel at a
    world of four (fp32 rows), against one GPU."""
    options = dict(OPTIONS, attention_backend="triton")
    with tide.Engine(str(path), tp_size=4, **options) as engine:
        assert engine.model_runner.cuda_graph_runner is not None
        _assert_close(_run(engine), reference)
        _assert_close(_run(engine), reference)  # the row buffers' parity survives a second run


def _ipc_sender(named, queue, done) -> None:
    """A colocated trainer: rank r's payload holds CUDA IPC handles of tensors on GPU r."""
    from tide.weights import flatten_by_dtype, serialize_named_tensors

    keep, payloads = [], []
    for gpu in (0, 1):
        on_gpu = [(n, t.to(f"cuda:{gpu}")) for n, t in named]
        keep.append(on_gpu)  # the shared memory stays alive until the engine has copied it
        payloads.append(serialize_named_tensors(flatten_by_dtype(on_gpu)))
    queue.put(payloads)
    done.wait(120)


def test_weight_updates_at_tp2(path, reference, tmp_path):
    import torch.multiprocessing as mp
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = named_weights(model)
    changed = [(n, t * 1.5 if "mlp" in n else t) for n, t in original]
    with tide.Engine(str(path), tp_size=2, **OPTIONS) as engine:
        res = engine.update_weights_from_tensor(named_tensors=[(n, t.cuda()) for n, t in changed])
        assert res["success"], res["message"]
        moved = _run(engine)
        assert [ids for ids, _ in moved] != [ids for ids, _ in reference]
        name = "model.layers.1.mlp.down_proj.weight"
        got = torch.tensor(engine.get_weights_by_name(name, 10**7))
        assert torch.equal(got, dict(changed)[name].reshape(-1))
        ctx = mp.get_context("spawn")
        queue, done = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_ipc_sender, args=(original, queue, done))
        proc.start()
        try:
            payloads = queue.get(timeout=120)
            res = engine.update_weights_from_ipc(payloads, weight_version="ipc")
            assert res["success"], res["message"]
        finally:
            done.set()
            proc.join(30)
        _assert_close(_run(engine), reference)


def test_release_and_resume_on_both_gpus(path, reference):
    with tide.Engine(str(path), tp_size=2, enable_memory_saver=True, enable_cpu_backup=True,
                     **OPTIONS) as engine:
        _run(engine)
        used = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
        assert engine.pause_generation("retract")["success"]
        res = engine.release_memory_occupation()
        assert res["success"], res["message"]
        freed = [torch.cuda.mem_get_info(i)[0] - used[i] for i in (0, 1)]
        assert all(f > 0 for f in freed), freed  # both GPUs gave memory back
        assert engine.resume_memory_occupation()["success"]
        assert engine.continue_generation()["success"]
        _assert_close(_run(engine), reference)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_deterministic_tp4_is_batch_invariant(path):
    """enable_deterministic_inference at tp_size 4 (bf16, CUDA graphs): each prompt alone and all of
    them in one batch give the same tokens and logprobs bit for bit. With three ranks or more NCCL's
    all-reduce adds the ranks in an order that follows the message size; the ranks' partials are
    therefore gathered and added in rank order (`TpGroup.batch_invariant`)."""
    options = dict(OPTIONS, dtype="bfloat16")
    options.pop("attention_backend")
    with tide.Engine(str(path), tp_size=4, enable_deterministic_inference=True,
                     **options) as engine:
        alone = []
        for prompt in PROMPTS:
            engine.flush_cache()
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            alone.append((out["output_ids"],
                          [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]))
        engine.flush_cache()
        assert _run(engine) == alone


def _one_shot_rank(rank: int, port: int, queue) -> None:
    """Rank `rank` of two: the one-shot sum against NCCL's, eagerly and replayed in a CUDA graph."""
    from tide.layers.one_shot import SLOT_BYTES, OneShotAllReduce
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_custom_process_group("nccl", "127.0.0.1", port, rank, 2, "one-shot-test",
                                      device=device)
    reducer = OneShotAllReduce.create(group.pg, rank, 2, device)
    assert reducer is not None, "peer access between the two GPUs"
    opts = torch.distributed.AllreduceOptions()

    def nccl(x):
        y = x.clone()
        group.pg.allreduce([y], opts).wait()
        return y

    mismatches = []
    gen = torch.Generator(device).manual_seed(rank)
    sizes = [1, 7, 4096, 4096 * 33 + 5, SLOT_BYTES // 2]
    for dtype in (torch.bfloat16, torch.float32):
        for n in sizes:
            if n * torch.tensor([], dtype=dtype).element_size() > SLOT_BYTES:
                continue
            for _ in range(3):  # both slots, then the first again
                x = torch.randn(n, device=device, generator=gen).to(dtype)
                if not torch.equal(reducer(x.clone()), nccl(x)):
                    mismatches.append(("eager", str(dtype), n))
    # Three sums per replay, as three layers of a decode step; the inputs change every replay.
    static = torch.zeros(3, 8, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(static)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            for i in range(3):
                out[i] = reducer(static[i].clone() * 1.0)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(3):
            out[i] = reducer(static[i] * 1.0)
    for step in range(50):
        static.copy_(torch.randn(static.shape, device=device, generator=gen))
        graph.replay()
        want = torch.stack([nccl(static[i]) for i in range(3)])
        if not torch.equal(out, want):
            mismatches.append(("graph", step))
    torch.cuda.synchronize(device)
    queue.put((rank, mismatches))


def _on_two_ranks(target) -> dict:
    """Run `target(rank, port, queue)` in two spawned processes, one per GPU; what each put."""
    import torch.multiprocessing as mp

    from conftest import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    return results


def test_one_shot_all_reduce_equals_nccl_eagerly_and_in_graphs():
    assert _on_two_ranks(_one_shot_rank) == {0: [], 1: []}


def _reducer_on(rank: int, port: int, name: str):
    """(device, `OneShotAllReduce`) of rank `rank` of two, over a fresh NCCL group `name`."""
    from tide.layers.one_shot import OneShotAllReduce
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_custom_process_group("nccl", "127.0.0.1", port, rank, 2, name, device=device)
    reducer = OneShotAllReduce.create(group.pg, rank, 2, device)
    assert reducer is not None
    return device, reducer


def _one_shot_norm_rank(rank: int, port: int, queue) -> None:
    """Rank `rank` of two: the fused sum + residual + RMSNorm against the one-shot sum followed by
    `triton_ops.rmsnorm`, bit for bit, eagerly (calls of both channels interleaved, one rank
    sleeping at random) and replayed in a CUDA graph as a decode step's layers would."""
    import random
    import time

    from tide.layers import triton_ops

    device, reducer = _reducer_on(rank, port, "one-shot-norm")
    width, eps, bf16 = 4096, 1e-5, torch.bfloat16
    shared = torch.Generator(device).manual_seed(1)  # residual and weight: the same on both ranks
    own = torch.Generator(device).manual_seed(10 + rank)
    w = (torch.rand(width, device=device, generator=shared) + 0.5).to(bf16)

    def reference(x, r):
        return triton_ops.rmsnorm(reducer(x.clone()), w, eps, residual=r)

    mismatches: list = []
    rng, delays = random.Random(3), random.Random(50 + rank)
    for call in range(120):
        rows = rng.choice([1, 3, 64, 65, 256, 1024])  # 1024 rows: a whole 8 MiB slot
        x = torch.randn(rows, width, device=device, generator=own).to(bf16)
        r = torch.randn(rows, width, device=device, generator=shared).to(bf16)
        got = reducer.add_rmsnorm(x, r, w, eps)
        want = reference(x, r)  # a plain sum between fused ones, on the other channel
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            mismatches.append(("eager", call, rows))
        if rank == call % 2 and delays.random() < 0.2:
            time.sleep(delays.random() * 0.002)
    if reducer.fits_rows(torch.empty(1, 2048, device=device, dtype=bf16),
                         torch.empty(1, 2048, device=device, dtype=bf16)):
        mismatches.append("a second row width took the row channel")
    # A layer as a decode step runs it: a fused sum (o_proj's partials), a plain sum between, then
    # a fused sum whose residual is the first one's output (down_proj's partials).
    static_x = torch.zeros(3, 8, width, device=device, dtype=bf16)
    static_r = torch.zeros(8, width, device=device, dtype=bf16)
    out = torch.empty(3, 8, width, device=device, dtype=bf16)

    def layer():
        normed, res = reducer.add_rmsnorm(static_x[0] * 1.0, static_r, w, eps)
        plain = reducer(static_x[1] * 1.0)
        normed2, _ = reducer.add_rmsnorm(static_x[2] * 1.0, res, w, eps)
        out[0].copy_(normed)
        out[1].copy_(plain)
        out[2].copy_(normed2)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    for step in range(30):
        static_x.copy_(torch.randn(static_x.shape, device=device, generator=own))
        static_r.copy_(torch.randn(static_r.shape, device=device, generator=shared))
        graph.replay()
        normed, res = reference(static_x[0], static_r)
        want = torch.stack([normed, reducer(static_x[1].clone()), reference(static_x[2], res)[0]])
        if not torch.equal(out, want):
            diff = (out.float() - want.float()).abs().amax(dim=(1, 2))
            mismatches.append(("graph", step, diff.tolist()))
    torch.cuda.synchronize(device)
    queue.put((rank, mismatches))


def test_one_shot_sum_add_and_norm_equals_the_sum_then_the_norm():
    assert _on_two_ranks(_one_shot_norm_rank) == {0: [], 1: []}


def _one_shot_rows_stress_rank(rank: int, port: int, queue) -> None:
    """Back-to-back fused sums of mixed row counts with nothing between them (one rank sleeping at
    random), so a rank runs ahead into the other row buffer; checked after the last call against
    the sum in rank order of both ranks' inputs (each rank regenerates its peer's), then the norm."""
    import random
    import time

    from tide.layers import triton_ops

    device, reducer = _reducer_on(rank, port, "one-shot-rows")
    width, eps, bf16 = 4096, 1e-5, torch.bfloat16
    gens = [torch.Generator(device).manual_seed(20 + r) for r in (0, 1)]
    shared = torch.Generator(device).manual_seed(2)
    w = (torch.rand(width, device=device, generator=shared) + 0.5).to(bf16)
    rng, delays = random.Random(5), random.Random(60 + rank)
    calls = []
    for call in range(300):
        rows = rng.choice([1, 1, 2, 7, 64, 65, 130, 1024])
        xs = [torch.randn(rows, width, device=device, generator=g).to(bf16) for g in gens]
        r = torch.randn(rows, width, device=device, generator=shared).to(bf16)
        calls.append((xs, r, reducer.add_rmsnorm(xs[rank].clone(), r, w, eps)))
        if rank == call % 2 and delays.random() < 0.2:
            time.sleep(delays.random() * 0.002)
    torch.cuda.synchronize(device)
    bad = []
    for i, (xs, r, (normed, res)) in enumerate(calls):
        summed = (xs[0].float() + xs[1].float()).to(bf16)
        want_normed, want_res = triton_ops.rmsnorm(summed, w, eps, residual=r)
        if not (torch.equal(normed, want_normed) and torch.equal(res, want_res)):
            bad.append(i)
    queue.put((rank, bad))


def test_one_shot_rows_back_to_back_with_a_rank_running_ahead():
    assert _on_two_ranks(_one_shot_rows_stress_rank) == {0: [], 1: []}


def _one_shot_stress_rank(rank: int, port: int, queue) -> None:
    """Back-to-back one-shot sums of mixed sizes and dtypes with nothing between them that lines
    the ranks up (no NCCL call, one rank sleeping at random): what the two-slot protocol guards."""
    import random
    import time

    from tide.layers.one_shot import SLOT_BYTES, OneShotAllReduce
    from tide.weights import init_custom_process_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_custom_process_group("nccl", "127.0.0.1", port, rank, 2, "one-shot-stress",
                                      device=device)
    reducer = OneShotAllReduce.create(group.pg, rank, 2, device)
    assert reducer is not None
    rng = random.Random(7)  # the same call sequence on both ranks
    delays = random.Random(100 + rank)
    calls = []
    for call in range(400):
        dtype = rng.choice([torch.bfloat16, torch.float32])
        n = rng.choice([1, 3, 1000, 4096, 70_000, SLOT_BYTES // 4])
        # Small integers, exact in bf16 and in their sum: call, rank and index are all visible.
        base = (torch.arange(n, device=device) % 61).to(torch.float32) + call % 50
        x = (base + 100 * rank).to(dtype)
        want = (2 * base + 100).to(dtype)
        calls.append((reducer(x), want))
        if rank == call % 2 and delays.random() < 0.2:
            time.sleep(delays.random() * 0.002)
    torch.cuda.synchronize(device)
    queue.put((rank, [i for i, (got, want) in enumerate(calls) if not torch.equal(got, want)]))


def test_one_shot_all_reduce_under_back_to_back_calls_of_mixed_sizes():
    assert _on_two_ranks(_one_shot_stress_rank) == {0: [], 1: []}


def test_fp8_projections_at_tp2_graphs_give_eager_tokens_and_follow_an_update(path, tmp_path):
    """quantization="fp8" at TP=2 (bf16, Triton, the one-shot sums): graphs give eager's tokens,
    bs1 included (the fp8 GEMV on each rank's part), and after an update of a row-parallel
    projection both ranks' fp8 copies follow: tokens equal a fresh TP=2 fp8 engine loaded from a
    checkpoint holding the new tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    options = dict(dtype="bfloat16", max_total_tokens=16384, max_running_requests=32,
                   quantization="fp8")
    runs = []
    for graphs in (True, False):
        with tide.Engine(str(path), tp_size=2, disable_cuda_graph=not graphs, **options) as engine:
            single = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)["output_ids"]
            runs.append(([ids for ids, _ in _run(engine)], single))
    assert runs[0] == runs[1]
    name = "model.layers.0.mlp.down_proj.weight"
    new_path = tmp_path / "updated"
    shutil.copytree(path, new_path)
    (shard,) = new_path.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors[name] = (tensors[name].float() * -0.5).to(tensors[name].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with tide.Engine(str(new_path), tp_size=2, **options) as fresh:
        want = [ids for ids, _ in _run(fresh)]
    with tide.Engine(str(path), tp_size=2, **options) as engine:
        new = tensors[name].to(torch.bfloat16)
        assert engine.update_weights_from_tensor(named_tensors=[(name, new)])["success"]
        assert [ids for ids, _ in _run(engine)] == want
    assert want != runs[0][0]
