"""What stands between the network and the routes: the API key, the Host check, CORS, a read
timeout on request headers, and a lingering close.

Each gate is plain ASGI (a BaseHTTPMiddleware would buffer responses and hide client
disconnects from the streams). Errors are HttpErrors in the shape of the API the path belongs
to (dialects.py).
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import unquote

import h11
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import dialects
from .errors import HttpError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _send_error(send, path: str, e: HttpError, headers: dict[str, str] | None = None):
    status, base, body = dialects.error_parts(e, path)
    # A refused request's body is not read: close (lingering) rather than read it.
    all_headers = {
        **base,
        **(headers or {}),
        "content-length": str(len(body)),
        "connection": "close",
    }
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode(), v.encode("latin-1")) for k, v in all_headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": body})


COOKIE = "macserve_key"  # where a web page keeps the key it was given (HttpOnly)


def cookie_value(headers: dict, name: str) -> str | None:
    """One cookie from the raw ASGI headers (bytes keys), or None."""
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return unquote(v)  # the page sets it quoted (a key may hold ; or =)
    return None


def key_given(headers: dict, key: str, cookie: str | None = None) -> bool:
    """The request carries `key`: `Authorization: Bearer KEY` (OpenAI clients), `x-api-key: KEY`
    (Anthropic clients), or, when `cookie` is named, that cookie (a web page's)."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get(b"x-api-key", b"").decode("latin-1")
    if not token and cookie:
        token = cookie_value(headers, cookie) or ""
    return hmac.compare_digest(token.strip().encode(), key.encode())


class ApiKeyGate:
    """The key as `Authorization: Bearer KEY` or `x-api-key: KEY`; under `cookie_prefix`, also
    as the `COOKIE` a web page was given (only there: a cookie rides along on requests other
    sites make, so the API paths never accept one). `public` paths pass without it: /health
    for monitors; a path ending in "/" is a prefix. CORS preflights (which carry no
    credentials) pass to the CORS layer."""

    def __init__(
        self,
        app,
        key: str | None,
        public: tuple[str, ...] = ("/health",),
        cookie_prefix: str | None = None,
    ):
        self.app, self.key, self.public, self.cookie_prefix = app, key, public, cookie_prefix

    def _public(self, path: str) -> bool:
        return any(path == p or (p.endswith("/") and path.startswith(p)) for p in self.public)

    def _cookie(self, path: str) -> str | None:
        p = self.cookie_prefix
        return COOKIE if p and (path == p or path.startswith(p + "/")) else None

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or not self.key
            or self._public(scope["path"])
            or scope["method"] == "OPTIONS"
            or key_given(dict(scope["headers"]), self.key, self._cookie(scope["path"]))
        ):
            return await self.app(scope, receive, send)
        e = HttpError(
            401,
            "invalid or missing API key (send Authorization: Bearer KEY, or x-api-key: KEY)",
            type_="authentication_error",
            code="invalid_api_key",
        )
        await _send_error(send, scope["path"], e, {"www-authenticate": "Bearer"})


class HostGate:
    """Against DNS rebinding: a server bound to loopback answers only requests whose Host
    names a loopback address (or one of `extra`). A web page whose name an attacker points at
    127.0.0.1 sends its own name as Host, and is refused."""

    def __init__(self, app, allowed: frozenset[str], option: str = "--allowed-hosts"):
        self.app, self.allowed, self.option = app, allowed, option

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope["headers"]).get(b"host")
        name = host_name(raw.decode("latin-1")) if raw is not None else None
        if name is None or name in self.allowed:
            return await self.app(scope, receive, send)
        e = HttpError(
            400,
            f"Host {name!r} is not allowed: this server listens on loopback and answers "
            f"localhost names only (add names with {self.option})",
        )
        await _send_error(send, scope["path"], e)


def loopback_hosts(bind: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The Host names a server bound to `bind` (a loopback address) answers to."""
    return frozenset(n.lower() for n in {bind.strip("[]"), *LOOPBACK_NAMES, *extra})


def host_name(host: str) -> str:
    """The name in a Host header, without the port; IPv6 literals without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def cors(app, origins: tuple[str, ...]):
    """Browsers may call the API from `origins` ("*": any). Off (no CORS headers) when empty."""
    if not origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        max_age=600,
    )


# A connection closed while the client is still sending its body: keep reading (and dropping)
# what arrives for this long, this much at most, or until the client is silent this long.
LINGER_SECONDS = 30.0  # nginx's lingering_time and lingering_timeout
LINGER_IDLE_SECONDS = 5.0
LINGER_BYTES = 64 * 2**20


class _LingeringTransport:
    """The transport uvicorn's protocol is handed: `close()` becomes a lingering close while the
    request body is still arriving. Closing a TCP socket with unread data in it sends a reset,
    and a reset can destroy a response the client has not read yet: a 413 answered from the
    Content-Length (or a 401, a 408) would reach the client as a dropped connection. So the
    write side is shut down after the response (the client reads it, then EOF), and what the
    client still sends is read and dropped until it closes, goes quiet, or a bound is reached
    (the "lingering close" of Apache and nginx). Everything else is the real transport."""

    def __init__(self, transport, protocol):
        self._t, self._p = transport, protocol

    def __getattr__(self, name):
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self._p._linger_timer is not None or self._t.is_closing()

    def close(self) -> None:
        p = self._p
        if p._linger_timer is not None or self._t.is_closing():
            return  # already closing; the linger ends by its own bounds
        if p.conn.their_state is not h11.SEND_BODY or not self._t.can_write_eof():
            self._t.close()
            return
        self._t.write_eof()  # after the buffered response
        self._t.resume_reading()  # uvicorn's flow control may have paused it
        p._linger_start()


def timed_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two additions.

    A header read timeout: a connection whose request headers have not all arrived
    `header_timeout` seconds after its first byte (or after it opened, or after the previous
    response) gets 408 and is closed. uvicorn has a keep-alive timeout but none for a request
    it has begun to read, so a client can otherwise hold a connection open forever with half
    its headers.

    A lingering close (`_LingeringTransport`): an answer given before the body was read
    reaches the client whole."""

    class TimedH11(H11Protocol):
        _header_timer = None
        _linger_timer = None
        _linger_until = 0.0
        _linger_bytes = 0

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    self.transport.write(
                        b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                        b"connection: close\r\n\r\n"
                    )
                self.transport.close()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        # ---- the lingering close ---------------------------------------------------------

        def _linger_start(self) -> None:
            self._disarm()
            self._linger_until = self.loop.time() + LINGER_SECONDS
            self._linger_rearm()

        def _linger_rearm(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            at = min(self._linger_until, self.loop.time() + LINGER_IDLE_SECONDS)
            self._linger_timer = self.loop.call_at(at, self._linger_end)

        def _linger_end(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            self._linger_timer = None
            self._real.close()

        # ---- asyncio's protocol ------------------------------------------------------------

        def connection_made(self, transport) -> None:
            self._real = transport
            super().connection_made(_LingeringTransport(transport, self))
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._linger_timer is not None:  # the rest of a body nobody will read
                self._linger_bytes += len(data)
                if self._linger_bytes > LINGER_BYTES:
                    self._linger_end()
                else:
                    self._linger_rearm()
                return
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before or not self._waiting_for_headers():
                self._disarm()  # a request's headers are complete
            if self._waiting_for_headers() and data:
                self._arm()

        def eof_received(self):
            if self._linger_timer is not None:
                self._linger_end()  # the client has sent all it will
                return None
            return super().eof_received()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

    return TimedH11
