"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every route reports bad input by raising `APIError`; the app turns it into a JSON response with the
status it carries. Pydantic validation errors become 400s naming the offending field (`param` is the
dotted path, e.g. `messages.0.content`).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """An error to report to the client (never a server crash)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.err_type = err_type or _default_type(status_code)
        # Answer with `Connection: close` (the connection's state is unknown or not worth keeping).
        self.close_connection = close_connection

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else {}
        if self.close_connection:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def _default_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


# Loc parts pydantic adds for union members and wrappers ("str", "list[int]", "function-after[...]").
_TAG_RE = re.compile(r"[\[\]\-]|^(str|int|float|bool|list|dict|none|literal|tuple|union)$")


def from_validation_error(err: ValidationError, prefix: str | None = None) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field."""
    errors = err.errors(include_url=False)
    first = errors[0]
    param = _loc_to_param(first["loc"])
    if prefix:
        param = f"{prefix}.{param}" if param else prefix
    union_tags = _union_tags(errors, first["loc"])
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        return APIError(message, 400, param=param, code="unknown_field")
    if first["type"] == "missing":
        return APIError(f"Missing required parameter: '{param}'", 400, param=param,
                        code="missing_required_parameter")
    if union_tags:  # a union: list the accepted shapes rather than one branch's complaint
        param = _loc_to_param(first["loc"][: _first_tag_index(first["loc"])])
        if prefix:
            param = f"{prefix}.{param}" if param else prefix
        message = f"Invalid type for '{param}': expected one of {', '.join(union_tags)}"
        return APIError(message, 400, param=param, code="invalid_type")
    code = "invalid_type" if first["type"].endswith("_type") or first["type"] in (
        "int_from_float", "string_type", "bool_type", "list_type", "dict_type", "model_type",
    ) else "invalid_value"
    return APIError(f"Invalid value for '{param}': {first['msg']}", 400, param=param, code=code)


def _first_tag_index(loc: tuple[Any, ...]) -> int:
    for i, part in enumerate(loc):
        if isinstance(part, str) and _TAG_RE.search(part):
            return i
    return len(loc)


def _union_tags(errors: list[Any], loc: tuple[Any, ...]) -> list[str]:
    """The union members tried for the field of `loc` (empty if that field is no union)."""
    i = _first_tag_index(loc)
    if i == len(loc):
        return []
    head = loc[:i]
    tags = [e["loc"][i] for e in errors if e["loc"][:i] == head and len(e["loc"]) > i]
    return list(dict.fromkeys(t for t in tags if isinstance(t, str) and _TAG_RE.search(t)))


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif isinstance(part, str) and not _TAG_RE.search(part):
            parts.append(part)
    return ".".join(parts)
