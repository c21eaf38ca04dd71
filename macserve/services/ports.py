"""Ports: which a profile may take (free on its host, no other profile's), and picking one.

A port is checked twice: against the other profiles (which may be stopped, but will want it
back) and by binding it (another program may hold it).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping

from ..errors import MacserveError
from . import providers
from .profiles import ProfileStore

DEFAULT_PORT = 8080


def port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port and a server could bind it. SO_REUSEADDR as servers set it
    (so a closed connection in TIME_WAIT does not count), plus a connect, because with it
    macOS lets 127.0.0.1:P bind beside a listener on 0.0.0.0:P."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection((providers.url_host(host).strip("[]"), port), timeout=1.0),
    ):
        return False
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pick_port(host: str, used: set[int], start: int = DEFAULT_PORT) -> int:
    for port in range(start, start + 1000):
        if port not in used and port_free(host, port):
            return port
    raise MacserveError(f"no free port in {start}..{start + 999}; pass --port")


def ports_used(st: ProfileStore, but: str | None = None) -> dict[int, str]:
    """{port: profile} of every other profile."""
    out = {}
    for n in st.names():
        if n == but:
            continue
        with contextlib.suppress(MacserveError):
            out[st.load(n).port] = n
    return out


def check_port(host: str, port: int, used: Mapping[int, str], bind_check: bool = True) -> None:
    if port in used:
        raise MacserveError(f"port {port} is already used by profile {used[port]}")
    if bind_check and not port_free(host, port):
        raise MacserveError(f"port {port} on {host} is in use by another program")
