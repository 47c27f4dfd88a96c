"""Small helpers shared by the route handlers: body parsing, sampling params, SSE framing."""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tide.sampling_params import SamplingParams
from tide.server.errors import APIError, from_validation_error, invalid_request
from tide.server.limits import RequestLimits, check_at_most

M = TypeVar("M", bound=BaseModel)

_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "stop_token_ids", "stop", "ignore_eos",
                    "skip_special_tokens", "seed", "n")
_DEFAULT_LIMITS = RequestLimits()
_json_decoder = msgspec.json.Decoder()


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    """Read a JSON object body into `model`; every problem is a 400 naming the field."""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            data: Any = {}
        else:
            raise APIError("The request body is empty; expected a JSON object", 400,
                           code="invalid_json")
    else:
        limits = getattr(request.app.state, "limits", _DEFAULT_LIMITS)
        data = load_json(raw, limits.max_json_depth)
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {_json_name(data)}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def load_json(raw: bytes, max_depth: int) -> Any:
    """Strict JSON (RFC 8259: UTF-8, no NaN/Infinity, no lone UTF-16 surrogates) nested at most
    `max_depth` deep, or a 400 (`invalid_json`, naming the field where it can)."""
    try:
        data = _json_decoder.decode(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (msgspec.DecodeError, ValueError) as e:
        raise _json_error(raw, e) from None
    # Brackets bound the depth from above (those inside strings count too): most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth_exceeds(data, max_depth):
        raise _too_deep(max_depth)
    return data


def _too_deep(max_depth: int) -> APIError:
    return APIError(f"The request body nests JSON deeper than {max_depth} levels", 400,
                    code="invalid_json")


def _depth_exceeds(data: Any, max_depth: int) -> bool:
    """Whether objects/arrays in `data` nest more than `max_depth` deep (iterative)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return True
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return False


def _json_error(raw: bytes, err: Exception) -> APIError:
    """Explain why strict parsing failed; a value only lenient JSON allows is named by its path."""
    try:
        lenient = json.loads(raw)
    except (RecursionError, ValueError):
        return APIError(f"The request body is not valid JSON: {err}", 400, code="invalid_json")
    found = _non_strict_value(lenient)
    if found is None:
        return APIError(f"The request body is not valid JSON: {err}", 400, code="invalid_json")
    path, what = found
    return APIError(f"Invalid value for '{path}': {what}", 400, param=path or None,
                    code="invalid_value")


def _non_strict_value(data: Any) -> tuple[str, str] | None:
    """The path of the first string holding a lone surrogate or of the first non-finite number."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path, "the text holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return path, "NaN and infinite numbers are not JSON"
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                if not _is_unicode(key):
                    return path, "a key holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
                stack.append((item, sub))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value))
    return None


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
        field = next((f for f in _SAMPLING_FIELDS if message.startswith(f)), None)
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
