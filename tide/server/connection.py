"""HTTP connections must send each request's headers within `header_read_timeout` seconds.

uvicorn bounds the idle time between requests on a kept-alive connection (`timeout_keep_alive`) but
not the time a request's headers take to arrive: a client that sends a header line every few seconds
holds its connection (and a file descriptor) forever, and enough of them exhaust the server's
descriptors. `header_deadline_protocol` gives uvicorn a protocol class (its httptools one, the
server's dependency) that closes a connection whose request has not finished its headers within the
deadline, counted from when the connection opened (first request) or from when the connection's
previous response ended (later requests: bytes that start no request, such as blank lines or the
unread rest of a body the route did not need, do not restart it). Nothing is answered: no request
exists yet to answer. Once the headers are in, the body has its own deadline (`body_read_timeout`,
`limits.BodyLimitMiddleware`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


def header_deadline_protocol(timeout: float) -> type[asyncio.Protocol] | str:
    """uvicorn's `http` protocol: its httptools protocol with the header deadline, or "auto" (no
    deadline, logged) where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        logger.warning("httptools is not installed: request headers have no read deadline "
                       "(header_read_timeout is not enforced)")
        return "auto"

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        """Closes the connection when a request's headers are not complete `timeout` seconds after
        the connection opened or its previous response ended (or a pipelined request began)."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a pipelined request; otherwise the deadline already runs

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # its headers are in: it starts now
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._arm()  # the next request's headers are due from now

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request's headers trickle in while an earlier response is still
                # being sent: that response is not cut; the deadline starts again.
                self._arm()
                return
            logger.info("closing a connection from %s: request headers incomplete after %g s",
                        self.client, timeout)
            self.transport.close()

    return HeaderDeadlineProtocol
