"""The router's web page, /ui: the profiles, the memory budget, actions, live figures, logs and
a chat panel (docs/ui.md). Served by the router, under its rules:

    GET  /ui                  the page; without the router's key (when it has one), only a
                              prompt for it
    POST /ui/login            the key, checked, kept in an HttpOnly SameSite=Strict cookie
                              scoped to /ui (the API paths never accept the cookie)
    GET  /ui/events           SSE: the overview (HTML), new speed samples, new log lines
    POST /ui/action           start | stop | restart | set (CTX, KV): JSON, CSRF token
    POST /ui/chat             /v1/chat/completions through the router's own forwarding
    GET  /ui/static/NAME      the page's CSS and script, shipped in the package

The key gate and the Host check in front of all of it are the router's (app.create_app). A
state change is a POST carrying the page's CSRF token (`x-csrf-token`) from a page of the
same origin; a page of another site cannot read the token (no CORS here), and the browser
does not send it the cookie (SameSite=Strict).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from ..web import guards
from ..web.body import read_body
from ..web.errors import HttpError
from . import ui_ops, ui_page
from .errors import RouteError

PREFIX = "/ui"
PUBLIC = (PREFIX, PREFIX + "/login", PREFIX + "/static/")  # the gate lets these through
TICK = 1.0  # seconds between updates of the page
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
HEADERS = {
    # The page runs only its own script and styles, and is framed by no one.
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


class Page:
    def __init__(self, router):
        self.router, self.pool = router, router.pool
        self.key = router.settings.api_key
        self.csrf = secrets.token_urlsafe(24)  # per router process

    def _authed(self, request: Request) -> bool:
        if not self.key:
            return True
        return guards.key_given(dict(request.scope["headers"]), self.key, guards.COOKIE)

    def _check_post(self, request: Request) -> None:
        token = request.headers.get("x-csrf-token", "")
        if not hmac.compare_digest(token.encode(), self.csrf.encode()):
            raise HttpError(403, "missing or wrong CSRF token: reload the page")
        origin = request.headers.get("origin")
        if origin and origin.split("://", 1)[-1] != request.headers.get("host"):
            raise HttpError(403, f"a request from {origin} may not change this router")

    # ---- routes -----------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        if not self._authed(request):
            return HTMLResponse(ui_page.prompt(), headers=HEADERS)
        ov = await ui_ops.overview(self.pool)
        return HTMLResponse(ui_page.page(ov, self.csrf, bool(self.key)), headers=HEADERS)

    async def login(self, request: Request) -> Response:
        if not self.key:
            return RedirectResponse(PREFIX, 303)
        form = parse_qs((await read_body(request, 30.0, limit=4096)).decode(errors="replace"))
        given = (form.get("key") or [""])[0].strip()
        if not hmac.compare_digest(given.encode(), self.key.encode()):
            return HTMLResponse(ui_page.prompt("wrong key"), 401, headers=HEADERS)
        resp = RedirectResponse(PREFIX, 303)
        resp.headers["set-cookie"] = (
            f"{guards.COOKIE}={quote(given, safe='')}; Path={PREFIX}; HttpOnly; "
            "SameSite=Strict; Max-Age=31536000"
        )
        return resp

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        kind = STATIC_TYPES.get(name[name.rfind(".") :]) if "." in name else None
        f = ui_page.STATIC / name
        if kind is None or "/" in name or not f.is_file():
            return Response("not found", 404)
        return Response(f.read_bytes(), media_type=kind, headers={"cache-control": "no-cache"})

    async def action(self, request: Request) -> Response:
        try:
            self._check_post(request)
            d = json.loads(await read_body(request, 30.0, limit=65536) or b"{}")
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                raise HttpError(400, "expected {name, action, values}")
            out = await ui_ops.act(self.pool, d["name"], str(d.get("action")), d.get("values"))
        except ValueError:
            out = {"ok": False, "line": "refused: the body is not JSON"}
        except HttpError as e:  # RouteError too: a failed start, no room, unknown profile
            return JSONResponse({"ok": False, "line": f"refused: {e.message}"}, e.status)
        return JSONResponse(out)

    async def chat(self, request: Request) -> Response:
        try:
            self._check_post(request)
        except HttpError as e:
            return JSONResponse({"error": {"message": e.message}}, e.status)
        return await self.router.forward(request, "/v1/chat/completions")

    async def events(self, request: Request) -> Response:
        async def stream():
            seq, tails = 0, ui_ops.LogTails()
            while True:
                ov = await ui_ops.overview(self.pool)
                yield _event("overview", ui_page.overview_html(ov))
                seq, samples = self.router.metrics.since(seq)
                if samples:
                    yield _event("samples", json.dumps(samples))
                names = [r["name"] for r in ov["rows"]]
                lines = await asyncio.to_thread(tails.read, names)
                if lines:
                    yield _event("logs", json.dumps(lines))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_disconnected(request), TICK)
                    return

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"cache-control": "no-store"}
        )


def _event(name: str, data: str) -> bytes:
    lines = "".join(f"data: {ln}\n" for ln in data.split("\n"))
    return f"event: {name}\n{lines}\n".encode()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def routes(router) -> list[Route]:
    p = Page(router)
    return [
        Route(PREFIX, p.index),
        Route(PREFIX + "/", lambda r: RedirectResponse(PREFIX, 308)),
        Route(PREFIX + "/login", p.login, methods=["POST"]),
        Route(PREFIX + "/static/{name}", p.static),
        Route(PREFIX + "/events", p.events),
        Route(PREFIX + "/action", p.action, methods=["POST"]),
        Route(PREFIX + "/chat", p.chat, methods=["POST"]),
    ]


__all__ = ["PREFIX", "PUBLIC", "RouteError", "routes"]
