"""Diffusion RL handover: denoiser weight updates (tensor, serialized, disk) that validate before
writing, `weight_version` on outputs, memory release/resume by tag, under every residency
strategy; and the same through the diffusion server's admin routes."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tide
from tide.diffusion.io_struct import MemoryReleasedError
from tide.weights import serialize_named_tensors

STRATEGIES = ("", "transformer=offload,text_encoder_2=offload",
              "transformer=layerwise,vae=offload")
ADMIN = "sk-admin"


class FakeDevice:
    def __init__(self):
        self.calls = 0

    def is_available(self):
        return True

    def empty_cache(self):
        self.calls += 1

    def memory_reserved(self):
        return 0

    def memory_allocated(self):
        return 0


def gen(engine, seed=0):
    out = engine.generate("a blue sky", seed=seed, num_inference_steps=2, height=32, width=32,
                          output_type="np")
    return out["images"][0], out["meta_info"]


def new_weights(engine, scale=1.5):
    """A deterministic change to a few denoiser tensors (in their exact dtype)."""
    params = dict(engine.pipeline.denoiser.named_parameters())
    names = ["x_embedder.weight", "transformer_blocks.0.attn.to_q.weight", "proj_out.weight"]
    return [(n, (params[n].detach().clone() * scale).contiguous()) for n in names]


@pytest.fixture(scope="module")
def reference():
    """Images before and after the update, from a resident engine."""
    engine = tide.DiffusionEngine("demo-diffusion")
    before, _ = gen(engine)
    update = new_weights(engine)
    assert engine.update_weights_from_tensor(update, weight_version="v1")["success"]
    after, meta = gen(engine)
    assert meta["weight_version"] == "v1" and not np.array_equal(before, after)
    return before, after, update


@pytest.mark.parametrize("residency, preferred", [(s, ()) for s in STRATEGIES] + [
    ("transformer=offload", ("transformer",))])
def test_tensor_update_lands_under_every_strategy(residency, preferred, reference):
    before, after, update = reference
    engine = tide.DiffusionEngine("demo-diffusion", component_residency=residency,
                                  preferred_resident=preferred)
    img, meta = gen(engine)
    assert np.array_equal(img, before) and meta["weight_version"] == "default"
    out = engine.update_weights_from_tensor(update, weight_version="v1")
    assert out["success"] and out["weight_version"] == "v1", out
    img, meta = gen(engine)
    assert np.array_equal(img, after) and meta["weight_version"] == "v1"
    img, _ = gen(engine)  # the host copy was written too: the next placement brings the new weights
    assert np.array_equal(img, after)
    # A placed (preferred) transformer was written on the device and in its host copy: after its
    # device copy is dropped and placed again, the update is still there.
    assert engine.release_memory_occupation(["weights"])["success"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    assert np.array_equal(gen(engine)[0], after)
    name, tensor = update[0]
    assert engine.get_weights_by_name(name, 5) == pytest.approx(tensor.reshape(-1)[:5].tolist())


def test_serialized_and_disk_updates_match_the_tensor_update(reference, tmp_path):
    _, after, update = reference
    engine = tide.DiffusionEngine("demo-diffusion", component_residency="transformer=offload")
    payload = serialize_named_tensors(update)
    assert engine.update_weights_from_tensor(serialized_named_tensors=payload)["success"]
    assert np.array_equal(gen(engine)[0], after)

    # Disk: a diffusers component directory holding the updated transformer, and the pipeline
    # directory above it; the engine starts from the old weights each time.
    fresh = tide.DiffusionEngine("demo-diffusion")
    assert fresh.update_weights_from_tensor(update)["success"]
    fresh.pipeline.denoiser.save_pretrained(str(tmp_path / "pipe" / "transformer"))
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    for path in (tmp_path / "pipe" / "transformer", tmp_path / "pipe"):
        engine = tide.DiffusionEngine("demo-diffusion", component_residency="transformer=layerwise")
        out = engine.update_weights_from_disk(str(path), weight_version="disk")
        assert out["success"], out
        img, meta = gen(engine)
        assert np.array_equal(img, after) and meta["weight_version"] == "disk"


def test_a_refused_update_changes_nothing(reference):
    before, _, update = reference
    engine = tide.DiffusionEngine("demo-diffusion", component_residency="transformer=offload")
    name, tensor = update[0]
    good = update[1]
    bad = [
        ([good, ("no.such.weight", tensor)], "'no.such.weight' is not a parameter of the transformer"),
        ([good, (name, tensor[:1])], f"weight '{name}' has shape"),
        ([good, (name, tensor.double())], "has dtype torch.float64"),
        ([good, good], "appears more than once"),
        ([], "names no weights"),
        ("not a list", "named_tensors must be a list"),
    ]
    for payload, message in bad:
        out = engine.update_weights_from_tensor(payload, weight_version="bad")
        assert out["success"] is False and message in out["message"], (out, message)
    assert not engine.update_weights_from_tensor(update, not_an_option=True)["success"]
    assert not engine.update_weights_from_tensor(serialized_named_tensors="garbage")["success"]
    img, meta = gen(engine)
    assert np.array_equal(img, before) and meta["weight_version"] == "default"
    missing = engine.update_weights_from_disk("/nonexistent/dir")
    assert not missing["success"] and "not a directory" in missing["message"]


@pytest.mark.parametrize("residency", STRATEGIES)
def test_release_and_resume_memory_by_tag(residency, reference):
    before, after, update = reference
    engine = tide.DiffusionEngine("demo-diffusion", component_residency=residency)
    fake = FakeDevice()
    engine.residency.device_module = fake
    assert np.array_equal(gen(engine)[0], before)
    calls = fake.calls
    out = engine.release_memory_occupation()
    assert out["success"] and out["released_tags"] == ["weights", "activations"]
    assert engine.residency.device_bytes() == 0
    assert fake.calls == calls + 1 and engine.memory_ledger.totals()["release_memory"]["count"] == 1
    with pytest.raises(MemoryReleasedError, match="resume_memory_occupation"):
        gen(engine)
    assert engine.release_memory_occupation(["weights"])["success"]  # again: a no-op
    assert fake.calls == calls + 1
    # An update while released writes the host copies; resume brings them to the device.
    assert engine.update_weights_from_tensor(update)["success"]
    assert engine.resume_memory_occupation(["activations"])["released_tags"] == ["weights"]
    with pytest.raises(MemoryReleasedError):
        gen(engine)
    assert engine.resume_memory_occupation(["weights"])["released_tags"] == []
    assert np.array_equal(gen(engine)[0], after)
    host = engine.residency.host_bytes()
    for _ in range(3):  # release cycles reuse the pinned host copies
        assert engine.release_memory_occupation(["weights"])["success"]
        assert engine.resume_memory_occupation()["success"]
    assert engine.residency.host_bytes() == host
    assert np.array_equal(gen(engine)[0], after)
    bad = engine.release_memory_occupation(["kv_cache"])
    assert not bad["success"] and "allowed tags: ['weights', 'activations']" in bad["message"]


# ---- HTTP


@pytest.fixture
def app_engine():
    from tide.diffusion.server import DiffusionServerArgs, create_app

    engine = tide.DiffusionEngine("demo-diffusion", component_residency="transformer=offload")
    return create_app(DiffusionServerArgs(admin_api_key=ADMIN), engine), engine


def run(app, scenario):
    import httpx

    async def main():
        await app.state.batcher.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as http:
                return await scenario(http)
        finally:
            await app.state.batcher.stop()

    return asyncio.run(main())


def admin(token=ADMIN):
    return {"Authorization": f"Bearer {token}"}


IMAGE = {"prompt": "a blue sky", "size": "32x32", "seed": 0, "num_inference_steps": 2}


def decode(b64):
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_admin_routes_update_release_and_resume(app_engine, reference):
    app, engine = app_engine
    _, after, update = reference
    want = (after * 255).round().astype(np.uint8)

    async def scenario(http):
        payload = serialize_named_tensors(update)
        body = {"serialized_named_tensors": payload, "weight_version": "rl-1"}
        r = await http.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 401  # the admin key is required
        r = await http.post("/update_weights_from_tensor", json=body, headers=admin("wrong"))
        assert r.status_code == 401
        r = await http.post("/update_weights_from_tensor", json=body, headers=admin())
        assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "rl-1"
        r = await http.post("/v1/images/generations", json=IMAGE)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["weight_version"] == "rl-1"
        assert np.array_equal(decode(r.json()["data"][0]["b64_json"]), want)

        r = await http.post("/update_weights_from_tensor", headers=admin(), json={
            "serialized_named_tensors": serialize_named_tensors([("nope", update[0][1])])})
        assert r.status_code == 400 and r.json()["success"] is False
        assert "'nope' is not a parameter" in r.json()["message"]
        r = await http.post("/release_memory_occupation", json={"tags": ["kv_cache"]},
                            headers=admin())
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags"

        r = await http.post("/release_memory_occupation", headers=admin())
        assert r.status_code == 200 and r.json()["released_tags"] == ["weights", "activations"]
        pending = asyncio.create_task(http.post("/v1/images/generations", json=IMAGE))
        await asyncio.sleep(0.5)
        assert not pending.done()  # held while memory is released
        r = await http.post("/resume_memory_occupation", json={"tags": None}, headers=admin())
        assert r.status_code == 200 and r.json()["released_tags"] == []
        r = await asyncio.wait_for(pending, 60)
        assert r.status_code == 200
        assert np.array_equal(decode(r.json()["data"][0]["b64_json"]), want)

        r = await http.post("/update_weight_version", json={"new_version": "rl-2"}, headers=admin())
        assert r.status_code == 200
        r = await http.get("/get_model_info")
        info = r.json()
        assert info["weight_version"] == "rl-2" and info["component_residency"]["transformer"] == \
            "offload"
        r = await http.get("/get_weights_by_name", params={"name": update[0][0],
                                                           "truncate_size": 3}, headers=admin())
        assert r.json() == pytest.approx(update[0][1].reshape(-1)[:3].tolist())
        r = await http.post("/update_weights_from_disk", json={"model_path": "/etc"},
                            headers=admin())
        assert r.status_code == 400 and r.json()["error"]["code"] == "path_not_allowed"
        r = await http.get("/dump_memory_timeline", headers=admin())
        kinds = [e.get("kind") for e in r.json()["events"] if e["type"] == "mark"]
        assert {"weight_update", "release", "resume"} <= set(kinds)
        metrics = (await http.get("/metrics")).text
        assert 'tide:image_stage_peak_memory_bytes_count{model_name="demo-diffusion",stage="denoising"}' \
            in metrics
        assert 'tide:component_placements_total{component="transformer",model_name="demo-diffusion",' \
            'strategy="offload"}' in metrics
        assert "tide:component_host_bytes" in metrics

    run(app, scenario)


def test_an_oom_is_a_500_naming_the_stage_and_the_server_goes_on(app_engine):
    app, engine = app_engine
    armed = {"on": True}

    def boom(*_):
        if armed["on"]:
            armed["on"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    engine.pipeline.denoiser.register_forward_pre_hook(boom)

    async def scenario(http):
        r = await http.post("/v1/images/generations", json=IMAGE)
        assert r.status_code == 500 and r.json()["error"]["code"] == "out_of_memory"
        assert "stage 'denoising'" in r.json()["error"]["message"]
        r = await http.post("/v1/images/generations", json=IMAGE)
        assert r.status_code == 200

    run(app, scenario)


def test_non_loopback_host_needs_an_admin_key():
    from tide.diffusion.server import DiffusionServerArgs

    with pytest.raises(ValueError, match="admin_api_key"):
        DiffusionServerArgs(host="0.0.0.0")
    DiffusionServerArgs(host="0.0.0.0", admin_api_key="k")
    DiffusionServerArgs(host="0.0.0.0", allow_unauthenticated_admin=True)
