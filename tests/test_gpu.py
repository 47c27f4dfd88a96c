"""GPU checks (marker `gpu`, run on a GPU host): triton backend vs torch_native, CUDA graphs vs eager."""

from __future__ import annotations

import pytest
import torch

import tide
from conftest import build_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=[("llama", 1), ("llama", 4), ("llama", 8), ("qwen3", 4)],
                ids=lambda p: f"{p[0]}-gqa{p[1]}")
def gqa_checkpoint(request, tmp_path_factory):
    """Llama at three GQA groups; Qwen3 adds per-head q/k norms (fused into rope-and-store)."""
    arch, group = request.param
    path = tmp_path_factory.mktemp(f"{arch}-gqa{group}")
    return build_checkpoint(
        path,
        arch,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8 // group,
        head_dim=64,
        max_position_embeddings=2048,
    )


def _runner(path, backend: str):
    engine = tide.Engine(
        str(path), dtype="bfloat16", attention_backend=backend, disable_cuda_graph=True,
        max_total_tokens=65536, max_running_requests=64,
    )
    return engine.model_runner


class _Driver:
    """Feeds one runner by hand (request slots, KV slots, positions), bypassing the scheduler."""

    def __init__(self, runner, n: int) -> None:
        self.runner = runner
        self.slots = [runner.req_to_token_pool.alloc() for _ in range(n)]
        self.lens = [0] * n

    def extend(self, chunks: list[list[int]]) -> torch.Tensor:
        pool, alloc = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        loc = alloc.alloc(sum(len(c) for c in chunks))
        off, ids, pos = 0, [], []
        for i, c in enumerate(chunks):
            pool.write(self.slots[i], self.lens[i], loc[off : off + len(c)])
            ids += c
            pos += list(range(self.lens[i], self.lens[i] + len(c)))
            off += len(c)
        logits = self.runner.forward_extend(ids, pos, self.slots, list(self.lens),
                                            [len(c) for c in chunks], loc)
        self.lens = [n + len(c) for n, c in zip(self.lens, chunks)]
        return logits

    def decode(self, next_ids: list[int]) -> torch.Tensor:
        # forward_decode records the new slots in req_to_token itself.
        loc = self.runner.token_to_kv_pool_allocator.alloc(len(next_ids))
        logits = self.runner.forward_decode(next_ids, list(self.lens), self.slots, loc)
        self.lens = [n + 1 for n in self.lens]
        return logits


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("prefix_len", [0, 37])
def test_triton_matches_torch_native(gqa_checkpoint, batch_size, prefix_len):
    torch.manual_seed(batch_size)
    prompts = [torch.randint(2, 500, (int(n),)).tolist()
               for n in torch.randint(prefix_len + 1, prefix_len + 300, (batch_size,))]
    ref = _Driver(_runner(gqa_checkpoint, "torch_native"), batch_size)
    out = _Driver(_runner(gqa_checkpoint, "triton"), batch_size)
    steps = []
    if prefix_len:  # a cached prefix, then the rest of the prompt on top of it
        steps.append((ref.extend([p[:prefix_len] for p in prompts]),
                      out.extend([p[:prefix_len] for p in prompts])))
    rest = [p[prefix_len:] for p in prompts]
    steps.append((ref.extend(rest), out.extend(rest)))
    for _ in range(4):  # both runners decode the same (reference-greedy) tokens
        next_ids = steps[-1][0].argmax(-1).tolist()
        steps.append((ref.decode(next_ids), out.decode(next_ids)))
    for step, (a, b) in enumerate(steps):
        err = (a - b).abs().max().item()
        scale = a.abs().max().item()
        assert err <= 2e-2 * scale + 1e-2, f"step {step}: max |diff| {err} (logit scale {scale})"


def test_decode_long_context_matches_torch_native(tmp_path):
    """Split-KV decode over thousands of tokens (many active splits) against the reference."""
    path = build_checkpoint(tmp_path / "long", "llama", hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                            max_position_embeddings=16384)
    torch.manual_seed(0)
    prompts = [torch.randint(2, 500, (n,)).tolist() for n in (9000, 3000, 700)]
    ref = _Driver(_runner(path, "torch_native"), 3)
    out = _Driver(_runner(path, "triton"), 3)
    a, b = ref.extend(prompts), out.extend(prompts)
    for _ in range(3):
        next_ids = a.argmax(-1).tolist()
        a, b = ref.decode(next_ids), out.decode(next_ids)
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * a.abs().max().item() + 1e-2


def test_cuda_graph_greedy_equals_eager(gqa_checkpoint):
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 90, 130)]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    outs = {}
    for graphs in (False, True):
        engine = tide.Engine(str(gqa_checkpoint), dtype="bfloat16", disable_cuda_graph=not graphs,
                             max_total_tokens=65536, max_running_requests=64)
        assert (engine.model_runner.cuda_graph_runner is not None) == graphs
        outs[graphs] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        del engine
    assert outs[True] == outs[False]


def _ipc_sender(names_shapes, queue, done) -> None:
    """A colocated 'trainer': makes new weights on the GPU and shares them as CUDA IPC handles."""
    import torch

    from tide.weights import flatten_by_dtype, serialize_named_tensors

    torch.manual_seed(123)
    named = [(n, torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.05) for n, s in names_shapes]
    buckets = flatten_by_dtype(named)
    queue.put((serialize_named_tensors(buckets), [(n, t.float().reshape(-1)[:50].tolist()) for n, t in named]))
    done.wait(120)  # keep the shared memory alive until the engine has copied it


def test_update_weights_from_ipc(gqa_checkpoint):
    import torch.multiprocessing as mp

    engine = tide.Engine(str(gqa_checkpoint), dtype="bfloat16", max_total_tokens=65536,
                         max_running_requests=64)
    names_shapes = [("model.layers.0.self_attn.q_proj.weight", (512, 512)),
                    ("model.layers.1.mlp.up_proj.weight", (1024, 512)),
                    ("lm_head.weight", (512, 512))]
    names_shapes = [(n, s) for n, s in names_shapes
                    if engine.worker.weight_updater.weight_map.resolve(n).shape == s]
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_ipc_sender, args=(names_shapes, queue, done))
    proc.start()
    try:
        payload, expected = queue.get(timeout=120)
        before = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 8})
        res = engine.update_weights_from_ipc(payload, weight_version="ipc-1")
        assert res["success"], res
        for name, values in expected:
            got = engine.get_weights_by_name(name, truncate_size=50)
            assert got == pytest.approx(values, abs=0), name
        after = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert after["meta_info"]["weight_version"] == "ipc-1"
        assert before["meta_info"]["weight_version"] == "default"
    finally:
        done.set()
        proc.join(60)


def test_ipc_struct_claiming_past_its_allocation_is_refused(gqa_checkpoint):
    """A CUDA IPC struct whose storage_size_bytes runs past the allocation its handle maps is a
    ValueError (torch would map the claimed size, and a read past the allocation kills the CUDA
    context); the honest struct opens, and the engine goes on serving."""
    import base64

    import msgspec
    import torch.multiprocessing as mp

    from tide.weights import wire

    engine = tide.Engine(str(gqa_checkpoint), dtype="bfloat16", max_total_tokens=65536,
                         max_running_requests=64)
    name = "model.layers.0.self_attn.q_proj.weight"
    shape = tuple(engine.worker.weight_updater.weight_map.resolve(name).shape)
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_ipc_sender, args=([(name, shape)], queue, done))
    proc.start()
    try:
        payload, _ = queue.get(timeout=120)
        raw = base64.b64decode(payload)
        decoded = msgspec.msgpack.Decoder(wire.Payload).decode(raw[len(wire.MAGIC):])
        buckets = decoded.buckets if isinstance(decoded, wire.BucketListPayload) else [decoded.bucket]
        flat = buckets[0].flattened_tensor
        assert isinstance(flat, wire.CudaIpcTensor)
        numel = flat.storage_size_bytes // 2
        huge = msgspec.structs.replace(flat, storage_size_bytes=flat.storage_size_bytes + (1 << 30),
                                       size=[numel + (1 << 29)])
        with pytest.raises(ValueError, match="storage_size_bytes .* runs past the end"):
            wire.tensor_from_wire(huge)
        honest = wire.tensor_from_wire(flat)
        assert honest.numel() == flat.size[0]
        # The driver's range through ctypes (no cuda.bindings) is the same.
        ptr = honest.untyped_storage().data_ptr()
        assert wire._allocation_range_ctypes(ptr) == wire._allocation_range(ptr, flat.device)
        del honest
        # The same forgery through the engine: refused, nothing written, still serving.
        entry = msgspec.structs.replace(buckets[0].metadata[0], offset=numel + (1 << 29) - 16,
                                        shape=[16], numel=16)
        forged = wire.BucketPayload(wire.Bucket(huge, [entry]))
        body = base64.b64encode(wire.MAGIC + msgspec.msgpack.encode(forged)).decode()
        before = engine.get_weights_by_name(name, truncate_size=8)
        res = engine.update_weights_from_ipc(body)
        assert not res["success"] and "runs past the end" in res["message"], res
        assert engine.get_weights_by_name(name, truncate_size=8) == before
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
    finally:
        done.set()
        proc.join(60)
        engine.shutdown()


def _tensor_sender(nbytes, queue, done) -> None:
    """Shares one large fp32 CUDA tensor (its allocator configured by PYTORCH_CUDA_ALLOC_CONF)."""
    import torch

    from tide.weights import serialize_named_tensors

    t = torch.arange(nbytes // 4, device="cuda", dtype=torch.float32)
    queue.put((serialize_named_tensors([("x", t)]), t.double().sum().item()))
    done.wait(120)


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_ipc_tensor_over_many_mapped_ranges_opens(alloc_conf, monkeypatch):
    """A sender with expandable segments shares memory mapped as consecutive pages (each its own
    driver range): a 300 MiB tensor over them opens; 1 GiB more is refused, either allocator."""
    import base64

    import msgspec
    import torch.multiprocessing as mp

    from tide.weights import wire

    torch.cuda.init()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)  # the spawned sender's allocator
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_tensor_sender, args=(300 << 20, queue, done))
    proc.start()
    try:
        payload, total = queue.get(timeout=120)
        raw = base64.b64decode(payload)
        struct = msgspec.msgpack.Decoder(wire.Payload).decode(raw[len(wire.MAGIC):]).tensors[0].tensor
        t = wire.tensor_from_wire(struct)
        assert t.double().sum().item() == pytest.approx(total, rel=1e-12)
        del t
        huge = msgspec.structs.replace(struct, storage_size_bytes=struct.storage_size_bytes + (1 << 30))
        with pytest.raises(ValueError, match="storage_size_bytes .* runs past the end"):
            wire.tensor_from_wire(huge)
    finally:
        done.set()
        proc.join(60)


def test_memory_saver_keeps_addresses_and_graphs(gqa_checkpoint):
    """release -> resume of every tag maps memory back at the same addresses: the captured graphs
    are the same objects (no re-capture) and greedy decoding through them is unchanged."""
    engine = tide.Engine(str(gqa_checkpoint), dtype="bfloat16", enable_memory_saver=True,
                         enable_cpu_backup=True, max_total_tokens=200_000, max_running_requests=64)
    runner = engine.model_runner
    assert runner.use_vmm and runner.cuda_graph_runner is not None
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    ptrs = [t.data_ptr() for t in runner.token_to_kv_pool.k_buffer] + [
        p.data_ptr() for p in runner.model.parameters()] + [
        runner.req_to_token_pool.req_to_token.data_ptr(), runner.cuda_graph_runner.logits.data_ptr()]
    graphs = dict(runner.cuda_graph_runner.graphs)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    res = engine.release_memory_occupation()
    assert res["success"], res
    free_released, _ = torch.cuda.mem_get_info()
    kv_bytes = runner.token_to_kv_pool.region.size
    assert free_released - free_before >= 0.9 * kv_bytes  # the KV region's memory went back
    assert engine.resume_memory_occupation()["success"]
    after_ptrs = [t.data_ptr() for t in runner.token_to_kv_pool.k_buffer] + [
        p.data_ptr() for p in runner.model.parameters()] + [
        runner.req_to_token_pool.req_to_token.data_ptr(), runner.cuda_graph_runner.logits.data_ptr()]
    assert after_ptrs == ptrs
    assert all(runner.cuda_graph_runner.graphs[bs] is g for bs, g in graphs.items())
    after = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert after == before


@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, False), (1000, 512, True),
                                      (129, 768, False), (8192, 3840, False), (3840, 15360, True),
                                      (1000, 3584, True), (4096, 1024, False), (3072, 4096, False),
                                      (4096, 2048, True), (4096, 7168, False)])
def test_gemv_matches_linear(n, k, bias):
    """The one-row Triton GEMV equals F.linear within bf16 rounding (fp32 accumulation both)."""
    from tide.layers import gemv

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert gemv.supported(x, w)
    ref = torch.nn.functional.linear(x, w, b).float()
    got = gemv.gemv(x, w, b).float()
    assert torch.allclose(got, ref, atol=2e-2, rtol=1e-2), (got - ref).abs().max()
    # Several rows per program with a masked last block (the sweep's configs).
    got = gemv.gemv(x, w, b, config=(4, 256, 2)).float()
    assert torch.allclose(got, ref, atol=2e-2, rtol=1e-2), (got - ref).abs().max()
    assert not gemv.supported(torch.randn(2, k, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv.supported(x[:, :100], w[:, :100].contiguous())
    assert not gemv.supported(x[:, :256], w)


@pytest.mark.parametrize("act,n,k", [("silu", 14336, 4096), ("gelu_tanh", 15360, 3840),
                                      ("gelu_tanh", 14336, 3584), ("silu", 3072, 1024)])
def test_gated_gemv_equals_projection_then_activation(act, n, k):
    """bs1's MLP input in one launch (the gate and up rows of a [gate | up] weight per program)
    gives the bits of the GEMV followed by the elementwise activation kernel, at Llama-3.1-8B,
    Gemma-3-12B, Gemma-2-9B and Qwen3-0.6B shapes, and stays within bf16 rounding of cuBLAS + torch."""
    from tide.layers import gemv, triton_ops

    torch.manual_seed(1)
    w = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    two_launches = getattr(triton_ops, f"{act}_and_mul")(gemv.gemv(x, w))
    fused = gemv.gemv(x, w, act=act)
    assert fused.shape == (1, n) and torch.equal(fused, two_launches)
    y = torch.nn.functional.linear(x, w).float()
    gate = torch.nn.functional.silu(y[:, :n]) if act == "silu" else torch.nn.functional.gelu(
        y[:, :n], approximate="tanh")
    ref = gate * y[:, n:]
    assert torch.allclose(fused.float(), ref, atol=3e-2, rtol=3e-2), (fused.float() - ref).abs().max()


@pytest.mark.parametrize("vocab", [128256, 151936, 1000])
def test_argmax_rows_matches_torch(vocab):
    """First index of the maximum per row as torch.argmax: ties, -inf rows, NaN (the maximum),
    and vocab sizes whose last chunks lie past the row end."""
    from tide.layers import triton_ops

    torch.manual_seed(0)
    x = torch.randn(9, vocab, device="cuda")
    x[1, 500] = x[1, vocab - 10] = 100.0  # a tie: the first index wins
    x[2] = float("-inf")
    x[3, -1] = 50.0  # the last column
    x[4] = float("nan")
    x[5, 7] = float("nan")
    x[6, : min(vocab, 4096)] = float("nan")
    x[7, 3] = float("inf")
    x[7, 9] = float("nan")
    out = torch.empty(9, dtype=torch.int64, device="cuda")
    triton_ops.argmax_rows(x, out)
    assert out.tolist() == x.argmax(dim=-1).tolist()
    assert out[1].item() == 500


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_memory_saver_makes_the_weights_in_their_region(quantization, monkeypatch):
    """With the memory saver every parameter is made in the weights region as it is registered:
    the caching allocator's peak while the engine starts stays far below the weights (the
    copy-after-load start held every weight twice), every parameter lies in the region, and the
    tokens equal those of an engine without the memory saver (same dummy weights)."""
    from benchmarks.shapes import config_dir

    kw = dict(load_format="dummy", dtype="bfloat16", disable_cuda_graph=True,
              max_running_requests=8, max_total_tokens=4096, quantization=quantization)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompts = [[3, 17, 99, 5, 1000], list(range(7, 60))]
    plain = tide.Engine(config_dir("qwen3-0.6b"), **kw)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    plain.shutdown()
    del plain
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # Blocks the allocator still reserves but does not use when the KV pool is sized: memory the
    # pool does not get. The parameters' first homes must all have gone back, including those
    # that buffers made during construction (the rotary tables) had shared. A live tensor of 1 to
    # 10 MB keeps its whole 20 MiB segment (the allocator's granularity): 20.2 MiB measured here,
    # against 258 MiB while the rotary tables still held a parameter's block (H100, 2026-11-27).
    from tide.executor import model_runner

    stranded = []
    measure = model_runner.available_device_memory

    def recording(device, *args, **kwargs):
        stranded.append(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        return measure(device, *args, **kwargs)

    monkeypatch.setattr(model_runner, "available_device_memory", recording)
    engine = tide.Engine(config_dir("qwen3-0.6b"), enable_memory_saver=True, **kw)
    monkeypatch.undo()
    peak = torch.cuda.max_memory_allocated() - base
    assert stranded and stranded[0] < 48 << 20, stranded
    runner = engine.model_runner
    region = runner.weights_region
    assert runner.use_vmm and region is not None
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert region.used >= weights > 1 << 30
    largest = max(p.numel() * p.element_size() for p in runner.model.parameters())
    assert peak < largest + (200 << 20) < weights / 2, (peak, largest, weights)
    assert all(region.ptr <= p.data_ptr() < region.ptr + region.used
               for p in runner.model.parameters())
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected
    engine.shutdown()


def test_memory_saver_start_that_fails_to_load_gives_the_region_back(tmp_path):
    """A checkpoint that does not match its config fails the start with the memory saver on, and
    the weights region made for it is freed at once (not held until the process ends)."""
    import json

    path = build_checkpoint(tmp_path / "ckpt", "llama", hidden_size=512, intermediate_size=4096,
                            num_hidden_layers=4, max_position_embeddings=2048)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 8192  # the checkpoint's MLP weights are half as wide
    (path / "config.json").write_text(json.dumps(config))
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match="shape"):
        tide.Engine(str(path), dtype="bfloat16", enable_memory_saver=True, max_total_tokens=4096)
    import gc

    from tide.memory.release import empty_device_cache

    gc.collect()
    empty_device_cache(reason="test_failed_start", ledger=None)
    free_after, _ = torch.cuda.mem_get_info()
    # The region would have been ~110 MB (4 layers of 3 x 512 x 8192 MLP weights and the rest).
    assert free_before - free_after < 32 << 20, (free_before, free_after)


def test_memory_saver_start_that_fails_after_the_load_gives_the_region_back(tmp_path):
    """A start that fails after the weights are in their region (here: no room for the KV cache)
    frees that region before the error reaches the caller, so a retry with other settings in the
    same process finds the memory."""
    from tide.memory.release import empty_device_cache

    path = build_checkpoint(tmp_path / "ckpt", "llama", hidden_size=512, intermediate_size=4096,
                            num_hidden_layers=4, max_position_embeddings=2048)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match="KV cache"):
        tide.Engine(str(path), dtype="bfloat16", enable_memory_saver=True,
                    mem_fraction_static=0.01)
    import gc

    gc.collect()
    empty_device_cache(reason="test_failed_start", ledger=None)
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after < 32 << 20, (free_before, free_after)  # the region is ~60 MB


def test_memory_saver_graph_release_runs_eager(gqa_checkpoint):
    """With `cuda_graph` released (alone, or after a staged resume of weights and kv_cache), decode
    runs eager and gives the same tokens; resuming it replays the same graphs again."""
    engine = tide.Engine(str(gqa_checkpoint), dtype="bfloat16", enable_memory_saver=True,
                         enable_cpu_backup=True, max_total_tokens=50_000, max_running_requests=16)
    runner = engine.model_runner
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompts = [list(range(3, 3 + n)) for n in (5, 40)]

    def run():
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

    before = run()
    graphs = dict(runner.cuda_graph_runner.graphs)
    assert engine.release_memory_occupation(["cuda_graph"])["success"]
    assert runner.cuda_graph_runner.bucket(2) is None
    assert run() == before
    assert engine.release_memory_occupation()["success"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    assert run() == before
    assert engine.resume_memory_occupation(["cuda_graph"])["success"]
    assert runner.cuda_graph_runner.bucket(2) == 2
    assert all(runner.cuda_graph_runner.graphs[bs] is g for bs, g in graphs.items())
    assert run() == before
