"""Data parallel on a GPU host (marker `gpu`, at least two GPUs): `tide serve --dp-size 2` puts each
replica on its own GPU, and `RayEngine` places each replica on its own GPU; both serve, take a
weight update on every replica, and survive the death of one replica."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tide.weights import serialize_named_tensors

from server_utils import running_server, serve_model_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = ["The for statement", "A class definition", "Exceptions are", "The import system"]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
NAME = "model.layers.0.self_attn.q_proj.weight"


def test_dp_server_puts_each_replica_on_its_own_gpu(tmp_path):
    model = serve_model_path(tmp_path)
    with running_server(model, "--dp-size", "2", "--device", "cuda", "--dtype", "float32",
                        log_dir=tmp_path,
                        env={"OMP_NUM_THREADS": "4"}) as srv:
        info = srv.get("/get_server_info").json()
        replicas = info["replicas"]
        assert [r["device"] for r in replicas] == ["cuda", "cuda"]
        assert len({r["cuda_visible_devices"] for r in replicas}) == 2
        out = srv.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
        assert all(len(o["output_ids"]) == 16 for o in out)
        served = [r["requests_served"] for r in srv.get("/get_server_info").json()["replicas"]]
        assert served == [2, 2]
        checkpoint = load_file(str(next(Path(model).glob("*.safetensors"))))
        new = (checkpoint[NAME].float() * 0.5).contiguous()
        resp = srv.post("/update_weights_from_tensor", {
            "serialized_named_tensors": serialize_named_tensors([(NAME, new)]),
            "weight_version": "gpu-v1"})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        after = srv.get("/get_server_info").json()["replicas"]
        assert [r["weight_version"] for r in after] == ["gpu-v1", "gpu-v1"]
        os.kill(after[1]["pid"], signal.SIGKILL)
        # Requests routed before the controller sees the death fail cleanly (CPU tests cover
        # that); once it is reported, every request goes to the live replica.
        deadline = time.monotonic() + 30
        while srv.get("/get_server_info").json()["num_replicas_alive"] != 1:
            assert time.monotonic() < deadline, "the dead replica was never reported"
            time.sleep(0.1)
        out = srv.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
        assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length"] * 4
        assert srv.get("/get_server_info").json()["num_replicas_alive"] == 1


def test_ray_engine_places_each_replica_on_its_own_gpu():
    ray = pytest.importorskip("ray")
    from tide.cluster.ray import RayEngine

    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False)
    try:
        engine = RayEngine(num_replicas=2)
        try:
            info = engine.get_server_info()
            assert info["device"].startswith("cuda")
            visible = [r["cuda_visible_devices"] for r in info["replicas"]]
            assert len(set(visible)) == 2 and all(visible), visible
            out = engine.generate(PROMPTS, GREEDY)
            assert all(len(o["output_ids"]) == 16 for o in out)
            assert [r["requests_served"] for r in engine.router.describe()] == [2, 2]
            assert engine.pause_generation("in_place")["success"]
            assert engine.update_weight_version("gpu-v2")["success"]
            assert engine.continue_generation()["success"]
            assert engine.weight_version == "gpu-v2"
        finally:
            engine.shutdown()
    finally:
        ray.shutdown()
