"""`tide serve --model demo-diffusion`: the OpenAI images API, checked with the official `openai`
client and raw HTTP; request batching checked on the batcher itself; `tide generate` for images."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("diffusers")
openai = pytest.importorskip("openai")

from server_utils import REPO, assert_error, running_server

import tide

KEY = "sk-images"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(Path("demo-diffusion"), "--api-key", KEY, "--allowed-hosts",
                        "images.example", "--header-read-timeout", "2",
                        log_dir=tmp_path_factory.mktemp("logs"), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine():
    return tide.DiffusionEngine("demo-diffusion")


def decode(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_openai_client_generates_the_engines_image(client, engine):
    resp = client.images.generate(model="demo-diffusion", prompt="a red fox in the snow",
                                  size="64x64", extra_body={"seed": 3, "num_inference_steps": 3})
    assert len(resp.data) == 1 and resp.data[0].url is None
    got = decode(resp.data[0].b64_json)
    want = np.asarray(engine.generate("a red fox in the snow", seed=3, num_inference_steps=3,
                                      height=64, width=64)["images"][0])
    assert got.shape == (64, 64, 3)
    assert np.array_equal(got, want)
    assert resp.meta_info["seed"] == 3 and "denoising" in resp.meta_info["stage_timings_ms"]


def test_n_size_and_negative_prompt(client, engine):
    resp = client.images.generate(prompt="the sky", n=2, size="32x48", response_format="b64_json",
                                  extra_body={"seed": 1, "num_inference_steps": 2,
                                              "negative_prompt": "a tree", "true_cfg_scale": 2.0})
    images = [decode(d.b64_json) for d in resp.data]
    assert [im.shape for im in images] == [(48, 32, 3)] * 2  # size is WIDTHxHEIGHT
    want = engine.generate("the sky", negative_prompt="a tree", true_cfg_scale=2.0, seed=1,
                           num_images_per_prompt=2, num_inference_steps=2, height=48, width=32)
    for got, ref in zip(images, want["images"]):
        assert np.array_equal(got, np.asarray(ref))
    assert not np.array_equal(images[0], images[1])


def test_concurrent_requests_get_their_own_images(client, engine):
    prompts = [("the cat", 5), ("a dog", 6), ("the cat", 7), ("red sky", 8)]

    def one(p, s):
        resp = client.images.generate(prompt=p, size="32x32",
                                      extra_body={"seed": s, "num_inference_steps": 4})
        return decode(resp.data[0].b64_json), resp.meta_info["batch_num_images"]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: one(*a), prompts))
    for (p, s), (got, _) in zip(prompts, results):
        want = np.asarray(engine.generate(p, seed=s, num_inference_steps=4, height=32,
                                          width=32)["images"][0]).astype(int)
        # Which requests share a batch depends on when they arrive, and a batch moves the floats
        # by ~1e-6, which can round a pixel to the next level: each value within 1 of the image
        # made alone, and nearly all equal (another seed or prompt differs everywhere).
        diff = np.abs(got.astype(int) - want)
        assert got.shape == want.shape and diff.max() <= 1, diff.max()
        assert (diff > 0).mean() < 0.01, (diff > 0).mean()


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "size": "63x64"}, 400, "size"),
    ({"prompt": "x", "size": "64"}, 400, "size"),
    ({"prompt": "x", "size": "4096x4096"}, 400, "size"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "n": "2"}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "quality": "hd"}, 400, "quality"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format"),
    ({"prompt": "x", "response_format": "gif"}, 400, "response_format"),
    ({"prompt": "x", "seed": "1"}, 400, "seed"),
    ({"prompt": "x", "seed": -5}, 400, "seed"),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 1.5}, 400, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": "high"}, 400, "guidance_scale"),
    ({"prompt": "x", "negative_prompt": "y"}, 400, "negative_prompt"),
    ({"prompt": "x", "stream": True}, 400, "stream"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
    ({"prompt": "x \ud800 y"}, 400, "prompt"),  # a lone surrogate: the tokenizer cannot take it
])
def test_bad_input_is_a_400_naming_the_field(server, body, status, param):
    assert_error(server.post("/v1/images/generations", body), status, param)


def test_bad_input_via_openai_client_and_server_stays_up(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", size="100x100")
    assert e.value.body["param"] == "size" and "multiple of 16" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", response_format="url")
    assert "b64_json" in e.value.body["message"]
    assert_error(server.post("/v1/images/generations", None, content=b"{not json"), 400)
    assert_error(server.post("/v1/images/generations", {"prompt": "x" * (2 << 20)}), 413)
    assert_error(server.post("/v1/images/generations", {"prompt": "x" * 20000}), 400, "prompt")
    assert server.get("/health").status_code == 200
    assert len(client.images.generate(prompt="ok", size="32x32",
                                      extra_body={"num_inference_steps": 1}).data) == 1


def test_auth_models_health_and_metrics(server, client):
    assert_error(server.post("/v1/images/generations", {"prompt": "x"}, headers={}), 401)
    assert [m.id for m in client.models.list().data] == ["demo-diffusion"]
    assert client.models.retrieve("demo-diffusion").id == "demo-diffusion"
    client.images.generate(prompt="metrics", size="32x32", extra_body={"num_inference_steps": 1})
    text = server.get("/metrics").text
    for stage in ("text_encoding", "denoising", "decoding"):
        assert f'tide:image_stage_latency_seconds_count{{model_name="demo-diffusion",stage="{stage}"}}' in text
    assert 'tide:image_requests_total{model_name="demo-diffusion",status="ok"}' in text
    assert "tide:image_batch_images_bucket" in text and "tide:memory_reserved_bytes" in text
    info = server.get("/get_model_info").json()
    assert info["kind"] == "flux" and info["default_size"] == 64


# ---- batching policy, on the batcher itself (deterministic: the first batch is held open)

class _GateEngine:
    """Records the batches it is given; the first one waits for `release`."""

    released_tags: list[str] = []

    def __init__(self):
        self.batches = []
        self.release = threading.Event()

    def run_batch(self, reqs):
        self.batches.append([r.rid for r in reqs])
        if len(self.batches) == 1:
            self.release.wait(10)
        if any(r.prompts[0] == "boom" for r in reqs):
            raise RuntimeError("denoiser exploded")
        from tide.diffusion.io_struct import ImageResult

        return [ImageResult(r.rid, [], {"stage_timings_ms": {"denoising": 1.0}}) for r in reqs]


def _batcher(fake, max_queued: int = 8):
    """An `ImageBatcher` (4 images a batch) over a stand-in engine."""
    from tide.diffusion.server import DiffusionMetrics, ImageBatcher
    from tide.memory.ledger import MemoryLedger

    return ImageBatcher(fake, DiffusionMetrics("t", MemoryLedger()), max_batch_images=4,
                        max_queued=max_queued)


async def _one_running(fake, request, max_queued: int = 8):
    """A started batcher over `fake` whose first batch (`request`) has reached the engine; returns
    (batcher, the task awaiting that request)."""
    batcher = _batcher(fake, max_queued)
    await batcher.start()
    task = asyncio.create_task(batcher.submit(request))
    while not fake.batches:
        await asyncio.sleep(0.01)
    return batcher, task


def _request_maker(engine):
    def req(rid, prompt="p", size=32, n=1, steps=2):
        return engine.make_request(prompt, height=size, width=size, num_inference_steps=steps,
                                   num_images_per_prompt=n, seed=0, rid=rid)

    return req


def test_batcher_groups_compatible_requests_and_isolates_failures(engine):
    from tide.server.errors import APIError

    req = _request_maker(engine)

    async def scenario():
        gate = _GateEngine()
        batcher, first = await _one_running(gate, req("a"))
        later = [asyncio.create_task(batcher.submit(r)) for r in (
            req("b"), req("c", size=48), req("d", n=2), req("e", n=2), req("f", steps=3),
            req("g", prompt="boom", size=64))]
        await asyncio.sleep(0.05)
        gate.release.set()
        results = await asyncio.gather(first, *later, return_exceptions=True)
        await batcher.stop()
        return gate.batches, results

    batches, results = asyncio.run(scenario())
    # Oldest first; same size/steps/guidance share a batch up to 4 images; others wait their turn.
    assert batches == [["a"], ["b", "d"], ["c"], ["e"], ["f"], ["g"]]
    assert [r.rid for r in results[:6]] == ["a", "b", "c", "d", "e", "f"]
    assert isinstance(results[6], APIError) and results[6].status_code == 500
    assert "denoiser exploded" in results[6].message


def test_batcher_requeues_a_batch_released_under_it_and_drops_requests_whose_client_left(engine):
    """Memory released between taking a batch and running it: its requests wait for the resume
    at the head of the queue (not a 503). A request whose client left no longer counts against
    the queue bound."""
    from tide.diffusion.io_struct import MemoryReleasedError

    class ReleasedOnce(_GateEngine):
        def run_batch(self, reqs):
            if not self.batches:
                self.batches.append([r.rid for r in reqs])
                raise MemoryReleasedError("memory of ['weights'] is released")
            return super().run_batch(reqs)  # a later batch: no wait

    req = _request_maker(engine)

    async def scenario():
        fake = ReleasedOnce()
        batcher, queued = await _one_running(fake, req("a"), max_queued=1)
        await asyncio.sleep(0.05)
        assert not queued.done()  # waiting for the resume, not failed
        batcher.wake()  # what resume_memory_occupation does
        first = await asyncio.wait_for(queued, 10)
        # A client that leaves: its request is dropped from the queue bound at once.
        fake.released_tags = ["weights"]  # hold the queue
        left = asyncio.create_task(batcher.submit(req("b")))
        await asyncio.sleep(0.05)
        left.cancel()
        await asyncio.sleep(0)
        nxt = asyncio.create_task(batcher.submit(req("c")))  # max_queued=1: must not be queue_full
        await asyncio.sleep(0.05)
        assert not nxt.done()
        fake.released_tags = []
        batcher.wake()
        second = await asyncio.wait_for(nxt, 10)
        await batcher.stop()
        return fake.batches, first, second

    batches, first, second = asyncio.run(scenario())
    assert batches == [["a"], ["a"], ["c"]]
    assert (first.rid, second.rid) == ("a", "c")


def test_shutdown_answers_queued_requests_at_once(engine):
    """The server's first exit signal (`begin_shutdown`): every queued request and every new one
    gets a 503 `server_shutting_down` now, while the running batch goes on."""
    from tide.server.errors import APIError

    req = _request_maker(engine)

    async def scenario():
        gate = _GateEngine()
        batcher, running = await _one_running(gate, req("a"))
        queued = asyncio.create_task(batcher.submit(req("b", size=48)))
        await asyncio.sleep(0.05)
        batcher.begin_shutdown()
        late = asyncio.create_task(batcher.submit(req("c")))
        refused = await asyncio.gather(queued, late, return_exceptions=True)
        gate.release.set()
        done = await running
        await batcher.stop()
        return refused, done

    refused, done = asyncio.run(scenario())
    for err in refused:
        assert isinstance(err, APIError) and err.status_code == 503, err
        assert err.code == "server_shutting_down"
    assert done.rid == "a"


def test_shutdown_answers_the_running_batch_before_the_server_cuts_it_off(engine):
    """A batch still running at the shutdown's deadline: its requests get a 503
    `server_shutting_down` then (the server would otherwise close them with a bare 500); the
    batch itself is left to end in its thread."""
    from tide.server.errors import APIError

    req = _request_maker(engine)

    async def scenario():
        gate = _GateEngine()
        batcher, running = await _one_running(gate, req("a"))
        batcher.begin_shutdown(running_deadline_s=0.05)
        err = await asyncio.gather(asyncio.wait_for(running, 10), return_exceptions=True)
        gate.release.set()
        await batcher.stop()
        return err[0]

    err = asyncio.run(scenario())
    assert isinstance(err, APIError) and err.status_code == 503, err
    assert err.code == "server_shutting_down"


# ---- command line

def test_tide_generate_writes_png(tmp_path, engine):
    out = tmp_path / "img.png"
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "tide", "generate", "--model", "demo-diffusion",
                           "--out", str(out), "--seed", "4", "--num-inference-steps", "2",
                           "--size", "48x32", "a red fox"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    got = np.asarray(Image.open(out).convert("RGB"))
    want = engine.generate("a red fox", seed=4, num_inference_steps=2, height=32, width=48)
    assert np.array_equal(got, np.asarray(want["images"][0]))
    bad = subprocess.run([sys.executable, "-m", "tide", "serve", "--model", "demo-diffusion",
                          "--max-total-tokens", "100"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)
    assert bad.returncode == 2 and "--max-total-tokens: not used by diffusion models" in bad.stderr


def test_an_api_key_given_as_a_string_is_one_key_not_its_characters(engine):
    """`DiffusionServerArgs(api_key="k1,k2")` (the Python API, not the CLI's list) admits exactly
    those keys: never a single character of one."""
    import httpx

    from tide.diffusion.server import DiffusionServerArgs, create_app

    args = DiffusionServerArgs(api_key="sk-one,sk-two")
    assert args.api_keys == ("sk-one", "sk-two")
    app = create_app(args, engine)

    async def status(token: str) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            resp = await http.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
            return resp.status_code

    assert asyncio.run(status("sk-two")) == 200
    for token in ("s", "k", "-", "sk-one,sk-two"):
        assert asyncio.run(status(token)) == 401, token


def test_host_names_and_header_deadline_flags_reach_the_image_server(server):
    """`--allowed-hosts` adds a name the loopback-bound image server answers (others are 403, DNS
    rebinding); `--header-read-timeout 2` closes a connection whose headers never finish."""
    import socket

    headers = {"Authorization": f"Bearer {KEY}"}
    ok = httpx.get(server.url + "/health", headers={**headers, "Host": "images.example"})
    assert ok.status_code == 200
    bad = httpx.get(server.url + "/health", headers={**headers, "Host": "attacker.example"})
    assert bad.status_code == 403 and "--allowed-hosts" in bad.json()["error"]["message"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never ends its headers
        t0 = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert 1.0 < time.monotonic() - t0 < 8.0
