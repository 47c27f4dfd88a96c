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


@pytest.fixture(scope="module", params=[1, 4, 8], ids=lambda g: f"gqa{g}")
def gqa_checkpoint(request, tmp_path_factory):
    group = request.param
    path = tmp_path_factory.mktemp(f"gqa{group}")
    return build_checkpoint(
        path,
        "llama",
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
        pool, alloc = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        loc = alloc.alloc(len(next_ids))
        for i, slot in enumerate(self.slots):
            pool.write(slot, self.lens[i], loc[i : i + 1])
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
