"""Component residency on a CUDA GPU (marker `gpu`): pinned host copies, side-stream copies, real
allocator release points, a real out-of-memory error, and memory that stays flat."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import tide  # noqa: E402

MI = ("text_encoder_2", "transformer")
OFFLOAD_ALL = "text_encoder=offload,text_encoder_2=offload,transformer=offload,vae=offload"


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    from tide.diffusion.tiny import build_tiny_flux

    return build_tiny_flux(str(tmp_path_factory.mktemp("flux7") / "m"), seed=1, layers=3,
                           single_layers=4)


def gen(engine, seed=0, size=64):
    out = engine.generate("a red fox", seed=seed, num_inference_steps=3, height=size, width=size,
                          output_type="np")
    return out["images"][0], out["meta_info"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_strategy_gives_the_same_image_on_cuda(flux_dir, dtype):
    ref, _ = gen(tide.DiffusionEngine(flux_dir, device="cuda", dtype=dtype))
    for kw in ({"component_residency": OFFLOAD_ALL},
               {"component_residency": "transformer=layerwise,text_encoder_2=layerwise"},
               {"component_residency": "transformer=layerwise", "layerwise_blocks": 1},
               {"component_residency": OFFLOAD_ALL, "preferred_resident": ("transformer",)}):
        engine = tide.DiffusionEngine(flux_dir, device="cuda", dtype=dtype, **kw)
        for comp in engine.residency.components.values():
            for g in comp.groups():  # host copies are page-locked: the copies are asynchronous
                assert g.host.pinned and g.host.flat.is_pinned()
        for _ in range(2):
            img, _ = gen(engine)
            assert np.array_equal(img, ref), kw


def test_release_points_and_flat_memory_on_cuda(flux_dir):
    for residency, per_request in (("", []), (OFFLOAD_ALL, ["component_offload"] * 2),
                                   ("transformer=layerwise,text_encoder_2=offload",
                                    ["component_offload", "layerwise_pass"])):
        engine = tide.DiffusionEngine(flux_dir, device="cuda", memory_intensive=MI,
                                      component_residency=residency)
        reserved = []
        for i in range(50):
            gen(engine, seed=i, size=32)
            reserved.append(torch.cuda.memory_reserved())
        events = engine.memory_ledger.events
        assert [e.reason for e in events] == per_request * 50, residency
        assert all(e.stall_s >= 0 for e in events)
        assert abs(reserved[-1] - reserved[1]) <= 0.01 * reserved[1], (residency, reserved[1],
                                                                       reserved[-1])
        engine.shutdown()


def test_layerwise_lowers_the_denoising_peak(flux_dir):
    peaks = {}
    for residency in ("", "transformer=layerwise"):
        engine = tide.DiffusionEngine(flux_dir, device="cuda", component_residency=residency)
        _, meta = gen(engine)
        assert meta["memory_source"] == "cuda_allocator"
        peaks[residency] = meta["stage_memory"]["denoising"]["peak_bytes"]
        engine.shutdown()
    assert peaks["transformer=layerwise"] < peaks[""]


def test_a_real_out_of_memory_error_fails_one_request(flux_dir):
    from tide.diffusion.io_struct import DiffusionOutOfMemoryError

    engine = tide.DiffusionEngine(flux_dir, device="cuda", component_residency=OFFLOAD_ALL,
                                  memory_intensive=MI)
    ref, _ = gen(engine)
    armed = {"on": True}

    def hog(*_):
        if armed["on"]:
            armed["on"] = False
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB

    handle = engine.pipeline.denoiser.register_forward_pre_hook(hog)
    with pytest.raises(DiffusionOutOfMemoryError, match="stage 'denoising'"):
        gen(engine)
    handle.remove()
    assert engine.memory_ledger.totals()["oom"]["count"] == 1
    assert engine.residency.device_bytes() == 0
    img, _ = gen(engine)
    assert np.array_equal(img, ref)


def test_release_and_resume_give_the_memory_back(flux_dir):
    engine = tide.DiffusionEngine(flux_dir, device="cuda")
    ref, _ = gen(engine)
    weights = sum(i.num_bytes for i in engine.pipeline.component_infos)
    before = torch.cuda.memory_allocated()
    assert engine.release_memory_occupation()["success"]
    assert before - torch.cuda.memory_allocated() >= weights
    assert engine.memory_ledger.totals()["release_memory"]["count"] == 1
    assert engine.resume_memory_occupation()["success"]
    img, _ = gen(engine)
    assert np.array_equal(img, ref)
