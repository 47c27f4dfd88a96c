"""Small helpers shared by the route handlers: body parsing, sampling params, SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tide.sampling_params import UNSUPPORTED_FIELDS, SamplingParams
from tide.server.errors import APIError, from_validation_error, invalid_request
from tide.server.limits import RequestLimits, check_at_most
from tide.server.security import require_json_content_type

M = TypeVar("M", bound=BaseModel)

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init) + \
    UNSUPPORTED_FIELDS
_DEFAULT_LIMITS = RequestLimits()
_json_decoder = msgspec.json.Decoder()
_DIGIT_MAP = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))  # digit -> "1"
_LONG_DIGIT_RUN = b"1" * 19
_INT64_PROBLEM = "integers must be in [-2**63, 2**63 - 1]"


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    """Read a JSON object body into `model`; every problem is a 400 naming the field (a 415 for a
    body not declared `application/json`)."""
    require_json_content_type(request, allow_empty)
    raw = await read_body(request)
    if not raw.strip():
        if allow_empty:
            data: Any = {}
        else:
            raise APIError("The request body is empty; expected a JSON object", 400,
                           code="invalid_json")
    else:
        limits = getattr(request.app.state, "limits", _DEFAULT_LIMITS)
        data = load_json(raw, limits.max_json_depth, limits.max_json_containers)
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {_json_name(data)}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def rendered(render: Callable[[], Response], with_logprobs: bool) -> Response:
    """`render()`'s response; with logprobs (up to `max_logprob_entries` entries to build and
    encode) on a worker thread, while the event loop goes on serving others."""
    return await asyncio.to_thread(render) if with_logprobs else render()


def large_json_response(content: Any) -> Response:
    """`JSONResponse(content)` with the same bytes, encoded a piece of about `_PIECE` values at a
    time. `json.dumps` holds the GIL for a whole call, so one call on a 100 MB body (a request's
    logprobs) would stall the event loop for seconds even when run on another thread; between
    pieces the loop gets its turn."""
    return Response(_encode_pieces(content), media_type="application/json")


_PIECE = 1024  # values one json.dumps call of `_encode_pieces` encodes, roughly


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def _weight(value: Any, depth: int = 6) -> int:
    """Roughly how many values `value` holds, looking `depth` levels down: an object's values
    summed, a list's length times its first item's weight (the rows of a list are alike)."""
    if not isinstance(value, (list, dict)) or not value:
        return 1
    if depth == 0:
        return len(value)
    if isinstance(value, dict):
        return sum(_weight(v, depth - 1) for v in value.values())
    return len(value) * _weight(value[0], depth - 1)


def _encode_pieces(value: Any) -> bytes:
    if _weight(value) <= _PIECE:
        return _dumps(value)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _dumps(value)  # json.dumps renders other keys its own way (True -> "true")
        return b"{" + b",".join(_dumps(k) + b":" + _encode_pieces(v)
                                for k, v in value.items()) + b"}"
    if len(value) > _PIECE and not isinstance(value[0], dict):
        # Many rows (a sequence's per-token logprobs): slices of them per call.
        step = max(1, _PIECE * len(value) // _weight(value))
        return b"[" + b",".join(_dumps(value[i:i + step])[1:-1]
                                for i in range(0, len(value), step)) + b"]"
    return b"[" + b",".join(_encode_pieces(v) for v in value) + b"]"


async def read_body(request: Request) -> bytes:
    """The request's body; a client that hangs up before sending all of it gets a quiet 499 (there
    is nobody to answer, and nothing went wrong on this side: no 500, no traceback in the log)."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise APIError("The client closed the connection before sending the whole body", 499,
                       code="client_closed_request", close_connection=True) from None


def load_json(raw: bytes, max_depth: int, max_containers: int = 1 << 16) -> Any:
    """Strict JSON (RFC 8259: UTF-8, no NaN/Infinity, no lone UTF-16 surrogates) nested at most
    `max_depth` deep, with at most `max_containers` arrays and objects, whose integers fit in 64
    bits (no field takes more; larger ones would overflow torch and the wire), or a 400
    (`invalid_json`, or `invalid_value` naming the field). The checks after parsing run only when
    the text could fail them (more brackets than `max_depth` or `max_containers`, a run of 19
    digits), at C speed over long flat lists; the walk stops at the container past the bound, so a
    body of millions of tiny lists is refused after `max_containers` steps."""
    try:
        data = _decode(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (msgspec.DecodeError, ValueError) as e:
        raise _json_error(raw, e) from None
    brackets = raw.count(b"[") + raw.count(b"{")  # at least the containers: strings' count too
    long_digits = _LONG_DIGIT_RUN in raw.translate(_DIGIT_MAP)  # 2**63 has 19 digits
    if brackets > min(max_depth, max_containers) or long_digits:
        error = _check_parsed(data, max_depth, max_containers)
        if error is not None:
            raise error
    return data


def _decode(raw: bytes) -> Any:
    """msgspec's strict decode (recursion-safe: a RecursionError, never a crash) with the cyclic
    garbage collector paused: a body of a million small lists would otherwise trigger full
    collections over the whole process's objects while it is built (0.66 s against 0.06 s for
    1M empty lists). Parsed JSON holds no cycles, so nothing is left for the collector."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _json_decoder.decode(raw)
    finally:
        if paused:
            gc.enable()


def _check_parsed(data: Any, max_depth: int, max_containers: int) -> APIError | None:
    """The first nesting beyond `max_depth`, container past `max_containers` or integer outside
    int64 in parsed JSON, as a 400."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    containers = 1
    while stack:
        value, path, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            if _int64_problem(value) is not None:
                return _bad_value(path, _INT64_PROBLEM)
            continue
        if depth > max_depth:
            return _too_deep(max_depth)
        if isinstance(value, dict):
            entries: Any = value.items()
        else:
            types = set(map(type, value))
            if not types & {dict, list, int}:
                continue
            if types <= {int, bool} and -(2**63) <= min(value) and max(value) < 2**63:
                continue
            entries = enumerate(value)
        for key, item in entries:
            if isinstance(item, (dict, list)):
                containers += 1
                if containers > max_containers:
                    return APIError(f"The request body holds more than {max_containers} JSON "
                                    "arrays and objects", 400, code="invalid_json")
                stack.append((item, _join(path, key), depth + 1))
            elif _int64_problem(item) is not None:
                return _bad_value(_join(path, key), _INT64_PROBLEM)
    return None


def _too_deep(max_depth: int) -> APIError:
    return APIError(f"The request body nests JSON deeper than {max_depth} levels", 400,
                    code="invalid_json")


def _json_error(raw: bytes, err: Exception) -> APIError:
    """Explain why strict parsing failed; a value only lenient JSON allows is named by its path."""
    try:
        lenient = json.loads(raw)
    except (RecursionError, ValueError):
        return APIError(f"The request body is not valid JSON: {err}", 400, code="invalid_json")
    found = _first_lenient_value(lenient)
    if found is None:
        return APIError(f"The request body is not valid JSON: {err}", 400, code="invalid_json")
    return _bad_value(*found)


def _bad_value(path: str, problem: str) -> APIError:
    return APIError(f"Invalid value for '{path}': {problem}", 400, param=path or None,
                    code="invalid_value")


def _int64_problem(value: Any) -> str | None:
    if type(value) is int and not -(2**63) <= value < 2**63:
        return _INT64_PROBLEM
    return None


def _lenient_problem(value: Any) -> str | None:
    if isinstance(value, str) and not _is_unicode(value):
        return "the text holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN and infinite numbers are not JSON"
    return None


def _first_lenient_value(data: Any) -> tuple[str, str] | None:
    """(dotted path, problem) of a string with a lone surrogate or a non-finite number (or such an
    object key) in leniently parsed JSON."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key in value:
                what = _lenient_problem(key)
                if what is not None:
                    return path, f"an object key: {what}"
            stack.extend((item, _join(path, key)) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((item, _join(path, i)) for i, item in enumerate(value))
        elif (what := _lenient_problem(value)) is not None:
            return path, what
    return None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def make_sampling_params(params: dict[str, Any] | None, param_prefix: str,
                         names: dict[str, str] | None = None, *,
                         limits: RequestLimits, vocab_size: int) -> SamplingParams:
    """`SamplingParams.from_dict` plus the server's bounds (`limits`) and the vocabulary checks, with
    every problem a 400 naming the field.

    `names` maps engine field names to the names the client used (e.g. max_new_tokens -> max_tokens).
    """
    def param_of(field: str | None) -> str | None:
        if names and field in names:
            return names[field]
        if field is not None:
            return f"{param_prefix}.{field}" if param_prefix else field
        return param_prefix or None

    try:
        sp = SamplingParams.from_dict(params)
        sp.check_vocab(vocab_size)
    except (ValueError, TypeError) as e:
        message = str(e)
        # The whole leading word names the field ("no_stop_trim ..." is not about "n").
        lead = re.match(r"[a-z_]+", message)
        field = lead.group(0) if lead and lead.group(0) in _SAMPLING_FIELDS else None
        if message.startswith("unknown sampling_params"):
            unknown = [k for k in (params or {}) if k not in _SAMPLING_FIELDS]
            field = unknown[0] if unknown else None
        if names and field in names:
            message = message.replace(field, names[field], 1)
        raise invalid_request(message, param_of(field), "invalid_value") from None
    check_at_most(sp.n, limits.max_n, param_of("n") or "n", "sequences")
    check_at_most(len(sp.stop_strs), limits.max_stop_strings, param_of("stop") or "stop",
                  "strings")
    longest = max((len(s) for s in sp.stop_strs), default=0)
    check_at_most(longest, limits.max_stop_string_chars, param_of("stop") or "stop",
                  "characters per string")
    check_at_most(len(sp.stop_token_ids or ()), limits.max_stop_token_ids,
                  param_of("stop_token_ids") or "stop_token_ids", "token ids")
    return sp


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json_name(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return type(value).__name__
