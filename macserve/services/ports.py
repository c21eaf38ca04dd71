"""Ports: which a profile may take (free on its host, no other profile's), and picking one.

A port is checked twice: against the other profiles (which may be stopped, but will want it
back) and by binding it (another program may hold it).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import threading
from collections.abc import Mapping

from ..errors import MacserveError
from . import providers
from .profiles import ProfileStore

DEFAULT_PORT = 8080
# A name that does not answer within this is refused: a HOST the resolver hangs on would hang
# every later start, health probe and port check of the profile.
RESOLVE_TIMEOUT = 5.0


def _resolve(host: str, timeout: float) -> list[str]:
    """The addresses `host` resolves to, with a deadline (getaddrinfo has none of its own; a
    daemon thread is left to finish on its own if the resolver hangs)."""
    out: dict = {}

    def look():
        try:
            out["addrs"] = [
                a[4][0] for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            ]
        except (OSError, UnicodeError) as e:
            out["error"] = e

    t = threading.Thread(target=look, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise MacserveError(f"HOST {host!r} did not resolve within {timeout:.0f}s")
    if "error" in out:
        why = getattr(out["error"], "strerror", None) or str(out["error"])
        raise MacserveError(f"HOST {host!r} does not resolve: {why}")
    return out["addrs"]


def check_host(host: str, timeout: float = RESOLVE_TIMEOUT) -> None:
    """HOST is where this machine's server binds: an address (or a name resolving to one) of
    this machine, or a wildcard. Refused otherwise, before anything is written: a server given
    an address it cannot bind exits at once and the service would crash-loop. Other Macs of a
    multi-host profile go in HOSTS, which is not bound here."""
    bare = host.strip("[]")
    try:
        addrs = [str(ipaddress.ip_address(bare))]
    except ValueError:
        if all(c.isdigit() or c == "." for c in bare):
            raise MacserveError(
                f"HOST {host!r} is not an IP address (each part is 0..255)"
            ) from None
        addrs = _resolve(bare, timeout)
    for addr in addrs:
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        try:
            s.bind((addr, 0))
            return
        except OSError as e:
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
                return  # bindable in principle (e.g. EACCES): the port check says the rest
        finally:
            s.close()
    shown = host if addrs == [bare] else f"{host} ({', '.join(addrs)})"
    raise MacserveError(
        f"HOST {shown} is not an address of this machine, so a server cannot bind it: use "
        "127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of its own addresses "
        "(other Macs of a multi-host profile go in HOSTS)"
    )


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
    check_host(host)  # else each of the 1000 tries below would wait on the resolver
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
    check_host(host)
    if port in used:
        raise MacserveError(f"port {port} is already used by profile {used[port]}")
    if bind_check and not port_free(host, port):
        raise MacserveError(f"port {port} on {host} is in use by another program")
