"""`tide serve --model <diffusers dir>`: the OpenAI images API in front of a `DiffusionEngine`.

Routes: `POST /v1/images/generations`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`,
`GET /metrics`, `GET /get_model_info`, and the admin routes of the RL handover with sglang's paths and
bodies (`POST /update_weights_from_tensor`, `/update_weights_from_disk`, `/update_weight_version`,
`/release_memory_occupation`, `/resume_memory_occupation`, `GET|POST /get_weights_by_name`,
`GET /dump_memory_timeline`). Auth (`--api-key`, `--admin-api-key`: admin routes need the admin key),
body limits, error bodies and 400s naming the field are the LLM server's (`tide.server`); a failed
handover call is a 400 with sglang's `{success: false, message}` next to the OpenAI-style `error`.

Process layout: one process. The HTTP side (uvicorn + FastAPI) validates a request, builds an
`ImageRequest` with the engine's own checks, and queues it; one worker thread takes the oldest
request plus every queued request with the same `batch_key` (size, step count, guidance) up to
`max_batch_images` images, runs them as one batch, and hands each request its images; PNG encoding
happens off the worker thread. A failing batch fails only its own requests (500); the server keeps
serving. The queue is bounded (`max_queued_requests`; beyond it, 503). While memory is released
(`/release_memory_occupation`) queued requests wait; `/resume_memory_occupation` lets them run. A
weight update waits for the running batch (the engine's lock) and applies before the next one.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from tide.diffusion.config import (
    DEMO_DIFFUSION_NAME,
    DEMO_DIFFUSION_PATH,
    DiffusionConfig,
)
from tide.diffusion.io_struct import (
    DiffusionOutOfMemoryError,
    ImageRequest,
    ImageResult,
    MemoryReleasedError,
)
from tide.diffusion.weights import resolve_component_dir
from tide.memory.ledger import MemoryLedger
from tide.memory.observe import device_memory_stats
from tide.server.admin_api import AdminAPIError, resolve_weight_path
from tide.server.connection import header_deadline_protocol
from tide.server.errors import APIError, from_validation_error
from tide.server.http_server import Auth, AuthMiddleware
from tide.server.limits import BodyLimitMiddleware, RequestLimits
from tide.server.metrics import CONTENT_TYPE
from tide.server.protocol import (
    GetWeightsByNameInput,
    MemoryOccupationInput,
    UpdateWeightFromDiskInput,
    UpdateWeightsFromTensorInput,
    UpdateWeightVersionInput,
)
from tide.server.security import BrowserGuard, check_allowed_hosts, is_loopback_host
from tide.server.tokenizer_manager import client_gone
from tide.server.utils import parse_body
from tide.version import __version__

logger = logging.getLogger("tide.server")

_SIZE_RE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0,
                    300.0)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0, 120.0)
_MEMORY_BUCKETS = tuple(float(1 << s) for s in range(20, 39, 2))  # 1 MiB .. 256 GiB
MAX_BODY_BYTES = 1 << 20  # prompts are bounded by max_prompt_chars; nothing else is large
# After the first exit signal the running batch has this long to finish; its requests get a 503
# (an OpenAI-style body) this much before uvicorn would cut them off.
GRACEFUL_SHUTDOWN_S = 10
SHUTDOWN_REPLY_MARGIN_S = 1
# Engine field -> the request field a client sent.
_PARAMS = {"height": "size", "width": "size", "num_images_per_prompt": "n"}


@dataclass(frozen=True)
class DiffusionServerArgs:
    """HTTP options plus the engine configuration."""

    engine: DiffusionConfig = field(default_factory=DiffusionConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    max_queued_requests: int = 256
    # Directories `/update_weights_from_disk` may read from (default: the model's parent dir).
    allowed_weight_roots: tuple[str, ...] | None = None
    # Serve the admin routes without an admin key on a non-loopback host.
    allow_unauthenticated_admin: bool = False
    # Bodies of /update_weights_from_tensor (serialized tensors); other bodies: MAX_BODY_BYTES.
    max_weight_update_body_bytes: int = 1 << 30
    # As the LLM server's (`ServerArgs`, `RequestLimits`).
    allowed_hosts: tuple[str, ...] = ()
    header_read_timeout: float = RequestLimits.header_read_timeout
    body_read_timeout: float = RequestLimits.body_read_timeout

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.allowed_weight_roots is not None:
            if isinstance(self.allowed_weight_roots, str) or not self.allowed_weight_roots:
                raise ValueError("allowed_weight_roots must be a non-empty list of directories")
            for root in self.allowed_weight_roots:
                if not os.path.isdir(root):
                    raise ValueError(f"allowed_weight_roots: {root!r} is not a directory")
        if (not is_loopback_host(self.host) and self.admin_api_key is None
                and not self.allow_unauthenticated_admin):
            raise ValueError(f"host {self.host!r} is not loopback: set admin_api_key "
                             "(--admin-api-key) to guard the weight-update and memory routes, or "
                             "allow_unauthenticated_admin (--allow-unauthenticated-admin)")
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"{name} must not be empty")
        object.__setattr__(self, "allowed_hosts", check_allowed_hosts(self.allowed_hosts))
        self.limits  # noqa: B018 - the timeouts checked now, not at the first request
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests <= 0:
            raise ValueError(f"max_queued_requests must be a positive integer, got "
                             f"{self.max_queued_requests!r}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The user keys (`api_key` may hold several, comma-separated); none: user routes are open."""
        if self.api_key is None:
            return ()
        return tuple(dict.fromkeys(k.strip() for k in self.api_key.split(",") if k.strip()))

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_request_body_bytes=MAX_BODY_BYTES,
                             max_weight_update_body_bytes=self.max_weight_update_body_bytes,
                             header_read_timeout=self.header_read_timeout,
                             body_read_timeout=self.body_read_timeout)

    @property
    def weight_roots(self) -> list[str]:
        """The resolved directories `/update_weights_from_disk` may read under."""
        roots = self.allowed_weight_roots
        if roots is None:
            roots = (os.path.dirname(os.path.realpath(self.engine.model_path)),)
        return list(dict.fromkeys(os.path.realpath(r) for r in roots))

    @property
    def model_names(self) -> list[str]:
        """Names a request's `model` may use: the served name first, then the model path."""
        names: list[str] = []
        if self.served_model_name:
            names.append(self.served_model_name)
        if os.path.abspath(self.engine.model_path) == os.path.abspath(DEMO_DIFFUSION_PATH):
            names.append(DEMO_DIFFUSION_NAME)
        names.append(self.engine.model_path)
        return list(dict.fromkeys(names))


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`: OpenAI's fields tide supports, plus tide's own. Unknown
    fields and wrong types are 400s naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = None  # "WIDTHxHEIGHT" or "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    stream: Literal[False] | None = None
    user: str | None = None
    # tide extensions
    negative_prompt: str | None = None
    seed: int | list[int] | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None


class DiffusionMetrics:
    """Prometheus metrics of the image server, in a registry of their own."""

    def __init__(self, model_name: str, ledger: MemoryLedger, residency: Any = None) -> None:
        """`ledger`: the engine's memory ledger, whose release totals are exported; `residency`:
        the engine's component manager, whose placement is exported."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.requests = Counter("tide:image_requests", "Finished image requests by status",
                                labels + ["status"], registry=r)
        self.images = Counter("tide:images_generated", "Images generated", labels, registry=r)
        self.e2e = Histogram("tide:image_request_latency_seconds",
                             "Image request latency from arrival to images ready", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tide:image_queue_time_seconds",
                                    "Time an image request waited for its batch to start", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("tide:image_stage_latency_seconds",
                               "Latency of each pipeline stage, per batch", labels + ["stage"],
                               buckets=_STAGE_BUCKETS, registry=r)
        self.stage_peak = Histogram("tide:image_stage_peak_memory_bytes",
                                    "Peak device memory of each pipeline stage, per batch (the "
                                    "allocator's on CUDA, placed component weights elsewhere)",
                                    labels + ["stage"], buckets=_MEMORY_BUCKETS, registry=r)
        self.batch_images = Histogram("tide:image_batch_images", "Images per batch run", labels,
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.queued = Gauge("tide:image_queue_reqs", "Image requests waiting for a batch", labels,
                            registry=r)
        r.register(_MemoryCollector(model_name, ledger, residency))
        self.label = {"model_name": model_name}

    def on_batch(self, stage_ms: dict[str, float], num_images: int,
                 queue_times: list[float], stage_memory: dict[str, dict[str, int]] | None = None
                 ) -> None:
        for stage, ms in stage_ms.items():
            self.stage.labels(stage=stage, **self.label).observe(ms / 1000.0)
        for stage, mem in (stage_memory or {}).items():
            self.stage_peak.labels(stage=stage, **self.label).observe(mem["peak_bytes"])
        self.batch_images.labels(**self.label).observe(num_images)
        for q in queue_times:
            self.queue_time.labels(**self.label).observe(q)

    def on_finish(self, status: str, num_images: int, e2e: float | None) -> None:
        self.requests.labels(status=status, **self.label).inc()
        if num_images:
            self.images.labels(**self.label).inc(num_images)
        if e2e is not None:
            self.e2e.labels(**self.label).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MemoryCollector(Collector):
    """The memory ledger's release totals by reason, this process's device memory, and where each
    component is (the residency manager's counters)."""

    def __init__(self, model_name: str, ledger: MemoryLedger, residency: Any = None) -> None:
        self.model_name = model_name
        self.ledger = ledger
        self.residency = residency

    def collect(self) -> Any:
        name, labels = self.model_name, ["model_name", "reason"]
        count = CounterMetricFamily("tide:memory_releases",
                                    "Device allocator cache releases (empty_device_cache) by reason",
                                    labels=labels)
        stall = CounterMetricFamily("tide:memory_release_stall_seconds",
                                    "Host time blocked in allocator cache releases, by reason",
                                    labels=labels)
        for reason, totals in sorted(self.ledger.totals().items()):
            count.add_metric([name, reason], float(totals.get("count", 0)))
            stall.add_metric([name, reason], float(totals.get("stall_s", 0.0)))
        yield from (count, stall)
        stats = device_memory_stats()
        for key in ("reserved", "allocated"):
            gauge = GaugeMetricFamily(f"tide:memory_{key}_bytes",
                                      f"Bytes {key} by the device caching allocator ({stats['source']})",
                                      labels=["model_name"])
            gauge.add_metric([name], float(stats[key]))
            yield gauge
        if self.residency is not None:
            yield from self._components(name)

    def _components(self, name: str) -> Any:
        stats = self.residency.stats()
        labels = ["model_name", "component", "strategy"]
        device = GaugeMetricFamily("tide:component_device_bytes",
                                   "Bytes of a component's weights on the compute device", labels=labels)
        moved = CounterMetricFamily("tide:component_h2d_bytes",
                                    "Bytes of a component's weights copied host -> device", labels=labels)
        placements = CounterMetricFamily("tide:component_placements",
                                         "Copies of a component (or of one of its blocks) to the device",
                                         labels=labels)
        for comp, c in sorted(stats["components"].items()):
            values = [name, comp, c["strategy"]]
            device.add_metric(values, float(c["device_bytes"]))
            moved.add_metric(values, float(c["h2d_bytes"]))
            placements.add_metric(values, float(c["placements"]))
        host = GaugeMetricFamily("tide:component_host_bytes",
                                 "Bytes of the components' host copies (pinned on CUDA)",
                                 labels=["model_name"])
        host.add_metric([name], float(stats["host_bytes"]))
        yield from (device, moved, placements, host)


@dataclass
class _Pending:
    req: ImageRequest
    future: asyncio.Future[ImageResult]
    arrived: float = field(default_factory=time.perf_counter)


class ImageBatcher:
    """Queued image requests, run in batches of equal `batch_key` by one worker thread."""

    def __init__(self, engine: Any, metrics: DiffusionMetrics, max_batch_images: int,
                 max_queued: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch_images = max_batch_images
        self.max_queued = max_queued
        self._pending: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch in the worker
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tide-diffusion")
        self.closed = False

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self.closed

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="tide-image-batcher")

    async def stop(self) -> None:
        self.closed = True
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(APIError("The server is shutting down", 503,
                                                code="server_shutting_down"))
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._worker.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        """Look at the queue again (memory was resumed)."""
        if self._wake is not None:
            self._wake.set()

    def begin_shutdown(self, running_deadline_s: float | None = None) -> None:
        """The server is stopping: new requests and every queued one get a 503 now; the running
        batch may still finish. Past `running_deadline_s` (called on the event loop) its requests
        get the 503 too: the graceful shutdown would otherwise cut them off with a bare 500."""
        self.closed = True
        self.abort_queued("The server is shutting down", code="server_shutting_down")
        if running_deadline_s is not None:
            asyncio.get_running_loop().call_later(running_deadline_s, self._fail_running)

    def _fail_running(self) -> None:
        for p in self._running:
            if not p.future.done():
                p.future.set_exception(APIError(
                    "The server shut down before this image was done", 503,
                    code="server_shutting_down"))

    def abort_queued(self, message: str, code: str = "aborted") -> int:
        """Fail every queued request (503 `code`); returns how many."""
        aborted = 0
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(APIError(message, 503, code=code))
                aborted += 1
        self._pending.clear()
        self.metrics.queued.labels(**self.metrics.label).set(0)
        return aborted

    async def submit(self, req: ImageRequest) -> ImageResult:
        if self.closed:
            raise APIError("The server is shutting down", 503, code="server_shutting_down")
        self._pending = [p for p in self._pending if not p.future.done()]  # clients that left
        if len(self._pending) >= self.max_queued:
            raise APIError(f"Too many queued image requests ({self.max_queued}); retry later", 503,
                           code="queue_full")
        future: asyncio.Future[ImageResult] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(req, future))
        self.metrics.queued.labels(**self.metrics.label).set(len(self._pending))
        assert self._wake is not None
        self._wake.set()
        return await future

    def _take_batch(self) -> list[_Pending]:
        self._pending = [p for p in self._pending if not p.future.done()]  # cancelled by the client
        if not self._pending:
            return []
        key = self._pending[0].req.batch_key
        batch, rest, images = [], [], 0
        for p in self._pending:
            if p.req.batch_key == key and images + p.req.num_images <= self.max_batch_images:
                batch.append(p)
                images += p.req.num_images
            else:
                rest.append(p)
        self._pending = rest
        return batch

    async def _loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            # While memory is released the queue waits; resume wakes it.
            while not self.engine.released_tags and (batch := self._take_batch()):
                self.metrics.queued.labels(**self.metrics.label).set(len(self._pending))
                start = time.perf_counter()
                reqs = [p.req for p in batch]
                self._running = batch
                try:
                    results = await loop.run_in_executor(self._worker, self.engine.run_batch, reqs)
                except MemoryReleasedError:
                    # Released while this batch was being taken: it waits for the resume like
                    # the rest of the queue, at its head.
                    self._pending[:0] = [p for p in batch if not p.future.done()]
                    self.metrics.queued.labels(**self.metrics.label).set(len(self._pending))
                    break  # until the next wake: the resume, or a new request
                except Exception as e:  # one batch failing never takes the server down
                    err = _batch_error(e)
                    if err.status_code == 500:
                        logger.error("image batch of %d request(s) failed: %s", len(batch), e,
                                     exc_info=not isinstance(e, DiffusionOutOfMemoryError))
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(err)
                    continue
                self.metrics.on_batch(results[0].meta_info["stage_timings_ms"],
                                      sum(r.num_images for r in reqs),
                                      [start - p.arrived for p in batch],
                                      results[0].meta_info.get("stage_memory"))
                for p, res in zip(batch, results):
                    if not p.future.done():
                        p.future.set_result(res)


def _batch_error(e: Exception) -> APIError:
    """The HTTP error a failed batch gives each of its requests."""
    if isinstance(e, DiffusionOutOfMemoryError):
        return APIError(str(e), 500, code="out_of_memory")
    if isinstance(e, MemoryReleasedError):
        return APIError(str(e), 503, code="memory_released")
    return APIError(f"Image generation failed: {type(e).__name__}: {e}", 500,
                    code="generation_failed")


async def read_request(request: Request) -> ImageGenerationRequest:
    """The JSON body as an `ImageGenerationRequest`, read at most `MAX_BODY_BYTES` (413 beyond);
    every problem is a 400 naming the field."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"The request body is larger than {MAX_BODY_BYTES} bytes", 413,
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"The request body is larger than {MAX_BODY_BYTES} bytes", 413,
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError("The request body is empty; expected a JSON object", 400, code="invalid_json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"The request body is not valid JSON: {e}", 400, code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", 400, code="invalid_json")
    try:
        return ImageGenerationRequest.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _png_b64(images: list[Any]) -> list[str]:
    out = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def _engine_error(e: ValueError) -> APIError:
    """A ValueError of the engine's checks as a 400 naming the request field."""
    message = str(e)
    match = re.match(r"^([a-z_]+)", message)
    field_name = match.group(1) if match else None
    param = _PARAMS.get(field_name, field_name) if field_name else None
    if param not in ImageGenerationRequest.model_fields:
        param = None
    elif param != field_name:
        message = f"{param}: {message}"
    return APIError(message, 400, param=param, code="invalid_value")


class ImageServing:
    """The request handling of `/v1/images/generations`."""

    def __init__(self, engine: Any, batcher: ImageBatcher, metrics: DiffusionMetrics,
                 model_names: list[str]) -> None:
        self.engine = engine
        self.batcher = batcher
        self.metrics = metrics
        self.model_names = model_names

    def make_request(self, body: ImageGenerationRequest) -> ImageRequest:
        if body.model is not None and body.model not in self.model_names:
            raise APIError(f"The model '{body.model}' does not exist; this server serves "
                           f"'{self.model_names[0]}'", 404, param="model", code="model_not_found")
        if body.response_format == "url":
            raise APIError("response_format 'url' is not supported: tide returns images inline; use "
                           "'b64_json'", 400, param="response_format", code="unsupported_value")
        height = width = None
        if body.size is not None and body.size != "auto":
            m = _SIZE_RE.match(body.size)
            if not m:
                raise APIError(f"Invalid value for 'size': expected 'WIDTHxHEIGHT' (e.g. '1024x1024') "
                               f"or 'auto', got {body.size!r}", 400, param="size", code="invalid_value")
            width, height = int(m.group(1)), int(m.group(2))
        kwargs: dict[str, Any] = {}
        for name in ("num_inference_steps", "guidance_scale", "true_cfg_scale"):
            value = getattr(body, name)
            if value is not None:
                kwargs[name] = value
        try:
            return self.engine.make_request(
                body.prompt, negative_prompt=body.negative_prompt, height=height, width=width,
                seed=body.seed, num_images_per_prompt=body.n, output_type="pil", **kwargs)
        except ValueError as e:
            raise _engine_error(e) from None

    async def create(self, body: ImageGenerationRequest, request: Request) -> dict[str, Any] | Response:
        req = self.make_request(body)
        waiting = asyncio.ensure_future(self.batcher.submit(req))
        gone = asyncio.ensure_future(client_gone(request.receive))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not waiting.done():
            # The client left: its queued request is dropped now (it no longer counts against
            # --max-queued-requests), a running batch still finishes.
            waiting.cancel()
            self.metrics.on_finish("error", 0, None)
            return Response(status_code=499)
        try:
            result = waiting.result()
        except APIError:
            self.metrics.on_finish("error", 0, None)
            raise
        data = await asyncio.to_thread(_png_b64, result.images)
        e2e = time.perf_counter() - req.created
        self.metrics.on_finish("ok", len(data), e2e)
        meta = dict(result.meta_info, e2e_latency=e2e)
        logger.info("images rid=%s n=%d %dx%d steps=%d seed=%s: %.2f s (%s)", req.rid, len(data),
                    req.width, req.height, req.num_inference_steps, meta["seed"], e2e,
                    ", ".join(f"{k} {v:.0f} ms" for k, v in meta["stage_timings_ms"].items()))
        return {
            "created": int(time.time()),
            "data": [{"b64_json": b, "revised_prompt": None} for b in data],
            "output_format": "png",
            "size": f"{req.width}x{req.height}",
            "meta_info": meta,
        }


def create_app(args: DiffusionServerArgs, engine: Any) -> FastAPI:
    """The app for one diffusion server; the batcher starts and stops with the app's lifespan."""
    metrics = DiffusionMetrics(args.model_names[0], engine.memory_ledger,
                               getattr(engine, "residency", None))
    batcher = ImageBatcher(engine, metrics, engine.config.max_batch_images, args.max_queued_requests)
    serving = ImageServing(engine, batcher, metrics, args.model_names)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        logger.info("serving %s (%s) on http://%s:%d", args.model_names[0], engine.kind, args.host,
                    args.port)
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="tide", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.add_middleware(AuthMiddleware, auth=Auth(args.api_keys, args.admin_api_key))
    app.add_middleware(BodyLimitMiddleware, limits=args.limits)
    app.add_middleware(BrowserGuard, loopback_only=is_loopback_host(args.host),
                       allowed_hosts=args.allowed_hosts)
    app.state.batcher = batcher
    app.state.limits = args.limits

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        msg = errors[0]["msg"] if errors else "invalid request"
        return APIError(f"Invalid value for '{loc}': {msg}", 400, param=loc or None,
                        code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code,
                        code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError(f"Internal server error: {type(exc).__name__}", 500,
                        code="internal_error").response()

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "tide",
                "root": args.engine.model_path, "kind": engine.kind}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(args.model_names[0])]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in args.model_names:
            raise APIError(f"The model '{model_id}' does not exist", 404, param="model",
                           code="model_not_found")
        return model_card(model_id)

    @app.post("/v1/images/generations", response_model=None)
    async def generations(request: Request) -> dict[str, Any] | Response:
        return await serving.create(await read_request(request), request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if batcher.alive else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": args.engine.model_path, "kind": engine.kind,
                "default_size": engine.default_size, "size_multiple": engine.pipeline.size_multiple,
                "max_batch_images": engine.config.max_batch_images, "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."), "is_generation": False,
                "weight_version": engine.weight_version,
                "component_residency": dict(engine.pipeline.strategies)}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.queued.labels(**metrics.label).set(len(batcher._pending))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_handover_routes(app, engine, batcher, args.weight_roots)
    return app


async def _admin_body(request: Request, model: Any, allow_empty: bool = False) -> Any:
    try:
        return await parse_body(request, model, allow_empty=allow_empty)
    except APIError as e:
        raise AdminAPIError.wrap(e) from None


def _reply(out: dict[str, Any], param: str | None = None, code: str = "update_failed") -> JSONResponse:
    """The engine's `{success, message, ...}` as 200, or a 400 with the OpenAI-style error too."""
    if not out.get("success"):
        raise AdminAPIError(str(out.get("message") or "failed"), param=param, code=code)
    return JSONResponse({"num_paused_requests": 0, **out})


def add_handover_routes(app: FastAPI, engine: Any, batcher: ImageBatcher,
                        weight_roots: list[str]) -> None:
    """The RL handover's admin routes (auth: the app's middleware, admin paths of `tide.server`)."""

    async def update(call: Any, options: dict[str, Any], param: str) -> JSONResponse:
        if options.get("abort_all_requests"):
            batcher.abort_queued("aborted by a weight update (abort_all_requests)")
        out = await asyncio.to_thread(call)
        return _reply(out, param=param)

    def options(body: Any) -> dict[str, Any]:
        return {k: getattr(body, k) for k in ("flush_cache", "abort_all_requests", "weight_version",
                                              "torch_empty_cache")}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        body = await _admin_body(request, UpdateWeightsFromTensorInput)
        opts = options(body)
        return await update(lambda: engine.update_weights_from_tensor(
            serialized_named_tensors=body.serialized_named_tensors, load_format=body.load_format,
            **opts), opts, "serialized_named_tensors")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _admin_body(request, UpdateWeightFromDiskInput)
        try:
            component_dir = resolve_component_dir(body.model_path, engine.weights.name)
        except ValueError as e:
            raise AdminAPIError(str(e), param="model_path", code="invalid_value") from None
        path = resolve_weight_path(component_dir, weight_roots)
        opts = options(body)
        return await update(lambda: engine.update_weights_from_disk(
            path, load_format=body.load_format, **opts), opts, "model_path")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await _admin_body(request, UpdateWeightVersionInput)
        if body.abort_all_requests:
            batcher.abort_queued("aborted by update_weight_version (abort_all_requests)")
        return _reply(engine.update_weight_version(body.new_version), param="new_version")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        if request.method == "GET":
            try:
                body = GetWeightsByNameInput.model_validate(dict(request.query_params))
            except ValidationError as e:
                raise AdminAPIError.wrap(from_validation_error(e)) from None
        else:
            body = await _admin_body(request, GetWeightsByNameInput)
        try:
            values = await asyncio.to_thread(engine.get_weights_by_name, body.name,
                                             max(1, body.truncate_size))
        except ValueError as e:
            raise AdminAPIError(str(e), param="name", code="invalid_value") from None
        return JSONResponse(values)

    def memory_route(path: str, method: str) -> None:
        async def route(request: Request) -> Response:
            body = await _admin_body(request, MemoryOccupationInput, allow_empty=True)
            out = await asyncio.to_thread(getattr(engine, method), body.tags)
            if method == "resume_memory_occupation":
                batcher.wake()
            return _reply(out, param="tags", code="memory_occupation_failed")

        app.post(path, name=method)(route)

    memory_route("/release_memory_occupation", "release_memory_occupation")
    memory_route("/resume_memory_occupation", "resume_memory_occupation")

    @app.get("/dump_memory_timeline")
    async def dump_memory_timeline() -> Response:
        return JSONResponse(engine.memory_ledger.to_dict())


def launch_diffusion_server(args: DiffusionServerArgs) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; returns the exit code."""
    import uvicorn

    from tide.diffusion.engine import DiffusionEngine
    from tide.server.launch import setup_logging

    setup_logging(args.log_level)
    logger.info("loading %s", args.engine.model_path)
    engine = DiffusionEngine(**{**_config_kwargs(args.engine), "log_level": args.log_level})
    app = create_app(args, engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=args.log_level.lower() == "debug",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=5,
                            lifespan="on", log_config=None,
                            http=header_deadline_protocol(args.limits.header_read_timeout))
    batcher: ImageBatcher = app.state.batcher

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:  # the first signal: queued requests get their 503 now
                deadline = GRACEFUL_SHUTDOWN_S - SHUTDOWN_REPLY_MARGIN_S
                try:
                    asyncio.get_running_loop().call_soon_threadsafe(batcher.begin_shutdown,
                                                                    deadline)
                except RuntimeError:
                    batcher.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(config)
    server.run()
    return 0 if server.started else 1


def _config_kwargs(config: DiffusionConfig) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


__all__ = ["DiffusionServerArgs", "ImageBatcher", "create_app", "launch_diffusion_server"]
