"""Who is calling: the identity a request's rids are scoped to.

The identity is the credential that authenticated the request, never the credential itself:

- a user key (`--api-key`, several allowed): `key-<first 12 hex digits of its SHA-256>`;
- the admin key (`--admin-api-key`): `admin`, and `Caller.admin` is True (it reaches every scope);
- no key (a server without `--api-key`, so anyone may call): everyone is the one identity `public`.

`AuthMiddleware` (in `http_server`) stores the `Caller` in the ASGI scope before any route runs;
routes read it with `caller_of(request)`.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

_SCOPE_KEY = "tide.caller"


@dataclass(frozen=True)
class Caller:
    """The identity a request's rids live under, and whether it authenticated with the admin key."""

    identity: str
    admin: bool = False


PUBLIC = Caller("public")
ADMIN = Caller("admin", admin=True)
INTERNAL = Caller("internal")  # the server's own requests (health probes)


def key_identity(key: str) -> str:
    """The loggable identity of a user key: a short hash, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def set_caller(scope: MutableMapping[str, Any], caller: Caller) -> None:
    scope[_SCOPE_KEY] = caller


def caller_of(request: Request) -> Caller:
    """The caller the auth middleware identified (`PUBLIC` where no middleware ran)."""
    return request.scope.get(_SCOPE_KEY, PUBLIC)
