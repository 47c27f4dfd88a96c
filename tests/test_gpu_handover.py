"""GPU checks of the handover's fast paths (marker `gpu`, run on a GPU host):

- release/resume of every tag with `enable_cpu_backup`: one pinned (registered) host buffer reused
  across cycles, greedy tokens equal before and after every cycle, and an update between cycles is
  what the next resume brings back;
- `update_weights_from_distributed` over NCCL between two GPUs (skipped with fewer): the group is
  warmed at init, and per-tensor and flattened updates in small pieces land bit-exact.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

import tide
from conftest import build_checkpoint, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("handover_gpu"), "llama", hidden_size=512,
                            intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=2048)


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_release_all_reuses_one_pinned_backup_and_keeps_tokens(checkpoint):
    engine = tide.Engine(str(checkpoint), dtype="bfloat16", enable_memory_saver=True,
                         enable_cpu_backup=True, max_total_tokens=100_000)
    backup = engine.worker.memory_occupation.backup
    before = _greedy(engine)
    host_ptr = None
    for _ in range(3):
        assert engine.release_memory_occupation()["success"]
        assert backup.valid and backup.buffer.tensor.is_pinned()
        host_ptr = host_ptr or backup.buffer.tensor.data_ptr()
        assert backup.buffer.tensor.data_ptr() == host_ptr
        assert engine.resume_memory_occupation()["success"]
        assert _greedy(engine) == before
    assert backup.allocations == 1
    # An update between cycles is what the next resume brings back (no stale backup).
    name = "model.layers.0.mlp.down_proj.weight"
    param = dict(engine.model_runner.model.named_parameters())[name]
    new = (param.detach().float() * 0.5).to(torch.bfloat16).cpu()
    assert engine.update_weights_from_tensor(named_tensors=[(name, new)])["success"]
    updated = _greedy(engine)
    assert engine.release_memory_occupation()["success"]
    assert engine.resume_memory_occupation()["success"]
    assert torch.equal(param.detach().cpu(), new)
    assert _greedy(engine) == updated
    assert backup.allocations == 1
    engine.shutdown()
    assert backup.host_bytes == 0


def _module_order(checkpoint) -> list[str]:
    """The checkpoint's tensor names in the order of the HF model's `named_parameters()`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    return [n for n, _ in model.named_parameters()]


def _trainer(port: int, checkpoint: str, commands, replies, order: list[str]) -> None:
    from safetensors.torch import load_file

    from tide.weights import init_custom_process_group

    torch.cuda.set_device(0)
    group = init_custom_process_group("nccl", "127.0.0.1", port, 0, 2, "wu", timeout_s=120,
                                      bucket_bytes=1 << 20, coalesce_tensors=5)
    tensors = load_file(f"{checkpoint}/model.safetensors")
    named = [(n, (tensors[n].to(torch.bfloat16) * 0.5).cuda()) for n in order]
    replies.put("joined")
    while (fmt := commands.get()) is not None:
        group.broadcast_weights(named, None if fmt == "per_tensor" else fmt)
        torch.cuda.synchronize()
        replies.put("sent")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("memory_saver", [False, True], ids=["copied", "in_place"])
def test_nccl_update_is_warm_at_init_and_exact_in_pieces(checkpoint, memory_saver, monkeypatch):
    """Per-tensor and flattened updates in 1 MiB pieces land bit-exact. With the memory saver the
    parameters are one region in module order, and the trainer sends in module order: every
    flattened piece is received in place."""
    from safetensors.torch import load_file

    from tide.weights import receive

    runs: list = []
    real = receive._one_run
    monkeypatch.setattr(receive, "_one_run", lambda *a: runs.append(real(*a)) or runs[-1])
    order = _module_order(checkpoint)
    ctx = multiprocessing.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_trainer, args=(port, str(checkpoint), commands, replies, order))
    proc.start()
    try:
        engine = tide.Engine(str(checkpoint), dtype="bfloat16", device="cuda:1",
                             max_total_tokens=20_000, disable_cuda_graph=True,
                             enable_memory_saver=memory_saver)
        joined = engine.init_weights_update_group("127.0.0.1", port, 1, 2, "wu", "nccl")
        assert joined["success"], joined["message"]
        assert replies.get(timeout=120) == "joined"
        assert engine.worker.weight_updater.groups["wu"].bucket_bytes == 1 << 20
        # Per-tensor updates travel in NCCL groups of 5 tensors on both sides.
        assert engine.worker.weight_updater.groups["wu"].coalesce_tensors == 5
        tensors = load_file(f"{checkpoint}/model.safetensors")
        named = [(n, tensors[n].to(torch.bfloat16) * 0.5) for n in order]
        for fmt in ("per_tensor", "flattened_bucket"):
            commands.put(fmt)
            res = engine.update_weights_from_distributed(
                [n for n, _ in named], ["bfloat16"] * len(named), [list(t.shape) for _, t in named],
                group_name="wu", load_format=None if fmt == "per_tensor" else fmt)
            assert res["success"], res["message"]
            assert replies.get(timeout=120) == "sent"
            for name, t in named:
                if engine.worker.weight_updater.weight_map.resolve(name) is None:
                    continue  # not stored by tide (a tied lm_head)
                got = torch.tensor(engine.get_weights_by_name(name, truncate_size=t.numel()))
                assert torch.equal(got.to(torch.bfloat16), t.reshape(-1)), (fmt, name)
        # Without the memory saver the parameters are separate allocations: the pieces that
        # straddle two are copied, the two that lie inside one fused gate_up land in place (on
        # CPU with gloo the same model gives the same split).
        in_place = [r is not None for r in runs]
        assert len(in_place) == 10 and sum(in_place) == (10 if memory_saver else 2), in_place
        engine.shutdown()
    finally:
        commands.put(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
