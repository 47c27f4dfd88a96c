"""Parameters made in planned storage (`tide.memory.placement`, the memory saver's weights region).

A model built under `placed` has every parameter in its home, in module order with derived
parameters last, tied weights sharing one home, markers kept, and the same values and tokens as a
model built the ordinary way; a layout that does not match the build is refused; parameters made on
other threads meanwhile are left alone.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tide.layers import fp8
from tide.memory.placement import module_order, placed, plan_layout
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.weights import load_checkpoint
from torch import nn


def _homes(shapes) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat byte buffer with each planned tensor after the last (16-byte aligned)."""
    sizes = []
    at = 0
    for shape, dtype in shapes:
        at = -(-at // 16) * 16
        numel = 1
        for d in shape:
            numel *= d
        sizes.append((at, numel * dtype.itemsize))
        at += numel * dtype.itemsize
    flat = torch.zeros(at, dtype=torch.uint8)
    homes = [flat[o:o + n].view(dtype).view(shape) for (o, n), (shape, dtype) in zip(sizes, shapes)]
    return flat, homes


def _builder(config: ModelConfig | Path, quantize: bool):
    """Builds the model of `config` (or of the checkpoint directory it names), with fp8 copies."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_dir(str(config))
    cls = get_model_class(config.architecture)

    def build() -> nn.Module:
        model = cls(config)
        if quantize:
            fp8.quantize_model(model)
        return model

    return build


def _within(t: torch.Tensor, flat: torch.Tensor) -> bool:
    return flat.data_ptr() <= t.data_ptr() < flat.data_ptr() + flat.numel()


@pytest.mark.parametrize("arch,quantize", [("qwen3", False), ("llama", True)])
def test_a_model_built_in_place_lives_in_its_homes_with_the_same_weights(checkpoints, arch,
                                                                          quantize):
    path = checkpoints[arch]
    build = _builder(path, quantize)
    layout = plan_layout(build)
    flat, homes = _homes(layout.shapes)
    with placed(layout, homes) as placement:
        model = _builder(path, False)()
        load_checkpoint(model, str(path))
        if quantize:
            fp8.quantize_model(model)
        placement.finish(model)
    assert placement.count == len(layout.slot_of_registration) > 0
    ordered = module_order(model)
    assert [p.data_ptr() for p in ordered] == [h.data_ptr() for h in homes]
    assert all(_within(p, flat) for p in model.parameters())
    derived = [bool(getattr(p, "derived", False)) for p in ordered]
    assert derived == sorted(derived) and any(derived) == quantize  # derived ones last
    # The same values as the ordinary build.
    plain = _builder(path, False)()
    load_checkpoint(plain, str(path))
    if quantize:
        fp8.quantize_model(plain)
    placed_state = dict(model.named_parameters(remove_duplicate=False))
    for name, p in plain.named_parameters(remove_duplicate=False):
        assert torch.equal(placed_state[name].view(torch.uint8), p.view(torch.uint8)), name
    if arch == "qwen3":  # tied embeddings: one home for both names
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_markers_set_before_registration_are_kept():
    """A Gemma-style norm marks its weight (`dummy_value`) and fp8 copies are marked `derived`;
    both markers survive the move into the home."""

    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = nn.Parameter(torch.zeros(8), requires_grad=False)
            w.dummy_value = 0.0
            self.weight = w
            self.other = nn.Parameter(torch.ones(4, 4), requires_grad=False)
            self.other.derived = True

    layout = plan_layout(Marked)
    flat, homes = _homes(layout.shapes)
    with placed(layout, homes) as placement:
        m = Marked()
        placement.finish(m)
    assert m.weight.dummy_value == 0.0 and m.other.derived is True
    assert _within(m.weight, flat) and _within(m.other, flat)
    assert m.other.data_ptr() > m.weight.data_ptr()  # derived after
    assert torch.equal(m.other, torch.ones(4, 4)) and not m.weight.requires_grad


def test_a_build_that_differs_from_the_plan_is_refused():
    layout = plan_layout(lambda: nn.Linear(8, 4, bias=False))
    _, homes = _homes(layout.shapes)
    with pytest.raises(RuntimeError, match="planned"):
        with placed(layout, homes):
            nn.Linear(8, 5, bias=False)
    with pytest.raises(RuntimeError, match="not planned"):
        with placed(layout, homes):
            nn.Linear(8, 4, bias=True)


def test_replaced_and_unregistered_parameters_end_in_their_homes():
    """A parameter construction replaces gets no home; one put in `_parameters` directly (no
    registration hook) is moved by `finish`."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3,), 1.0))
            self.w = nn.Parameter(torch.full((5,), 2.0))  # replaces the first
            self._parameters["raw"] = nn.Parameter(torch.full((2, 2), 3.0))

    layout = plan_layout(Odd)
    assert layout.slot_of_registration[0] == -1 and len(layout.shapes) == 2
    flat, homes = _homes(layout.shapes)
    with placed(layout, homes) as placement:
        m = Odd()
    placement.finish(m)
    assert torch.equal(m.w, torch.full((5,), 2.0)) and torch.equal(m.raw, torch.full((2, 2), 3.0))
    assert _within(m.w, flat) and _within(m.raw, flat)


def test_parameters_made_on_other_threads_are_left_alone():
    layout = plan_layout(lambda: nn.Linear(8, 4, bias=False))
    flat, homes = _homes(layout.shapes)
    made: list[nn.Module] = []
    with placed(layout, homes) as placement:
        worker = threading.Thread(target=lambda: made.append(nn.Linear(16, 16)))
        worker.start()
        worker.join()
        lin = nn.Linear(8, 4, bias=False)
    placement.finish(lin)
    assert _within(lin.weight, flat)
    assert not any(_within(p, flat) for p in made[0].parameters())


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen3-0.6b", "gemma-2-9b", "gemma-3-12b"])
@pytest.mark.parametrize("quantize", [False, True])
def test_every_architecture_builds_in_place(shape, quantize):
    """The benchmark shapes' architectures (shrunk): the meta plan matches the real build, every
    registration is planned, and every parameter ends in its home."""
    from benchmarks.shapes import SHAPES

    hf = dict(SHAPES[shape], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
              max_position_embeddings=256)
    build = _builder(ModelConfig.from_hf_dict(hf), quantize)
    layout = plan_layout(build)
    flat, homes = _homes(layout.shapes)
    with placed(layout, homes) as placement:
        model = build()
    # The hook placed every parameter itself (`finish` has nothing to move).
    assert all(_within(p, flat) for p in model.parameters())
    placement.finish(model)
    assert placement.count == len(layout.slot_of_registration)
    assert [p.data_ptr() for p in module_order(model)] == [h.data_ptr() for h in homes]
    assert any(getattr(p, "derived", False) for p in model.parameters()) == quantize


def test_a_parameter_in_another_ones_home_is_refused():
    """A real build that registers same-shaped parameters in another order than planned would put
    one in the other's home: `finish` refuses instead of copying over it."""

    class Holder(nn.Module):
        pass

    class Two(nn.Module):
        def __init__(self, flip: bool) -> None:
            super().__init__()
            self.c1, self.c2 = Holder(), Holder()  # module order: c1.w, then c2.w
            first, second = (self.c2, self.c1) if flip else (self.c1, self.c2)
            first.w = nn.Parameter(torch.full((4,), 1.0))
            second.w = nn.Parameter(torch.full((4,), 2.0))

    layout = plan_layout(lambda: Two(flip=False))
    _, homes = _homes(layout.shapes)
    with placed(layout, homes) as placement:
        model = Two(flip=True)
    with pytest.raises(RuntimeError, match="in the home of parameter"):
        placement.finish(model)


def test_one_build_at_a_time_on_a_thread():
    layout = plan_layout(lambda: nn.Linear(8, 4, bias=False))
    _, homes = _homes(layout.shapes)
    with placed(layout, homes):
        with pytest.raises(RuntimeError, match="already being placed"):
            with placed(layout, homes):
                pass
    with placed(layout, homes) as placement:  # the first one closed cleanly
        lin = nn.Linear(8, 4, bias=False)
    placement.finish(lin)
    assert lin.weight.data_ptr() == homes[0].data_ptr()

