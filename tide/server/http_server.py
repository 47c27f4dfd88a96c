"""The FastAPI app: OpenAI routes, sglang-native routes, admin routes, auth and error handling.

Auth: with `--api-key` (one or several user keys), every route needs `Authorization: Bearer <key>`;
with `--admin-api-key`, admin routes (`ADMIN_PATHS`: `/flush_cache` and the handover routes of
`admin_api`, and `/abort_request` with `abort_all`) need that key (without one they need a user key,
if any). The admin key is accepted wherever a user key is. A missing or wrong key is a 401 and nothing
happens. The middleware also records the caller's identity (`tide.server.auth`): client rids are
scoped to it, so one user can neither abort nor block another's request; the admin key reaches every
scope.

Bounds: request bodies are limited in size and arrival time while they stream in
(`tide.server.limits`); every other bound of `RequestLimits` is checked by the routes before the work
it bounds. Errors are OpenAI-style bodies; an unexpected exception is a 500 with `Connection: close`.
Before auth, `BrowserGuard` refuses (403) requests a web page on another origin made a browser send,
and every JSON route takes only `Content-Type: application/json` (415 otherwise; see
`tide.server.security`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tide.sampling_params import SamplingParams
from tide.server.admin_api import ADMIN_HANDOVER_PATHS, add_admin_routes
from tide.server.auth import ADMIN, INTERNAL, PUBLIC, Caller, caller_of, key_identity, set_caller
from tide.server.errors import APIError, from_validation_error
from tide.server.limits import BodyLimitMiddleware
from tide.server.metrics import CONTENT_TYPE, ServerMetrics
from tide.server.native_api import NativeServing
from tide.server.openai_api import OpenAIServingChat, OpenAIServingCompletion, models_response
from tide.server.openapi import install_openapi, json_body
from tide.server.parse_api import parse_function_call, separate_reasoning
from tide.server.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    CompletionRequest,
    FlushCacheInput,
    GenerateReqInput,
    ParseFunctionCallInput,
    SeparateReasoningInput,
)
from tide.server.security import BrowserGuard, is_loopback_host
from tide.server.server_args import ServerArgs
from tide.server.tokenizer_manager import TokenizerManager
from tide.server.utils import parse_body
from tide.version import __version__

logger = logging.getLogger("tide.server")

ADMIN_PATHS = frozenset({"/flush_cache"}) | ADMIN_HANDOVER_PATHS


class Auth:
    """Bearer-token checks for normal and admin routes, and the caller's identity (`Caller`).

    `api_keys`: the user keys (any number; each is its own identity). `admin_api_key`: accepted
    wherever a user key is, required on admin routes when set."""

    def __init__(self, api_keys: tuple[str, ...] | list[str], admin_api_key: str | None) -> None:
        self.user_keys = {key: Caller(key_identity(key)) for key in api_keys}
        self.admin_api_key = admin_api_key

    @staticmethod
    def _token(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    @staticmethod
    def _matches(token: str | None, key: str | None) -> bool:
        return token is not None and key is not None and hmac.compare_digest(
            token.encode(), key.encode())

    def identify(self, request: Request, admin: bool) -> Caller:
        """The caller, or a 401 APIError unless the request carries a key good enough for the
        route. Every key is compared (in constant time), so timing tells nothing about which."""
        token = self._token(request)
        is_admin = self._matches(token, self.admin_api_key)
        user = None
        for key, caller in self.user_keys.items():
            if self._matches(token, key):
                user = caller
        if admin and self.admin_api_key is not None:
            ok = is_admin
        elif self.user_keys:
            ok = is_admin or user is not None
        else:
            ok = True
        if not ok:
            what = "an admin API key" if admin and self.admin_api_key else "an API key"
            if token is None:
                raise APIError(f"This route needs {what}: send 'Authorization: Bearer <key>'", 401,
                               code="missing_api_key")
            raise APIError(f"Incorrect API key provided; this route needs {what}", 401,
                           code="invalid_api_key")
        if is_admin:
            return ADMIN
        return user if user is not None else PUBLIC

    def check(self, request: Request, admin: bool) -> None:
        """Raise a 401 APIError unless the request carries a key good enough for the route."""
        self.identify(request, admin)


class InternalErrorMiddleware:
    """Pure ASGI middleware, the last resort for a bug: an exception no route handled becomes a 500
    with the OpenAI-style error body and `Connection: close`, so the client opens a fresh connection
    for its next request instead of finding this one reset. Once a response has started nothing more
    can be said; the exception goes on to the HTTP layer, which closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            error = APIError(f"Internal server error: {type(exc).__name__}", 500,
                             code="internal_error", close_connection=True)
            await error.response()(scope, receive, send)


class AuthMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects from the
    routes) that rejects requests without a good enough key before any route runs."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                caller = self.auth.identify(Request(scope), admin=scope["path"] in ADMIN_PATHS)
            except APIError as e:
                await e.response()(scope, receive, send)
                return
            set_caller(scope, caller)
        await self.app(scope, receive, send)


def create_app(args: ServerArgs, tm: TokenizerManager, metrics: ServerMetrics) -> FastAPI:
    """The app for one server; `tm` is started and stopped by the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        logger.info("serving %s on http://%s:%d", args.model_names[0], args.host, args.port)
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="tide", version=__version__, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible and sglang-compatible LLM serving (tide).")
    auth = Auth(args.api_keys, args.admin_api_key)
    completions = OpenAIServingCompletion(tm, args.model_names)
    chat = OpenAIServingChat(tm, args.model_names, tool_call_parser=args.tool_call_parser,
                             reasoning_parser=args.reasoning_parser)
    native = NativeServing(tm, incremental=args.incremental_streaming_output)
    started = int(time.time())

    app.state.limits = args.limits
    # Outermost first: InternalErrorMiddleware (a bug anywhere becomes a clean 500), then the body
    # bounds (`RequestLimits`), then auth.
    app.add_middleware(AuthMiddleware, auth=auth)
    app.add_middleware(BodyLimitMiddleware, limits=args.limits)
    # Refuses cross-origin browser requests (and, bound to loopback, DNS-rebinding ones) before any
    # body is read.
    app.add_middleware(BrowserGuard, loopback_only=is_loopback_host(args.host),
                       allowed_hosts=args.allowed_hosts)
    app.add_middleware(InternalErrorMiddleware)

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

    # ---- OpenAI
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return models_response(args.model_names, args.engine.model_path,
                               tm.model_info.context_len, started)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in args.model_names:
            raise APIError(f"The model '{model_id}' does not exist", 404, param="model",
                           code="model_not_found")
        return models_response([model_id], args.engine.model_path, tm.model_info.context_len,
                               started)["data"][0]

    @app.get("/")
    async def index() -> dict[str, Any]:
        return {"name": "tide", "version": __version__, "models": args.model_names,
                "openapi": "/openapi.json", "docs": "/docs", "health": "/health"}

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        return await completions.create(await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await parse_body(request, ChatCompletionRequest), request)

    # ---- native (sglang paths)
    @app.post("/generate", openapi_extra=json_body(GenerateReqInput))
    async def generate(request: Request) -> Response:
        return await native.generate(await parse_body(request, GenerateReqInput), request)

    @app.post("/parse_function_call", openapi_extra=json_body(ParseFunctionCallInput))
    async def parse_function_call_route(request: Request) -> JSONResponse:
        body = await parse_body(request, ParseFunctionCallInput)
        return JSONResponse(await asyncio.to_thread(
            parse_function_call, body, args.tool_call_parser, args.limits, max_parse_chars()))

    @app.post("/separate_reasoning", openapi_extra=json_body(SeparateReasoningInput))
    async def separate_reasoning_route(request: Request) -> JSONResponse:
        body = await parse_body(request, SeparateReasoningInput)
        return JSONResponse(await asyncio.to_thread(
            separate_reasoning, body, args.reasoning_parser, max_parse_chars()))

    def max_parse_chars() -> int:
        """The parse routes take texts as long as a prompt may be."""
        return args.limits.max_prompt_chars(tm.model_info.context_len)

    @app.post("/abort_request", openapi_extra=json_body(AbortReqInput))
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReqInput)
        if body.abort_all:
            auth.check(request, admin=True)
            count = await tm.abort_request(None)
        elif body.rid:
            # A rid lives in its owner's scope: others' requests are simply not found (0 aborted).
            caller = caller_of(request)
            count = await tm.abort_request(body.rid, owner=None if caller.admin else caller.identity)
        else:
            raise APIError("Give 'rid' or 'abort_all': true", 400, param="rid",
                           code="invalid_value")
        return JSONResponse({"success": True, "num_aborted": count})

    @app.api_route("/flush_cache", methods=["GET", "POST"],
                   openapi_extra=json_body(FlushCacheInput, required=False))
    async def flush_cache(request: Request) -> Response:
        if request.method == "POST":
            body = await parse_body(request, FlushCacheInput, allow_empty=True)
        else:
            try:
                body = FlushCacheInput.model_validate(dict(request.query_params))
            except ValidationError as e:
                raise from_validation_error(e) from None  # names the parameter at fault
        ok, message = await tm.flush_cache(body.timeout)
        if ok:
            return PlainTextResponse("Cache flushed.\n", status_code=200)
        return PlainTextResponse(f"Cache not flushed: {message}\n", status_code=400)

    add_admin_routes(app, tm, args.weight_roots, metrics)
    install_openapi(app)

    @app.get("/health")
    async def health() -> Response:
        if tm.dead or tm.shutting_down or not tm.responsive:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if tm.dead or tm.shutting_down or not tm.responsive:
            return Response(status_code=503)
        try:
            load = await tm.get_load(timeout=5.0)
        except (TimeoutError, APIError):
            return Response(status_code=503)
        if load.get("paused") is not None or load.get("memory_blocked"):
            # In a weight handover (paused, memory released, weights awaiting a refill): a
            # generation would wait or be refused by design, and a probe must not turn a training
            # step into a restart. The scheduler answers, so it lives.
            return Response(status_code=200)
        event = asyncio.Event()
        bos = tm.tokenizer.bos_token_id if tm.tokenizer is not None else None
        prompt = [bos if isinstance(bos, int) else 0]
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        state = tm.submit(prompt, params, event, rid=f"health-{tm.new_rid()}",
                          owner=INTERNAL.identity)
        try:
            await asyncio.wait_for(_until_finished(tm, state, event), timeout=20.0)
        except TimeoutError:
            return Response(status_code=503)
        finally:
            tm.abort_states([state], "health check timed out")
        ok = state.finished_reason is not None and state.finished_reason.get("type") != "abort"
        return Response(status_code=200 if ok else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": args.engine.model_path,
            "tokenizer_path": args.engine.tokenizer_path or args.engine.model_path,
            "served_model_name": args.model_names[0],
            "is_generation": True,
            "architecture": tm.model_info.raw.get("architecture"),
            "context_length": tm.model_info.context_len,
            "vocab_size": tm.model_info.vocab_size,
            "weight_version": tm.weight_version,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        info = args.public_dict()
        info.update(await tm.get_server_info())
        info["version"] = __version__
        info["num_http_requests_in_flight"] = len(tm.rid_to_state)
        return info

    @app.get("/metrics")
    async def get_metrics() -> Response:
        try:
            metrics.set_load(await tm.get_load())
        except (TimeoutError, APIError):
            pass  # counters and histograms are still worth serving
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _until_finished(tm: TokenizerManager, state: Any, event: asyncio.Event) -> None:
    while not state.finished:
        await tm.wait(event)
