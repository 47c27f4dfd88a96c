"""Admin routes for the training <-> rollout handover, with sglang's paths, bodies and replies.

    POST /update_weights_from_disk          {model_path, load_format, flush_cache, abort_all_requests,
                                             weight_version, torch_empty_cache}
    POST /update_weights_from_tensor        {serialized_named_tensors, load_format, ...same flags}
    POST /update_weights_from_ipc           {serialized_buckets, ...same flags}
    POST /init_weights_update_group         {master_address, master_port, rank_offset, world_size,
                                             group_name, backend, timeout}
    POST /destroy_weights_update_group      {group_name}
    POST /update_weights_from_distributed   {names, dtypes, shapes, group_name, load_format, ...flags}
    GET|POST /get_weights_by_name           {name, truncate_size}
    POST /update_weight_version             {new_version, abort_all_requests}
    POST /pause_generation                  {mode: abort | retract | in_place}
    POST /continue_generation               {torch_empty_cache}
    POST /release_memory_occupation         {tags: [kv_cache | weights | cuda_graph] | null}
    POST /resume_memory_occupation          {tags: [kv_cache | weights | cuda_graph] | null}
    GET  /dump_memory_timeline              the memory timeline JSON (`tide memory-plot` draws it)
    POST /start_profile                     {num_steps, activities, record_shapes, with_stack,
                                             profile_id}: torch.profiler on every rank
    POST /stop_profile                      stops it; `paths`: the files every rank wrote

Replies: 200 `{"success": true, "message", "num_paused_requests"}` (`/get_weights_by_name` returns the
list of values, as sglang does; `/update_weight_version` adds `new_version`). Every failure — bad
body, a path outside `--allowed-weight-roots`, or an update the engine refused (unknown tensor, wrong
shape or dtype, undecodable payload) — is HTTP 400 with the same fields (`success: false`, `message`
naming the problem) plus an OpenAI-style `error` object, so clients that check `success` and clients
that check the status both see it. A refused update changes nothing. Release/resume replies add
`released_bytes` (tag -> bytes currently released); a release the engine refuses (requests running and
not paused, memory saver off) is a 400 with the engine's message, and unknown tags are a 400 naming
`tags`, before anything reaches the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tide.io_struct import (
    ContinueGenerationReqInput,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    DumpMemoryTimelineReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    StartProfileReqInput,
    StopProfileReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromIPCReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
    weight_update_options,
)
from tide.server.errors import APIError, from_validation_error
from tide.server.metrics import ServerMetrics
from tide.server.openapi import json_body
from tide.server.protocol import (
    ContinueGenerationInput,
    DestroyWeightsUpdateGroupInput,
    GetWeightsByNameInput,
    InitWeightsUpdateGroupInput,
    MemoryOccupationInput,
    PauseGenerationInput,
    StartProfileInput,
    UpdateWeightFromDiskInput,
    UpdateWeightsFromDistributedInput,
    UpdateWeightsFromIPCInput,
    UpdateWeightsFromTensorInput,
    UpdateWeightVersionInput,
)
from tide.server.tokenizer_manager import TokenizerManager
from tide.server.utils import parse_body, read_body

M = TypeVar("M", bound=BaseModel)

_MAX_DIM = 2**63 - 1  # a tensor dimension torch (and the wire) can hold

ADMIN_HANDOVER_PATHS = frozenset({
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_ipc",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/get_weights_by_name",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/dump_memory_timeline",
    "/start_profile",
    "/stop_profile",
})


class AdminAPIError(APIError):
    """A 400 whose body carries sglang's `{success, message, num_paused_requests}` next to the
    OpenAI-style `error`."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, num_paused_requests: int = 0) -> None:
        super().__init__(message, status_code, param=param, code=code)
        self.num_paused_requests = num_paused_requests

    def body(self) -> dict[str, Any]:
        return {"success": False, "message": self.message,
                "num_paused_requests": self.num_paused_requests, **super().body()}

    @classmethod
    def wrap(cls, err: APIError) -> AdminAPIError:
        wrapped = cls(err.message, err.status_code, param=err.param, code=err.code)
        wrapped.close_connection = err.close_connection
        return wrapped


def is_under(path: str, roots: list[str]) -> bool:
    """`path` (already resolved) is one of `roots` or inside one of them."""
    for root in roots:
        if path == root or path.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def resolve_weight_path(model_path: str, roots: list[str]) -> str:
    """The resolved directory to load from, or a 400 naming `model_path`. Symlinks and `..` are
    resolved before the check, and so is every checkpoint file (an index may name shards elsewhere,
    a shard may be a symlink)."""
    from tide.weights.loader import checkpoint_files

    if "\x00" in model_path:
        raise AdminAPIError("model_path must not contain a NUL character", param="model_path",
                            code="invalid_value")
    real = os.path.realpath(model_path)
    outside = (f"model_path {model_path!r} is outside the allowed weight roots {roots} "
               "(start the server with --allowed-weight-roots to allow another directory)")
    if not is_under(real, roots):
        raise AdminAPIError(outside, param="model_path", code="path_not_allowed")
    if not os.path.isdir(real):
        raise AdminAPIError(f"model_path {model_path!r} is not a directory", param="model_path",
                            code="invalid_value")
    try:
        files = checkpoint_files(real)
    except (ValueError, OSError) as e:
        raise AdminAPIError(str(e), param="model_path", code="invalid_value") from None
    for path in files:
        if not is_under(os.path.realpath(path), roots):
            raise AdminAPIError(
                f"model_path {model_path!r}: checkpoint file {os.path.basename(path)!r} resolves "
                f"outside the allowed weight roots {roots}", param="model_path",
                code="path_not_allowed")
    return real


def _one_payload(value: str | list[str], param: str) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise AdminAPIError(f"'{param}' must hold exactly one payload (this server has one "
                                f"rank), got {len(value)}", param=param, code="invalid_value")
        return value[0]
    return value


async def _parse(request: Request, model: type[M], allow_empty: bool = False) -> M:
    try:
        return await parse_body(request, model, allow_empty=allow_empty)
    except APIError as e:
        raise AdminAPIError.wrap(e) from None


def _result(out: ControlReqOutput, param: str | None = None, code: str = "update_failed",
            **extra: Any) -> JSONResponse:
    paused = int(out.data.get("num_paused_requests", 0))
    if not out.success:
        raise AdminAPIError(out.message or "failed", param=param, code=code,
                            num_paused_requests=paused)
    if "dead_replicas" in out.data:  # --dp-size: replicas that have died and were not called
        extra["dead_replicas"] = out.data["dead_replicas"]
    return JSONResponse({"success": True, "message": out.message, "num_paused_requests": paused,
                         **extra})


def _memory_tags(tags: list[str] | None) -> list[str] | None:
    """`tags` checked (a 400 naming `tags` for an empty list or an unknown tag); None stays None."""
    from tide.memory.occupation import parse_tags

    if tags is None:
        return None
    try:
        return parse_tags(tags)
    except ValueError as e:
        raise AdminAPIError(str(e), param="tags", code="invalid_value") from None


def add_admin_routes(app: FastAPI, tm: TokenizerManager, weight_roots: list[str],
                     metrics: ServerMetrics) -> None:
    """Register the handover routes on `app` (auth is enforced by the app's middleware)."""

    async def update(source: str, param: str,
                     make: Callable[[str], msgspec.Struct]) -> JSONResponse:
        start = time.perf_counter()
        out = await tm.admin(make)
        metrics.on_weight_update(source, out.success, time.perf_counter() - start)
        return _result(out, param=param)

    @app.post("/update_weights_from_disk", openapi_extra=json_body(UpdateWeightFromDiskInput))
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _parse(request, UpdateWeightFromDiskInput)
        path = resolve_weight_path(body.model_path, weight_roots)
        return await update("disk", "model_path", lambda r: UpdateWeightFromDiskReqInput(
            req_id=r, model_path=path, load_format=body.load_format, **weight_update_options(body)))

    @app.post("/update_weights_from_tensor",
              openapi_extra=json_body(UpdateWeightsFromTensorInput))
    async def update_weights_from_tensor(request: Request) -> Response:
        body = await _parse(request, UpdateWeightsFromTensorInput)
        payload = _one_payload(body.serialized_named_tensors, "serialized_named_tensors")
        return await update("tensor", "serialized_named_tensors",
                            lambda r: UpdateWeightsFromTensorReqInput(
            req_id=r, serialized_named_tensors=payload, load_format=body.load_format,
            **weight_update_options(body)))

    @app.post("/update_weights_from_ipc", openapi_extra=json_body(UpdateWeightsFromIPCInput))
    async def update_weights_from_ipc(request: Request) -> Response:
        body = await _parse(request, UpdateWeightsFromIPCInput)
        payload = _one_payload(body.serialized_buckets, "serialized_buckets")
        return await update("ipc", "serialized_buckets", lambda r: UpdateWeightsFromIPCReqInput(
            req_id=r, serialized_buckets=payload, **weight_update_options(body)))

    @app.post("/update_weights_from_distributed",
              openapi_extra=json_body(UpdateWeightsFromDistributedInput))
    async def update_weights_from_distributed(request: Request) -> Response:
        from tide.weights.update import parse_dtype

        body = await _parse(request, UpdateWeightsFromDistributedInput)
        for name in ("dtypes", "shapes"):
            if len(getattr(body, name)) != len(body.names):
                raise AdminAPIError(f"'{name}' has {len(getattr(body, name))} entries but 'names' "
                                    f"has {len(body.names)}", param=name, code="invalid_value")
        for i, dtype in enumerate(body.dtypes):
            try:
                parse_dtype(dtype)
            except ValueError as e:
                raise AdminAPIError(str(e), param=f"dtypes.{i}", code="invalid_value") from None
        for i, shape in enumerate(body.shapes):
            if any(not 0 <= d <= _MAX_DIM for d in shape):
                raise AdminAPIError(f"'shapes.{i}' has a dimension outside [0, 2**63 - 1]",
                                    param=f"shapes.{i}", code="invalid_value")
        return await update("distributed", "names", lambda r: UpdateWeightsFromDistributedReqInput(
            req_id=r, names=body.names, dtypes=body.dtypes, shapes=body.shapes,
            group_name=body.group_name, load_format=body.load_format, **weight_update_options(body)))

    @app.post("/init_weights_update_group",
              openapi_extra=json_body(InitWeightsUpdateGroupInput))
    async def init_weights_update_group(request: Request) -> Response:
        body = await _parse(request, InitWeightsUpdateGroupInput)
        if body.rank_offset >= body.world_size:
            raise AdminAPIError(f"'rank_offset' ({body.rank_offset}) must be below 'world_size' "
                                f"({body.world_size})", param="rank_offset", code="invalid_value")
        # Blocks (in a scheduler helper thread, not the loop) until the trainer joins as rank 0,
        # or fails once `timeout` seconds have passed.
        out = await tm.admin(lambda r: InitWeightsUpdateGroupReqInput(
            req_id=r, master_address=body.master_address, master_port=body.master_port,
            rank_offset=body.rank_offset, world_size=body.world_size,
            group_name=body.group_name, backend=body.backend, timeout=body.timeout))
        return _result(out, param="group_name", code="group_failed")

    @app.post("/destroy_weights_update_group",
              openapi_extra=json_body(DestroyWeightsUpdateGroupInput, required=False))
    async def destroy_weights_update_group(request: Request) -> Response:
        body = await _parse(request, DestroyWeightsUpdateGroupInput, allow_empty=True)
        out = await tm.admin(lambda r: DestroyWeightsUpdateGroupReqInput(
            req_id=r, group_name=body.group_name))
        return _result(out, param="group_name", code="group_failed")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"],
                   openapi_extra=json_body(GetWeightsByNameInput, required=False))
    async def get_weights_by_name(request: Request) -> Response:
        raw = await read_body(request)
        if request.method == "GET" and not raw.strip():
            try:
                body = GetWeightsByNameInput.model_validate(dict(request.query_params))
            except ValidationError as e:
                raise AdminAPIError.wrap(from_validation_error(e)) from None
        else:
            body = await _parse(request, GetWeightsByNameInput)
        out = await tm.admin(lambda r: GetWeightsByNameReqInput(
            req_id=r, name=body.name, truncate_size=body.truncate_size), timeout=60.0)
        if not out.success:
            raise AdminAPIError(out.message, param="name", code="invalid_value")
        return JSONResponse(out.data.get("values", []))

    @app.post("/update_weight_version", openapi_extra=json_body(UpdateWeightVersionInput))
    async def update_weight_version(request: Request) -> Response:
        body = await _parse(request, UpdateWeightVersionInput)
        out = await tm.admin(lambda r: UpdateWeightVersionReqInput(
            req_id=r, new_version=body.new_version, abort_all_requests=body.abort_all_requests))
        return _result(out, param="new_version", code="invalid_value",
                       new_version=out.data.get("new_version", body.new_version))

    @app.post("/pause_generation",
              openapi_extra=json_body(PauseGenerationInput, required=False))
    async def pause_generation(request: Request) -> Response:
        body = await _parse(request, PauseGenerationInput, allow_empty=True)
        out = await tm.admin(lambda r: PauseGenerationReqInput(req_id=r, mode=body.mode))
        return _result(out, param="mode", code="invalid_value")

    @app.post("/continue_generation",
              openapi_extra=json_body(ContinueGenerationInput, required=False))
    async def continue_generation(request: Request) -> Response:
        body = await _parse(request, ContinueGenerationInput, allow_empty=True)
        out = await tm.admin(lambda r: ContinueGenerationReqInput(
            req_id=r, torch_empty_cache=body.torch_empty_cache))
        return _result(out, param=None, code="invalid_value")

    def memory_occupation_route(path: str, message: type) -> None:
        """`path` takes `{tags}` and replies with the bytes each tag has released."""

        async def route(request: Request) -> Response:
            body = await _parse(request, MemoryOccupationInput, allow_empty=True)
            tags = _memory_tags(body.tags)
            out = await tm.admin(lambda r: message(req_id=r, tags=tags))
            return _result(out, code="memory_occupation_failed",
                           released_bytes=out.data.get("released_bytes", {}))

        app.post(path, name=path.strip("/"),
                 openapi_extra=json_body(MemoryOccupationInput, required=False))(route)

    memory_occupation_route("/release_memory_occupation", ReleaseMemoryOccupationReqInput)
    memory_occupation_route("/resume_memory_occupation", ResumeMemoryOccupationReqInput)

    @app.get("/dump_memory_timeline")
    async def dump_memory_timeline() -> Response:
        out = await tm.admin(lambda r: DumpMemoryTimelineReqInput(req_id=r), timeout=60.0)
        return JSONResponse(out.data.get("timeline", {}))

    @app.post("/start_profile", openapi_extra=json_body(StartProfileInput, required=False))
    async def start_profile(request: Request) -> Response:
        body = await _parse(request, StartProfileInput, allow_empty=True)
        out = await tm.admin(lambda r: StartProfileReqInput(
            req_id=r, num_steps=body.num_steps, activities=body.activities,
            record_shapes=body.record_shapes, with_stack=body.with_stack,
            profile_id=body.profile_id))
        return _result(out, param=out.data.get("param"), code="invalid_value")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        out = await tm.admin(lambda r: StopProfileReqInput(req_id=r), timeout=300.0)
        return _result(out, param=None, code="invalid_value", paths=out.data.get("paths", []))
