"""`tide serve` on a GPU (marker `gpu`): the scheduler process drives CUDA (graphs included) while the
HTTP process stays CPU-only; greedy outputs match the in-process Engine; clean shutdown."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
import torch
from server_utils import ServerProcess, serve_model_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["The for statement", "A class definition", "Exceptions are", "The import system"]


def test_gpu_server_matches_engine_and_shuts_down(tmp_path):
    import tide

    model = serve_model_path(tmp_path)
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    engine = tide.Engine(str(model), device="cuda", max_total_tokens=16384)
    ref = [r["output_ids"] for r in engine.generate(prompt=PROMPTS, sampling_params=params)]
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()

    srv = ServerProcess(model, "--device", "cuda", "--max-total-tokens", "65536", log_dir=tmp_path,
                        env={"OMP_NUM_THREADS": "4"})
    try:
        srv.wait_ready()
        out = srv.post("/generate", {"text": PROMPTS, "sampling_params": params}).json()
        assert [o["output_ids"] for o in out] == ref
        assert srv.get("/get_server_info").json()["device"].startswith("cuda")

        async def many() -> list[int]:
            async def one(i: int) -> int:
                body = {"text": PROMPTS[i % 4], "sampling_params": params, "stream": True}
                n = 0
                async with http.stream("POST", "/generate", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            n = json.loads(line[6:])["meta_info"]["completion_tokens"]
                return n

            limits = httpx.Limits(max_connections=300)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
                return await asyncio.gather(*(one(i) for i in range(256)))

        assert asyncio.run(many()) == [32] * 256
        info = srv.get("/get_server_info").json()
        assert info["kv_held_slots"] == 0 and info["invariants_ok"]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log()
        assert srv.group_pids() == []
    finally:
        srv.stop()


def test_gpu_server_handover_over_cuda_ipc(tmp_path):
    """Weight updates whose tensors travel as CUDA IPC handles (tensor and IPC routes), pause/continue,
    and the memory ledger's release points as /metrics reports them."""
    from prometheus_client.parser import text_string_to_metric_families
    from safetensors.torch import load_file

    import tide
    from tide.weights import flatten_by_dtype, serialize_named_tensors

    model = serve_model_path(tmp_path)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    engine = tide.Engine(str(model), device="cuda", max_total_tokens=16384)
    dtype = engine.model_runner.dtype
    base = {k: v.to("cuda", dtype) for k, v in load_file(str(model / "model.safetensors")).items()}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def perturbed(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        return [(n, (base[n] + torch.randn(base[n].shape, generator=gen, device="cuda",
                                           dtype=dtype) * base[n].float().std().to(dtype) * 0.5)
                 .contiguous()) for n in names]

    def releases(srv: ServerProcess) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(srv.get("/metrics").text):
            for s in family.samples:
                if s.name == "tide:memory_releases_total":
                    out[s.labels["reason"]] = s.value
        return out

    srv = ServerProcess(model, "--device", "cuda", "--max-total-tokens", "16384", log_dir=tmp_path,
                        env={"OMP_NUM_THREADS": "4"})
    try:
        srv.wait_ready()
        names = sorted(n for n in base if "embed_tokens" in n or "layers.0." in n)
        named = perturbed(names)
        body = {"serialized_named_tensors": serialize_named_tensors(named),
                "weight_version": "gpu-1", "torch_empty_cache": True}
        resp = srv.post("/update_weights_from_tensor", body)
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        engine.update_weights_from_tensor(named_tensors=named)
        ref = [r["output_ids"] for r in engine.generate(prompt=PROMPTS, sampling_params=params)]
        out = srv.post("/generate", {"text": PROMPTS, "sampling_params": params}).json()
        assert [o["output_ids"] for o in out] == ref
        assert {o["meta_info"]["weight_version"] for o in out} == {"gpu-1"}
        assert releases(srv)["weight_update"] == 1

        named = perturbed(names)
        assert srv.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        resp = srv.post("/update_weights_from_ipc", {
            "serialized_buckets": serialize_named_tensors(flatten_by_dtype(named)),
            "weight_version": "gpu-2"})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert srv.post("/continue_generation", {"torch_empty_cache": True}).status_code == 200
        engine.update_weights_from_tensor(named_tensors=named)
        ref = [r["output_ids"] for r in engine.generate(prompt=PROMPTS, sampling_params=params)]
        out = srv.post("/generate", {"text": PROMPTS, "sampling_params": params}).json()
        assert [o["output_ids"] for o in out] == ref
        counts = releases(srv)
        assert counts["continue_generation"] == 1 and counts["weight_update"] == 1
        ledger = srv.get("/get_server_info").json()["memory_ledger"]
        assert ledger["continue_generation"]["stall_s"] >= 0
    finally:
        srv.stop()
        engine.shutdown()
