"""`tide.DiffusionEngine`: the built-in demo model, request validation, config, lazy import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("diffusers")

import tide
from tide.diffusion import DiffusionConfig


@pytest.fixture(scope="module")
def demo():
    return tide.DiffusionEngine("demo-diffusion")


def test_demo_model_is_deterministic_per_seed(demo):
    assert demo.kind == "flux" and demo.default_size == 64
    a = demo.generate("a red fox in the snow", seed=0, num_inference_steps=4)
    b = tide.DiffusionEngine().generate("a red fox in the snow", seed=0, num_inference_steps=4)
    c = demo.generate("a red fox in the snow", seed=1, num_inference_steps=4)
    img_a, img_b, img_c = (np.asarray(x["images"][0]) for x in (a, b, c))
    assert img_a.shape == (64, 64, 3) and img_a.dtype == np.uint8
    assert np.array_equal(img_a, img_b)
    assert np.abs(img_a.astype(int) - img_c.astype(int)).max() > 50
    assert img_a.std() > 10  # not a flat image


def test_meta_info_and_random_seed_replay(demo):
    out = demo.generate(["the sky", "a tree"], num_images_per_prompt=2, num_inference_steps=2,
                        output_type="np", height=32, width=48)
    meta = out["meta_info"]
    assert len(out["images"]) == 4 and out["images"][0].shape == (32, 48, 3)
    assert isinstance(meta["seed"], int)
    assert meta["num_images"] == 4 and meta["batch_num_images"] == 4
    assert meta["guidance_scale"] == 3.5 and meta["num_inference_steps"] == 2
    assert all(v >= 0 for v in meta["stage_timings_ms"].values())
    again = demo.generate(["the sky", "a tree"], num_images_per_prompt=2, num_inference_steps=2,
                          output_type="np", height=32, width=48, seed=meta["seed"])
    assert all(np.array_equal(x, y) for x, y in zip(out["images"], again["images"]))


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt.1"),
    ({"prompt": 3}, "prompt"),
    ({"height": 40}, "height"),
    ({"width": 4096}, "width"),
    ({"height": 0}, "height"),
    ({"width": 32.0}, "width"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 10_000}, "num_inference_steps"),
    ({"num_images_per_prompt": 0}, "num_images_per_prompt"),
    ({"num_images_per_prompt": 17}, "num_images_per_prompt"),
    ({"guidance_scale": float("nan")}, "guidance_scale"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"seed": -1}, "seed"),
    ({"seed": [1, 2, 3]}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"output_type": "latent"}, "output_type"),
    ({"negative_prompt": ["a", "b"], "true_cfg_scale": 2.0}, "negative_prompt"),
    ({"prompt": "a \ud800 b"}, "prompt"),  # a lone surrogate (JSON can carry one)
    ({"prompt": ["ok", "\udc00"]}, "prompt.1"),
])
def test_bad_requests_name_the_field(demo, kwargs, field):
    args = {"prompt": "the cat", "num_inference_steps": 1, **kwargs}
    with pytest.raises(ValueError) as e:
        demo.generate(**args)
    assert str(e.value).startswith(field), str(e.value)


def test_bad_request_leaves_engine_working(demo):
    with pytest.raises(ValueError):
        demo.generate("the cat", height=33)
    assert len(demo.generate("the cat", num_inference_steps=1, seed=0)["images"]) == 1


def test_config_is_frozen_and_validated(tmp_path):
    with pytest.raises(ValueError, match=r"unknown diffusion engine option\(s\) \['stepz'\]"):
        tide.DiffusionEngine("demo-diffusion", stepz=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        DiffusionConfig.from_kwargs(dtype="float8")
    with pytest.raises(ValueError, match="max_sequence_length must be at most 512"):
        DiffusionConfig.from_kwargs(max_sequence_length=1024)
    with pytest.raises(ValueError, match="model_path must be a diffusers-format directory"):
        DiffusionConfig.from_kwargs(model_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no model_index.json"):
        tide.DiffusionEngine(str(tmp_path))
    with pytest.raises(ValueError, match="default_size must be a multiple of 16"):
        tide.DiffusionEngine("demo-diffusion", default_size=40)
    # a default no request could use: every request without a size would fail
    with pytest.raises(ValueError, match="default_size 64 is above max_image_side 32"):
        tide.DiffusionEngine("demo-diffusion", max_image_side=32)
    with pytest.raises(ValueError, match="default_size 4096 is above max_image_side 2048"):
        tide.DiffusionEngine("demo-diffusion", default_size=4096)
    with pytest.raises(ValueError, match="weight_version must be at most 256 printable"):
        DiffusionConfig.from_kwargs(weight_version="v\n1")
    cfg = DiffusionConfig.from_kwargs()
    assert cfg.default_size == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3


def test_tide_imports_without_diffusers():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'diffusers' or name.startswith('diffusers.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tide, tide.diffusion\n"
        "assert tide.diffusion.is_diffusion_model('demo-diffusion')\n"
        "try:\n"
        "    tide.DiffusionEngine\n"
        "except ImportError as e:\n"
        "    print('hint:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'tide[diffusion]'" in out.stdout


def test_weight_version_rules_and_shutdown():
    """update_weight_version takes what updates take (1 to 256 printable characters); after
    shutdown every call says the engine is shut down."""
    engine = tide.DiffusionEngine("demo-diffusion")
    for bad in ("", "a\nb", "x" * 257):
        assert engine.update_weight_version(bad)["success"] is False
    assert engine.update_weight_version("step-3")["success"]
    engine.shutdown()
    for call in (lambda: engine.generate("the cat", num_inference_steps=1),
                 lambda: engine.release_memory_occupation(),
                 lambda: engine.update_weight_version("v2")):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
