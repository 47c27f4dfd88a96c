"""tide's FLUX and SDXL pipelines against diffusers' own pipelines on tiny random checkpoints (CPU,
fp32): same prompt and seed -> the same images within 1e-4 (max abs, output_type="np")."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from tide.diffusion.tiny import build_tiny_flux, build_tiny_sdxl

TOL = 1e-4
SIZE = dict(height=32, width=32)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion")
    return {
        "flux": build_tiny_flux(str(root / "flux")),
        "sdxl": build_tiny_sdxl(str(root / "sdxl")),
        "sdxl_no_zeros": build_tiny_sdxl(str(root / "sdxl_nz"), seed=1,
                                         force_zeros_for_empty_prompt=False),
    }


@pytest.fixture(scope="module")
def engines(model_dirs):
    import tide

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tide.DiffusionEngine(model_dirs[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def pipes(model_dirs):
    from diffusers import FluxPipeline, StableDiffusionXLPipeline

    cache = {}

    def get(name):
        if name not in cache:
            if name == "flux":
                pipe = FluxPipeline.from_pretrained(model_dirs[name])
            else:
                pipe = StableDiffusionXLPipeline.from_pretrained(model_dirs[name], add_watermarker=False)
            pipe.set_progress_bar_config(disable=True)
            cache[name] = pipe
        return cache[name]

    return get


def reference(pipe, seed, **kw):
    gen = ([torch.Generator("cpu").manual_seed(s) for s in seed] if isinstance(seed, list)
           else torch.Generator("cpu").manual_seed(seed))
    return pipe(generator=gen, output_type="np", **kw).images


def ours(engine, **kw):
    out = engine.generate(output_type="np", **kw)
    return np.stack(out["images"]), out["meta_info"]


def assert_close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.abs(a - b).max())
    assert err <= TOL, err


# ---- FLUX

def test_flux_single_prompt_matches_diffusers(engines, pipes):
    kw = dict(prompt="a photo of the cat", num_inference_steps=3, guidance_scale=3.5, **SIZE)
    img, meta = ours(engines("flux"), seed=7, **kw)
    ref = reference(pipes("flux"), 7, **kw)
    assert_close(img, ref)
    assert meta["seed"] == 7 and img.shape == (1, 32, 32, 3)
    assert set(meta["stage_timings_ms"]) == {"input_validation", "text_encoding",
                                             "timestep_preparation", "latent_preparation",
                                             "denoising", "decoding"}
    # The tolerance discriminates: another seed gives a visibly different image.
    other, _ = ours(engines("flux"), seed=8, **kw)
    assert np.abs(other - ref).max() > 0.1


def test_flux_batched_prompts_and_images_per_prompt(engines, pipes):
    kw = dict(prompt=["the red sky", "a dog in the tree"], num_inference_steps=2, guidance_scale=2.0,
              num_images_per_prompt=2, height=48, width=32)
    img, _ = ours(engines("flux"), seed=3, **kw)
    assert_close(img, reference(pipes("flux"), 3, **kw))
    assert np.abs(img[0] - img[1]).max() > 0.05  # the two images of one prompt differ


def test_flux_seed_per_image_matches_generator_list(engines, pipes):
    kw = dict(prompt=["the cat", "the dog"], num_inference_steps=2, **SIZE)
    img, meta = ours(engines("flux"), seed=[11, 12], **kw)
    assert_close(img, reference(pipes("flux"), [11, 12], guidance_scale=3.5, **kw))
    assert meta["seed"] == [11, 12]


def test_flux_true_cfg_with_negative_prompt(engines, pipes):
    kw = dict(prompt=["a blue tree", "the cat"], negative_prompt=["red", "a dog"],
              true_cfg_scale=4.0, num_inference_steps=2, guidance_scale=3.5, **SIZE)
    img, _ = ours(engines("flux"), seed=5, **kw)
    assert_close(img, reference(pipes("flux"), 5, **kw))
    plain, _ = ours(engines("flux"), seed=5, prompt=kw["prompt"], num_inference_steps=2, **SIZE)
    assert np.abs(plain - img).max() > 0.05  # the negative prompt changed the images


def test_flux_negative_prompt_rules(engines):
    engine = engines("flux")
    with pytest.raises(ValueError, match="negative_prompt.*true_cfg_scale"):
        engine.generate("the cat", negative_prompt="dog", num_inference_steps=1, **SIZE)
    with pytest.raises(ValueError, match="true_cfg_scale > 1 needs a negative_prompt"):
        engine.generate("the cat", true_cfg_scale=3.0, num_inference_steps=1, **SIZE)


# ---- SDXL

def test_sdxl_single_prompt_matches_diffusers(engines, pipes):
    kw = dict(prompt="a photo of the cat", num_inference_steps=3, guidance_scale=5.0, **SIZE)
    img, _ = ours(engines("sdxl"), seed=0, **kw)
    ref = reference(pipes("sdxl"), 0, **kw)
    assert_close(img, ref)
    other, _ = ours(engines("sdxl"), seed=1, **kw)
    assert np.abs(other - ref).max() > 0.1


def test_sdxl_batched_with_negative_prompts(engines, pipes):
    kw = dict(prompt=["the red sky", "a dog"], negative_prompt=["blue", "the cat"],
              num_images_per_prompt=2, num_inference_steps=2, guidance_scale=6.0, height=32,
              width=48)
    img, _ = ours(engines("sdxl"), seed=21, **kw)
    assert_close(img, reference(pipes("sdxl"), 21, **kw))
    zero_neg, _ = ours(engines("sdxl"), seed=21, **{k: v for k, v in kw.items()
                                                     if k != "negative_prompt"})
    assert np.abs(zero_neg - img).max() > 0.05


def test_sdxl_without_force_zeros_encodes_empty_negative(engines, pipes):
    kw = dict(prompt=["the cat", "the dog"], num_inference_steps=2, guidance_scale=5.0, **SIZE)
    img, _ = ours(engines("sdxl_no_zeros"), seed=4, **kw)
    assert_close(img, reference(pipes("sdxl_no_zeros"), 4, **kw))


def test_sdxl_without_guidance_and_per_image_seeds(engines, pipes):
    kw = dict(prompt="the cat", num_images_per_prompt=2, num_inference_steps=2, guidance_scale=1.0,
              **SIZE)
    img, _ = ours(engines("sdxl"), seed=[1, 2], **kw)
    assert_close(img, reference(pipes("sdxl"), [1, 2], **kw))
    with pytest.raises(ValueError, match="negative_prompt needs classifier-free guidance"):
        engines("sdxl").generate("the cat", negative_prompt="x", guidance_scale=1.0, **SIZE)
    with pytest.raises(ValueError, match="true_cfg_scale applies to FLUX only"):
        engines("sdxl").generate("the cat", true_cfg_scale=2.0, **SIZE)


# ---- batching across requests

@pytest.mark.parametrize("name", ["flux", "sdxl"])
def test_requests_batched_together_equal_each_alone(engines, pipes, name):
    """Requests sharing size, steps and guidance run as one batch; each request's images equal its
    own run (and diffusers'), whatever else is in the batch."""
    engine = engines(name)
    common = dict(height=32, width=32, num_inference_steps=2)
    reqs = [engine.make_request("the cat", seed=1, output_type="np", **common),
            engine.make_request(["a dog", "the sky"], seed=2, num_images_per_prompt=2,
                                output_type="np", **common),
            engine.make_request("a red tree", seed=[3], output_type="np", **common)]
    if name == "sdxl":
        reqs.append(engine.make_request("the cat", negative_prompt="blue", seed=4,
                                        output_type="np", **common))
    results = engine.run_batch(reqs)
    assert [r.meta_info["batch_num_images"] for r in results] == [len(reqs) + 3] * len(reqs)
    for req, res in zip(reqs, results):
        alone = engine.run_batch([req])[0]
        assert_close(np.stack(res.images), np.stack(alone.images))
        kw = dict(prompt=list(req.prompts), num_images_per_prompt=req.num_images_per_prompt,
                  guidance_scale=req.guidance_scale, **common)
        if req.negative_prompts:
            kw["negative_prompt"] = list(req.negative_prompts)
        assert_close(np.stack(res.images), reference(pipes(name), req.seeds[0], **kw))


def test_incompatible_requests_are_refused_as_one_batch(engines):
    engine = engines("flux")
    a = engine.make_request("the cat", seed=1, height=32, width=32, num_inference_steps=2)
    b = engine.make_request("the cat", seed=1, height=48, width=32, num_inference_steps=2)
    with pytest.raises(ValueError, match="share size"):
        engine.run_batch([a, b])


# ---- loading

def test_pil_output_rounds_like_diffusers(engines, pipes):
    kw = dict(prompt="the cat", num_inference_steps=2, **SIZE)
    out = engines("flux").generate(seed=9, **kw)
    ref = pipes("flux")(generator=torch.Generator("cpu").manual_seed(9), output_type="pil",
                        **kw).images
    assert np.array_equal(np.asarray(out["images"][0]), np.asarray(ref[0]))


def test_kind_comes_from_model_index_not_the_name(model_dirs, tmp_path):
    import tide

    misleading = tmp_path / "FLUX.1-dev"
    shutil.copytree(model_dirs["sdxl"], misleading)
    assert tide.DiffusionEngine(str(misleading)).kind == "sdxl"
    index_path = misleading / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "StableDiffusion3Pipeline"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="unsupported diffusion pipeline 'StableDiffusion3Pipeline'"):
        tide.DiffusionEngine(str(misleading))
    index["_class_name"] = "StableDiffusionXLPipeline"
    index["scheduler"] = ["diffusers", "DDPMScheduler"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="component 'scheduler' has class 'DDPMScheduler'"):
        tide.DiffusionEngine(str(misleading))
    del index["unet"]
    index["scheduler"] = ["diffusers", "EulerDiscreteScheduler"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="component 'unet' is missing"):
        tide.DiffusionEngine(str(misleading))


def test_dummy_load_reads_no_weights_and_is_seeded(model_dirs, tmp_path):
    import tide

    configs_only = tmp_path / "flux-configs"
    shutil.copytree(model_dirs["flux"], configs_only)
    for root, _, files in os.walk(configs_only):
        for f in files:
            if f.endswith(".safetensors"):
                os.remove(os.path.join(root, f))
    with pytest.raises(ValueError, match="cannot load safetensors weights"):
        tide.DiffusionEngine(str(configs_only))
    kw = dict(prompt="the cat", seed=0, num_inference_steps=2, output_type="np", **SIZE)
    a = tide.DiffusionEngine(str(configs_only), load_format="dummy", seed=1).generate(**kw)
    b = tide.DiffusionEngine(str(configs_only), load_format="dummy", seed=1).generate(**kw)
    c = tide.DiffusionEngine(str(configs_only), load_format="dummy", seed=2).generate(**kw)
    assert np.array_equal(a["images"][0], b["images"][0])
    assert not np.array_equal(a["images"][0], c["images"][0])
