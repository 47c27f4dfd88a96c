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
