"""The listening socket both HTTP servers (`macserve serve`, `macserve router`) bind before
uvicorn starts, so a taken port is a clear error at once rather than a uvicorn traceback."""

from __future__ import annotations

import socket

from .errors import MacserveError


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket on host:port (IPv6 when the host has a colon), inheritable so a
    uvicorn worker can take it over."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host.strip("[]"), port))
    except OSError as e:
        s.close()
        raise MacserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    s.set_inheritable(True)
    return s
