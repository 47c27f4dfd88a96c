"""What one request may cost, bounded before the server does work proportional to it.

`RequestLimits` holds every bound in one place (a frozen, validated dataclass; `tide serve` flags set
the ones operators tune, see docs/server.md "Limits"). `BodyLimitMiddleware` enforces the body bounds
while the body streams in:

- a `Content-Length` above the route's limit is answered 413 before a byte of the body is read;
- a body that grows past the limit (chunked, no length) is answered 413 as soon as it does, so the
  server never holds more than the limit of one body;
- a body that has not fully arrived `body_read_timeout` seconds after the request began is answered
  408 (a half-sent upload cannot hold a connection and its buffer forever).

A 413 or a 408 closes the connection once answered: the rest of the body is never read, so a
gigabyte upload costs the server one limit's worth of reading, not a gigabyte of event-loop time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tide.server.errors import APIError

MiB = 1 << 20

# Routes whose bodies carry weight payloads (serialized tensors); every other route gets the
# generation-sized limit.
WEIGHT_PAYLOAD_PATHS = frozenset({"/update_weights_from_tensor", "/update_weights_from_ipc"})


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one HTTP request. Every field is checked before the work it bounds is done."""

    # Bodies: generation and admin routes / weight-payload routes (WEIGHT_PAYLOAD_PATHS).
    max_request_body_bytes: int = 8 * MiB
    max_weight_update_body_bytes: int = 1024 * MiB
    # The whole body must have arrived this many seconds after the request started (else 408).
    body_read_timeout: float = 30.0
    # A request's headers must have arrived this many seconds after its connection opened (or, on
    # a kept-alive connection, after the request's first byte), else the connection is closed
    # (`connection.header_deadline_protocol`).
    header_read_timeout: float = 10.0
    # A text prompt longer than context_length * prompt_chars_per_token characters cannot fit the
    # context (no tokenizer packs that many characters per token on average) and is refused before
    # it is tokenized. Tokenizing costs about 200 bytes of memory per character, transiently.
    prompt_chars_per_token: int = 32
    # Threads that tokenize (and render chat templates) off the event loop.
    tokenizer_threads: int = 2
    # JSON bodies may nest at most this deep (objects and arrays).
    max_json_depth: int = 32
    # Sequences one request may ask for: prompts in a batch times `n`.
    max_batch_size: int = 4096
    max_n: int = 128
    # OpenAI `logprobs` (completions) and `top_logprobs` (chat); native `top_logprobs_num`.
    max_top_logprobs: int = 20
    max_top_logprobs_num: int = 100
    # Logprob entries one request may ask for: sequences x max new tokens x (1 + top logprobs), the
    # budget counted, not the tokens a request happens to produce. The HTTP process peaks at ~350
    # bytes an entry while it builds the response (measured: 6.6M entries, 2.3 GB) and the body
    # carries ~33 bytes an entry: at this default ~3 GB and a ~280 MB body at most. It takes, e.g.,
    # a rollout batch of 64 prompts x n=8 x 16k tokens with their token logprobs.
    max_logprob_entries: int = 1 << 23
    # JSON arrays and objects one body may hold: a body of many tiny lists costs the event loop
    # time per container (validation) long before a count check could refuse it.
    max_json_containers: int = 1 << 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_messages: int = 4096
    # A chat request's `tools` (OpenAI's own bound).
    max_tools: int = 128

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("body_read_timeout", "header_read_timeout"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 86400
                if not ok:
                    raise ValueError(f"{f.name} must be a number of seconds in (0, 86400], "
                                     f"got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def body_limit(self, path: str) -> int:
        """The most bytes a request body on `path` may have."""
        if path in WEIGHT_PAYLOAD_PATHS:
            return self.max_weight_update_body_bytes
        return self.max_request_body_bytes

    def max_prompt_chars(self, context_len: int) -> int:
        """The longest text prompt (in characters) worth tokenizing for a context of this size."""
        return context_len * self.prompt_chars_per_token


def check_at_most(value: int, limit: int, param: str, what: str = "") -> None:
    """A 400 naming `param` when `value` exceeds `limit`."""
    if value > limit:
        noun = f" {what}" if what else ""
        raise APIError(f"'{param}' may have at most {limit}{noun}, got {value}", 400, param=param,
                       code="limit_exceeded")


def check_logprob_entries(entries: int, limit: int, param: str) -> None:
    """A 400 naming `param` when a request's logprob entries (sequences x max new tokens x (1 + top
    logprobs), summed over its sequences) exceed `limit`: checked before the request is queued."""
    if entries > limit:
        raise APIError(
            f"'{param}': the request asks for {entries} logprob entries (sequences x max new tokens "
            f"x (1 + top logprobs)), more than this server's limit of {limit}; ask for fewer "
            "sequences, tokens or top logprobs", 400, param=param, code="limit_exceeded")


class BodyLimitMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware, which would hide client disconnects) bounding
    each request body's size and arrival time; see the module docstring."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.body_limit(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        await self.app(scope, _BoundedReceive(receive, limit, self.limits.body_read_timeout), send)


class _BoundedReceive:
    """`receive` that counts body bytes and enforces the read deadline until the body is complete;
    after that (disconnect listening) it passes messages through."""

    def __init__(self, receive: Receive, limit: int, timeout: float) -> None:
        self._receive = receive
        self._limit = limit
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._received = 0
        self._complete = False

    async def __call__(self) -> Message:
        if self._complete:
            return await self._receive()
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(self._receive(), remaining)
        except TimeoutError:
            raise APIError(f"The request body did not arrive within {self._timeout:g} s", 408,
                           code="request_timeout", close_connection=True) from None
        if message["type"] != "http.request":
            self._complete = True
            return message
        self._received += len(message.get("body", b""))
        if self._received > self._limit:
            raise _too_large(self._limit)
        if not message.get("more_body", False):
            self._complete = True
        return message


def _too_large(limit: int) -> APIError:
    # The connection closes after the answer: the rest of the body is never read (draining a
    # gigabyte through the event loop would cost every other client its latency).
    return APIError(f"The request body is larger than this route's limit of {limit} bytes", 413,
                    code="request_too_large", close_connection=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer rejects a malformed length itself
    return None
