"""Small helpers shared by the route handlers: body parsing, sampling params, SSE framing."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tide.sampling_params import SamplingParams
from tide.server.errors import APIError, from_validation_error, invalid_request
from tide.server.security import require_json_content_type

M = TypeVar("M", bound=BaseModel)

_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "stop_token_ids", "stop", "ignore_eos",
                    "skip_special_tokens", "seed", "n")


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    """Read a JSON object body into `model`; every problem is a 400 naming the field (a 415 for a
    body not declared `application/json`)."""
    require_json_content_type(request, allow_empty)
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            data: Any = {}
        else:
            raise APIError("The request body is empty; expected a JSON object", 400,
                           code="invalid_json")
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"The request body is not valid JSON: {e}", 400,
                           code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {_json_name(data)}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def make_sampling_params(params: dict[str, Any] | None, param_prefix: str,
                         names: dict[str, str] | None = None) -> SamplingParams:
    """`SamplingParams.from_dict`, with its ValueError turned into a 400 naming the field.

    `names` maps engine field names to the names the client used (e.g. max_new_tokens -> max_tokens).
    """
    try:
        return SamplingParams.from_dict(params)
    except (ValueError, TypeError) as e:
        message = str(e)
        field = next((f for f in _SAMPLING_FIELDS if message.startswith(f)), None)
        if message.startswith("unknown sampling_params"):
            unknown = [k for k in (params or {}) if k not in _SAMPLING_FIELDS]
            field = unknown[0] if unknown else None
        if names and field in names:
            client_name = names[field]
            message = message.replace(field, client_name, 1)
            param = client_name
        elif field is not None:
            param = f"{param_prefix}.{field}" if param_prefix else field
        else:
            param = param_prefix or None
        raise invalid_request(message, param, "invalid_value") from None


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
