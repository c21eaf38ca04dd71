"""What stands between the network and the routes: the API key, the Host check, CORS, and a
read timeout on request headers.

Each gate is plain ASGI (a BaseHTTPMiddleware would buffer responses and hide client
disconnects from the streams). Errors are JSON in the shape of the API the path belongs to.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

import h11
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_json(path: str, status: int, message: str, type_: str, code: str | None = None) -> bytes:
    if is_anthropic(path):
        body = {"type": "error", "error": {"type": type_, "message": message}}
    else:
        body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json.dumps(body).encode()


async def _send_error(send, path, status, message, type_, code=None, headers=()):
    body = error_json(path, status, message, type_, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ApiKeyGate:
    """The key as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
    clients). /health stays open for monitors, and CORS preflights (which carry no
    credentials) pass to the CORS layer."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    def _ok(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(token.strip().encode(), self.key.encode())

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or not self.key
            or scope["path"] == "/health"
            or scope["method"] == "OPTIONS"
            or self._ok(dict(scope["headers"]))
        ):
            return await self.app(scope, receive, send)
        await _send_error(
            send,
            scope["path"],
            401,
            "invalid or missing API key (send Authorization: Bearer KEY, or x-api-key: KEY)",
            "authentication_error",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )


class HostGate:
    """Against DNS rebinding: a server bound to loopback answers only requests whose Host
    names a loopback address (or one of `extra`). A web page whose name an attacker points at
    127.0.0.1 sends its own name as Host, and is refused."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope["headers"]).get(b"host")
        name = host_name(raw.decode("latin-1")) if raw is not None else None
        if name is None or name in self.allowed:
            return await self.app(scope, receive, send)
        await _send_error(
            send,
            scope["path"],
            400,
            f"Host {name!r} is not allowed: this server listens on loopback and answers "
            "localhost names only (add names with --allowed-hosts)",
            "invalid_request_error",
        )


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


def timed_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all
    arrived `header_timeout` seconds after its first byte (or after it opened, or after the
    previous response). uvicorn has a keep-alive timeout but none for a request it has begun
    to read, so a client can otherwise hold a connection open forever with half its headers."""

    class TimedH11(H11Protocol):
        _header_timer = None

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

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before or not self._waiting_for_headers():
                self._disarm()  # a request's headers are complete
            if self._waiting_for_headers() and data:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11
