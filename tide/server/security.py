"""What keeps web pages and network peers from driving the server.

- `require_json_content_type`: JSON routes take `Content-Type: application/json` only (415
  otherwise). A page on any site can make a browser POST text/plain, form or multipart bodies
  without asking (no CORS preflight); a JSON body only after a preflight, which this server never
  grants.
- `BrowserGuard`: refuses (403) before any route runs what a page on another origin makes a browser
  send: an `Origin` that is not this server's, or `Sec-Fetch-Site: cross-site | same-site` (sent
  by browsers also on plain GETs such as `<img src>`). Clients that are not browsers send neither.
  A server bound to loopback also refuses a `Host` that does not name a loopback address or
  `localhost`: a page on a name the attacker re-points at 127.0.0.1 (DNS rebinding) is same-origin
  to the browser, and only its `Host` tells it apart. `--allowed-hosts` adds names (a reverse
  proxy that forwards the client's `Host`).
- `is_loopback_host`: the bind policy of `ServerArgs` (admin routes without an admin key are served
  only on loopback unless `--allow-unauthenticated-admin`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tide.server.errors import APIError

JSON_MEDIA_TYPE = "application/json"
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1); False for wildcard
    addresses (`0.0.0.0`, `::`), other IPs and other names (names are not resolved)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_json_content_type(request: Request, allow_empty: bool = False) -> None:
    """Raise a 415 unless the request declares a JSON body (`application/json`, parameters such as
    `charset` allowed). Where `allow_empty`, a request that declares no body needs no type."""
    value = request.headers.get("content-type")
    if value is not None:
        if value.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE:
            return
    elif allow_empty and _declares_no_body(request):
        return
    got = f"got {value[:100]!r}" if value is not None else "the header is missing"
    raise APIError(f"This route takes a JSON body: send the header 'Content-Type: "
                   f"{JSON_MEDIA_TYPE}' ({got})", 415, param="Content-Type",
                   code="unsupported_media_type")


def _declares_no_body(request: Request) -> bool:
    headers = request.headers
    return "transfer-encoding" not in headers and headers.get("content-length", "0").strip() == "0"


def cross_origin_problem(headers: Headers) -> str | None:
    """Why a browser request from another origin is refused, or None if it is not one."""
    site = headers.get("sec-fetch-site", "").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site is {site!r}"
    origin = headers.get("origin")
    if origin is None:
        return None
    host = headers.get("host", "")
    parsed = _parse_origin(origin)
    if parsed is None or parsed[1] != _netloc(host, parsed[0]):
        return f"Origin {origin[:100]!r} is not this server ({host[:100]!r})"
    return None


def _parse_origin(origin: str) -> tuple[str, str] | None:
    """(scheme, host[:port]) of an `Origin` header; None for "null" (sandboxed frames, file://)
    and anything else that is not an origin."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return None
    if not parts.scheme or not parts.netloc:
        return None
    scheme = parts.scheme.lower()
    return scheme, _netloc(parts.netloc, scheme)


def _netloc(netloc: str, scheme: str) -> str:
    """`host[:port]` lower-cased, without the scheme's default port."""
    netloc = netloc.strip().lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default and netloc.endswith(f":{default}"):
        netloc = netloc[: -len(default) - 1]
    return netloc


def check_allowed_host(value: str) -> str:
    """An `allowed_hosts` entry, lower-cased: a host name (labels of letters, digits, `-` and `_`,
    as container service names have; at most 253 characters, a trailing dot dropped) or an IP
    literal, without a port; else ValueError."""
    name = value.strip().lower().removesuffix(".") if isinstance(value, str) else ""
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not name or len(name) > 253 or not all(_HOST_LABEL.fullmatch(p) for p in name.split(".")):
        raise ValueError(f"allowed_hosts: {str(value)[:64]!r} is not a host name or an IP address "
                         "(no port, scheme or path)")
    return name


def check_allowed_hosts(value: object) -> tuple[str, ...]:
    """A server's `allowed_hosts` (a list or tuple of `check_allowed_host` entries, or None for
    none), checked and normalised, without repeats; else ValueError."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError("allowed_hosts must be a list of host names")
    return tuple(dict.fromkeys(check_allowed_host(h) for h in value))


_HOST_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


def host_problem(headers: Headers, allowed: frozenset[str] = frozenset()) -> str | None:
    """Why a request to a loopback-bound server is refused for its `Host`, or None: the header must
    name `localhost`, a loopback IP or one of `allowed` (`check_allowed_host` forms), with any
    port."""
    host = headers.get("host")
    if host is None:
        return None  # HTTP/1.0 clients may send none; a browser always does
    name = host.strip()
    if name.startswith("["):  # [v6] or [v6]:port, nothing else after the bracket
        name, _, after = name[1:].partition("]")
        if after and not re.fullmatch(r":[0-9]*", after):
            return f"Host {host[:100]!r} is not a host name or address"
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.lower().removesuffix(".")  # "localhost." is the same name
    if is_loopback_host(name) or name.endswith(".localhost"):  # RFC 6761: always loopback
        return None
    if name in allowed:
        return None
    with contextlib.suppress(ValueError):  # an IPv6 literal in another spelling
        if str(ipaddress.ip_address(name)) in allowed:
            return None
    if re.fullmatch(r"[0-9.]+", name):  # IPv4 shorthand, e.g. curl's 127.1
        with contextlib.suppress(OSError):
            if ipaddress.IPv4Address(socket.inet_aton(name)).is_loopback:
                return None
    return (f"this server listens on loopback only, and Host {host[:100]!r} names another host "
            "(a DNS-rebinding page would); use localhost or 127.0.0.1, or start the server with "
            "--allowed-hosts NAME")


class BrowserGuard:
    """Pure ASGI middleware: a 403 for requests a page on another origin made a browser send;
    with `loopback_only` (the server is bound to loopback) also for a `Host` of another name than
    `allowed_hosts`."""

    def __init__(self, app: ASGIApp, loopback_only: bool = False,
                 allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.allowed_hosts = frozenset(check_allowed_hosts(allowed_hosts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            problem = cross_origin_problem(headers)
            if problem is None and self.loopback_only:
                problem = host_problem(headers, self.allowed_hosts)
            if problem is not None:
                err = APIError(f"Requests from web pages of other origins are refused: {problem}",
                               403, code="cross_origin_refused")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
