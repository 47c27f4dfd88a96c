"""Checking that `tide serve` can listen on its address before it loads a model."""

from __future__ import annotations

import socket


def check_port_available(host: str, port: int) -> None:
    """Bind `host:port` the way uvicorn will (SO_REUSEADDR) and release it at once; ValueError naming
    the address when it is taken or cannot be bound, so a second server fails before its model loads.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port} ({e.strerror}); another server (a second "
                "`tide serve`?) is using the port: stop it or pass --port"
            ) from None
