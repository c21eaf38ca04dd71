"""The router's forwarding: one request to the profile it names, and its answer back.

A request for a stopped profile is held while the pool starts it (or waits for memory); a
streaming request that has waited `keep_alive` seconds gets its 200 and a keep-alive every
`keep_alive` seconds until the server is up, in its own dialect, with a visible "loading"
note where the dialect has a place for reasoning (keepalive.py).
A /v1/responses request for a server without that API is translated (responses.py). Then the
request
goes upstream as it came (its key swapped for the profile's, `model` rewritten only for
mlx_lm.server) and the answer comes back as the server wrote it: status, headers, bytes (each
answer's `model` the name asked for: rename.py). A client that goes away closes the upstream
connection, which is how the servers notice. A stream whose server dies ends with an error
event in its own format (`data: {"error": ...}` then `data: [DONE]`; Anthropic's
`event: error`).

The routes that call it are app.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..services import providers
from ..web import anthropic_api, dialects, jsonbody
from ..web.body import read_body
from ..web.errors import HttpError
from . import keepalive
from .errors import RouteError
from .metrics import Meter, Metrics
from .model import Model, Settings
from .pool import Lease, Pool
from .rename import Renamer
from .responses import Translation

log = logging.getLogger("macserve.router")

# Not forwarded either way: hop-by-hop headers (RFC 9110 7.6.1), the length (re-framed), the
# client's key (replaced by the profile's), and what each server sets itself.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}
_REQUEST_DROP = _HOP | {"authorization", "x-api-key", "accept-encoding"}
_RESPONSE_DROP = _HOP | {"date", "server", "content-encoding"}
# A client has this long to send its request headers, and again its body (which may be up to
# web.body.MAX_BODY): far more than any client on a network needs, short enough that a
# half-sent request does not hold a connection for ever.
READ_TIMEOUT = 30.0


class _Leased(StreamingResponse):
    """A streamed answer that releases the model and closes the upstream response however it
    ends (done, client gone before or during the stream, error)."""

    def __init__(self, content, lease: Lease, cleanup=None, **kw):
        super().__init__(content, **kw)
        self.lease, self.cleanup = lease, cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                if self.cleanup is not None:
                    await self.cleanup()
            self.lease.release()


class Proxy:
    """Forwards requests to the pool's profiles (`http` is set while the app runs)."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.settings: Settings = pool.settings
        self.http: httpx.AsyncClient  # made and closed by the app's lifespan (app.create_app)
        self.metrics = Metrics()  # tokens/s and time to first token of what it streamed

    def _check_keyed(self, m: Model) -> None:
        """A profile with its own key is not handed to anyone who reaches a keyless router
        (app.Router.keyed_open warns of them at start)."""
        if m.api_key and not self.settings.api_key and not self.settings.allow_unauthenticated:
            raise RouteError(
                401,
                f"model {m.name} has its own API key, and this router has none: it would "
                "serve the model to anyone who reaches it. Start the router with --api-key "
                "(or MACSERVE_API_KEY), or with --allow-unauthenticated to forward anyway",
                "authentication_error",
                code="router_has_no_key",
            )

    async def forward(self, request: Request, path: str | None = None) -> Response:
        """Route one request; `path` is the upstream path (default: the request's own)."""
        path = path or request.url.path
        t0 = time.monotonic()  # time to first token counts from here, a start included
        try:
            body, m, stream, tr = await self._parse(request, path)
            self._check_keyed(m)
        except RouteError as e:
            return dialects.error_response(e, path)
        lease = self.pool.lease(m)
        handed_over = False
        waiting = asyncio.ensure_future(self.pool.ready(m))
        try:
            if stream and self.settings.keep_alive > 0:
                await _until(request, asyncio.wait({waiting}, timeout=self.settings.keep_alive))
                if not waiting.done():
                    handed_over = True
                    gen = self._kept_alive(waiting, m, request, body, path, t0, tr)
                    return _Leased(
                        gen,
                        lease,
                        _closer(gen),
                        media_type="text/event-stream",
                        headers={"cache-control": "no-cache"},
                    )
            await _until(request, waiting)
            # Until the headers: a plain answer sends them only once it is whole.
            resp = await _until(request, self._open(m, request, body, tr.path if tr else path))
            if _is_stream(resp):
                handed_over = True
                gen = self._pipe(resp, m, path, t0, request.state.asked, tr)
                return _Leased(
                    gen,
                    lease,
                    _closer(gen, resp),
                    status_code=resp.status_code,
                    headers=_headers(resp),
                )
            try:
                content = await _until(request, resp.aread())
            except httpx.HTTPError as e:
                raise RouteError(502, _gone(m, e)) from None
            finally:
                await resp.aclose()
            content = Renamer(request.state.asked).whole(content)
            if tr is not None:
                content = tr.whole(content, resp.status_code)
            return Response(content, resp.status_code, headers=_headers(resp))
        except RouteError as e:
            return dialects.error_response(e, path)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the work was cancelled
        finally:
            if not handed_over:
                waiting.cancel()
                lease.release()

    async def _parse(
        self, request: Request, path: str
    ) -> tuple[bytes, Model, bool, Translation | None]:
        try:
            body = await read_body(request, READ_TIMEOUT)
            data = jsonbody.parse_object(body)
        except HttpError as e:  # 400, 408, 413: said with the router's x-should-retry: false
            raise RouteError(e.status, e.message, e.type) from None
        self.pool.refresh()
        name = data.get("model")
        if not isinstance(name, str) or not name:
            known = ", ".join(sorted(self.pool.models)) or "none"
            raise RouteError(
                400,
                f"`model` is required: the router sends each request to the profile it names "
                f"(known: {known})",
                "invalid_request_error",
            )
        m = self.pool.resolve(name)
        request.state.asked = name  # answers carry it as their `model`, not the upstream's
        prov = m.provider
        if dialects.for_path(path) is anthropic_api and not prov.anthropic_api:
            raise RouteError(
                400,
                f"model {m.name} is served by {prov.label}, which has no Anthropic Messages "
                "API: use /v1/chat/completions, or serve it with PROVIDER=macserve or llama.cpp",
                "invalid_request_error",
            )
        if prov.upstream_model and data.get("model") != prov.upstream_model:
            data["model"] = prov.upstream_model
            body = json.dumps(data).encode()
        tr = None
        if path == "/v1/responses" and not prov.responses_api:
            # A server without the Responses API: asked in chat completions, answered back in
            # the Responses API's shapes (responses.py).
            tr = Translation(data, name)
            body = tr.chat
        return body, m, bool(data.get("stream")), tr

    async def _open(self, m: Model, request: Request, body: bytes, path: str) -> httpx.Response:
        """Send the request upstream; a connection that fails before any answer (the server
        died since it was found ready) is retried once, after waiting for it again."""
        url = providers.base_url(m.profile) + path
        if request.url.query:
            url += "?" + request.url.query
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP]
        headers.append(("accept-encoding", "identity"))  # bytes pass through as they are
        if m.api_key:
            headers += [("authorization", f"Bearer {m.api_key}"), ("x-api-key", m.api_key)]
        for attempt in (1, 2):
            req = self.http.build_request(request.method, url, content=body, headers=headers)
            try:
                return await self.http.send(req, stream=True)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                if attempt == 2:
                    raise RouteError(502, _gone(m, e)) from None
                log.warning("%s: %s; waiting for it again", m.name, e)
                m.ready_pid = None
                await _until(request, self.pool.ready(m))
        raise AssertionError("unreachable")

    async def _pipe(
        self,
        resp: httpx.Response,
        m: Model,
        path: str,
        t0: float,
        asked=None,
        tr: Translation | None = None,
    ):
        """The upstream stream as it comes (each event's `model` the name asked for; for a
        translated request, its chat chunks as Responses events); if the server goes away
        mid-stream, an error event (after a blank line if it was cut mid-event) instead of a
        silent end."""
        tail = b"\n\n"
        meter = Meter(m.name, t0)
        names = Renamer(asked)
        if tr is not None:
            yield tr.start()
        try:
            async for chunk in resp.aiter_raw():
                if chunk:
                    tail = (tail + chunk)[-2:]
                    meter.feed(chunk)
                    out = names.feed(chunk)
                    if tr is not None:
                        out = tr.feed(out)
                    if out:
                        yield out
            out = names.rest()
            if tr is not None:
                out = tr.feed(out + b"\n\n")
            if out:
                yield out
        except httpx.HTTPError as e:
            m.ready_pid = None
            log.warning("%s: stream cut: %s", m.name, e)
            cut = b"" if tail == b"\n\n" else b"\n" if tail.endswith(b"\n") else b"\n\n"
            yield cut + dialects.error_event(RouteError(502, _gone(m, e)), path)
        finally:
            self.metrics.add(meter.sample())  # also for a client gone mid-answer

    async def _kept_alive(
        self,
        waiting: asyncio.Future,
        m: Model,
        request,
        body,
        path: str,
        t0: float,
        tr: Translation | None = None,
    ):
        """Keep-alives while the model starts (keepalive.py: each dialect's, and a visible
        note in its place for reasoning), then its stream, after the note rewritten to
        continue the answer the note began (or the reason it failed)."""
        resp = None
        asked = request.state.asked
        kept = keepalive.for_request(path, asked, m.name, self.settings.loading_note)
        try:
            while not waiting.done():
                yield kept.tick(time.monotonic() - t0)
                await asyncio.wait({waiting}, timeout=self.settings.keep_alive)
            try:
                waiting.result()
                resp = await self._open(m, request, body, tr.path if tr else path)
            except RouteError as e:
                yield kept.feed(dialects.error_event(e, path)) + kept.rest()
                return
            except _ClientGone:
                return
            if not _is_stream(resp):  # the server refused the request (4xx): say why
                text = (await resp.aread()).decode(errors="replace")
                err = RouteError(resp.status_code, _message(text))
                yield kept.feed(dialects.error_event(err, path)) + kept.rest()
                return
            async for b in self._pipe(resp, m, path, t0, asked, tr):
                out = kept.feed(b)
                if out:
                    yield out
            out = kept.rest()
            if out:
                yield out
        finally:
            waiting.cancel()
            if resp is not None:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()


class _ClientGone(Exception):
    pass


async def _until(request: Request, aw):
    """Await `aw` unless the client disconnects first (then cancel it: an upstream request in
    it is closed, which the server sees as a disconnect)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise _ClientGone
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _closer(gen, resp: httpx.Response | None = None):
    async def close():
        await gen.aclose()
        if resp is not None:
            await resp.aclose()

    return close


def _is_stream(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith("text/event-stream")


def _headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _RESPONSE_DROP}


def _gone(m: Model, e: Exception) -> str:
    why = " ".join(str(e).split()) or type(e).__name__
    return (
        f"model {m.name}: its server went away ({why}); the next request waits for it to come back"
    )


def _message(text: str) -> str:
    try:
        d = json.loads(text)
        err = d.get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err or d)
    except (ValueError, AttributeError):
        return text.strip()[:500]
