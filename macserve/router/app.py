"""The router's HTTP side: one OpenAI- and Anthropic-compatible endpoint for every profile.

    GET  /health                 the router's own: 200 {"status": "ok", "models": N}
    GET  /metrics                the router's Prometheus counters (prom.py)
    GET  /metrics/{profile}      that profile's server's /metrics, passed through; 503 if
                                 it is not running (a scrape starts nothing)
    GET  /v1/models              every profile: state (running, starting, stopping, stopped),
                                 share, resident, TTL, aliases; OpenAI's and Anthropic's list fields
    GET  /v1/models/{id}         one of them (a profile name or an alias), or 404
    POST /v1/...                 routed by the body's `model` (profile name or alias) to that
                                 profile's server, same path and query: chat/completions,
                                 completions, messages, messages/count_tokens, embeddings ...

Forwarding (holding a request while its model starts, streaming, renaming, the error event of a
stream whose server died) is proxy.py's; which profile runs is pool.py's; the web page's routes
are ui.py's.

Failures the router answers itself are RouteErrors (web.errors.HttpError), rendered in the
shape of the API the path belongs to (web/dialects.py: Anthropic's for /v1/messages*, as
`serve` renders its own), with `x-should-retry: false` unless retrying can help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import listen
from ..services import providers
from ..web import dialects, guards
from . import prom, ui
from .errors import RouteError
from .model import Settings, size
from .pool import Pool
from .proxy import READ_TIMEOUT, Proxy

log = logging.getLogger("macserve.router")
THREADS = 64  # starts and health waits block a thread each; status reads must not queue behind


class Router:
    """The routes: the router's own (health, metrics, models) here, `/v1/...` forwarded by
    the proxy, `/ui` by ui.py."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.settings = pool.settings
        self.proxy = Proxy(pool)
        self.forward = self.proxy.forward  # POST /v1/...: routed by the body's `model`
        self.metrics = self.proxy.metrics  # what the proxy streamed (the page's live figures)

    # ---- keys ----------------------------------------------------------------------------------
    # The client's key is checked before any route by web.guards.ApiKeyGate (create_app).

    def keyed_open(self) -> list[str]:
        """Profiles with their own API_KEY that this router, having no key of its own, would
        hand to anyone who reaches it (it sends their key upstream): refused unless
        --allow-unauthenticated says so."""
        s = self.settings
        if s.api_key or s.allow_unauthenticated:
            return []
        return sorted(n for n, m in self.pool.models.items() if m.api_key)

    # ---- the router's own ------------------------------------------------------------------------

    async def prometheus(self, request: Request) -> Response:
        """The router's own counters (router/prom.py)."""
        return Response(self.pool.prom.render(), media_type=prom.CONTENT_TYPE)

    async def profile_metrics(self, request: Request) -> Response:
        """A profile's server's own /metrics, passed through; never starts a stopped one."""
        self.pool.refresh()
        try:
            m = self.pool.resolve(request.path_params["profile"])
            if self.pool.state_of(m) != "running":
                raise RouteError(503, f"model {m.name} is not running", "unavailable_error")
            headers = [("authorization", f"Bearer {m.api_key}")] if m.api_key else []
            url = providers.base_url(m.profile) + "/metrics"
            r = await self.proxy.http.get(url, headers=headers, timeout=10.0)
        except RouteError as e:
            return dialects.error_response(e, request.url.path)
        except httpx.HTTPError as e:
            err = RouteError(502, f"model {m.name}: /metrics: {e}", "server_error")
            return dialects.error_response(err, request.url.path)
        ctype = r.headers.get("content-type", prom.CONTENT_TYPE)
        return Response(r.content, status_code=r.status_code, media_type=ctype)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": len(self.pool.models)})

    async def models(self, request: Request) -> Response:
        data = [_entry(x) for x in await self.pool.listing()]
        b = self.pool.budget
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "budget": {
                    "budget_bytes": b.budget_bytes,
                    "source": b.source,
                    "free_bytes": await asyncio.to_thread(self.pool.ops.free_bytes),
                },
            }
        )

    async def model(self, request: Request) -> Response:
        self.pool.refresh()
        try:
            name = self.pool.resolve(request.path_params["model_id"]).name
        except RouteError as e:
            return dialects.error_response(e, request.url.path)
        return JSONResponse(next(_entry(x) for x in await self.pool.listing() if x["id"] == name))


def _entry(x: dict) -> dict:
    """A /v1/models entry: OpenAI's fields, Anthropic's (its client lists these), the pool's."""
    return {
        "id": x["id"],
        "object": "model",
        "created": 0,
        "owned_by": "macserve",
        "type": "model",
        "display_name": x["id"],
        "created_at": "1970-01-01T00:00:00Z",
        **{k: v for k, v in x.items() if k != "id"},
    }


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug of ours, in the shared error format (its traceback goes to the log)."""
    e = RouteError(500, f"internal error in the router: {type(exc).__name__}")
    return dialects.error_response(e, request.url.path)


def create_app(settings: Settings):
    """The router's ASGI app: the routes behind the Host check (bound to loopback) and the
    API key (web/guards.py, as `serve` has them). `.router` is the Router."""
    pool = Pool(settings)
    router = Router(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(THREADS))
        # No read timeout: a long answer may take minutes between its first and last byte.
        router.proxy.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        await pool.reap()  # what already runs, counted from now
        keyed = router.keyed_open()
        if keyed:
            log.warning(
                "profiles with their own API key: %s; this router has no --api-key, so it "
                "refuses requests for them (401): give it --api-key (or MACSERVE_API_KEY), or "
                "pass --allow-unauthenticated to serve them to anyone who reaches it",
                ", ".join(keyed),
            )
        reaper = asyncio.ensure_future(pool.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            await router.proxy.http.aclose()
            pool.unpublish()

    app = Starlette(
        routes=[
            Route("/health", router.health),
            Route("/metrics", router.prometheus),
            Route("/metrics/{profile:path}", router.profile_metrics),
            Route("/v1/models", router.models),
            Route("/v1/models/{model_id:path}", router.model),
            Route("/v1/{rest:path}", router.forward, methods=["POST"]),
            *ui.routes(router),
        ],
        exception_handlers={Exception: _server_error},
        lifespan=lifespan,
    )
    outer: Any = guards.ApiKeyGate(  # an ASGI app, given `.router` below
        app, settings.api_key, public=("/health", *ui.PUBLIC), cookie_prefix=ui.PREFIX
    )
    if guards.is_loopback(settings.host):
        outer = guards.HostGate(outer, guards.loopback_hosts(settings.host, settings.allowed_hosts))
    outer.router = router
    return outer


def run(settings: Settings) -> None:
    """Serve in the foreground until SIGTERM / Ctrl-C. The models it started keep running (a
    restarted router finds them and counts them as used from then on)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request the router makes (health polls, /metrics scrapes, each
    # forwarded request) at INFO: the router's own lines and uvicorn's access lines say it.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = listen.bind(settings.host, settings.port)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        log_level="info",
        http=guards.timed_protocol(READ_TIMEOUT),
        timeout_graceful_shutdown=10,
    )
    log.info(
        "listening on http://%s:%d (ttl %s, budget %s, %s)",
        settings.host,
        settings.port,
        "never" if settings.ttl is None else f"{settings.ttl:g}s",
        size(app.router.pool.budget.budget_bytes),
        app.router.pool.budget.source,
    )
    uvicorn.Server(config).run(sockets=[sock])
