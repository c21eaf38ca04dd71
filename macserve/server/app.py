"""The HTTP side: Starlette routes, the API key, Host and CORS gates, and uvicorn on a socket
we bind (draining the engine on SIGTERM).

A generating route hands its request to serving.generate with its endpoint's dialect:
openai/ (/v1/chat/completions, /v1/completions), anthropic/ (/v1/messages) or responses/
(/v1/responses). Each dialect
folder parses its bodies into the neutral GenerationRequest (request.py) and renders the
job's events (events.py) in its own shapes; serving.py runs the request through the engine
between them. Errors outside a route (an unknown path, a wrong method) take the shape of the
API the path belongs to (web/dialects.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import listen
from ..engine.model import read_config
from ..errors import MacserveError
from ..web import dialects, guards
from ..web.errors import HttpError
from .anthropic import serving as anthropic
from .anthropic.render import models_entry
from .metrics import CONTENT_TYPE, CountRequests
from .openai import serving as openai
from .ranks import Ranks, follow
from .responses import serving as responses
from .serving import Engine, generate
from .settings import Settings

log = logging.getLogger("macserve.server")


async def chat_completions(request: Request) -> Response:
    return await generate(request, openai.CHAT)


async def completions(request: Request) -> Response:
    return await generate(request, openai.COMPLETION)


async def messages(request: Request) -> Response:
    return await generate(request, anthropic.MESSAGES)


async def create_response(request: Request) -> Response:
    return await generate(request, responses.RESPONSES)


def _model_entry(eng: Engine) -> dict:
    data = {
        "id": eng.settings.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "macserve",
        **models_entry(eng.settings.model_id),
    }
    if eng.worker.ready:
        data["meta"] = {"n_ctx": eng.ctx, "vocab_size": eng.worker.bundle.config.get("vocab_size")}
    return data


async def models(request: Request) -> Response:
    """OpenAI's list, with the fields Anthropic's clients read as well."""
    entry = _model_entry(request.app.state.engine)
    return JSONResponse(
        {
            "object": "list",
            "data": [entry],
            "has_more": False,
            "first_id": entry["id"],
            "last_id": entry["id"],
        }
    )


async def model(request: Request) -> Response:
    entry = _model_entry(request.app.state.engine)
    if request.path_params["model_id"] != entry["id"]:
        raise HTTPException(
            404, f"no model {request.path_params['model_id']!r}; this server has {entry['id']}"
        )
    return JSONResponse(entry)


async def health(request: Request) -> Response:
    eng: Engine = request.app.state.engine
    w = eng.worker
    if w.error:
        return JSONResponse({"status": "error", "error": w.error}, 503)
    if not w.ready:
        return JSONResponse({"status": "loading", "model": eng.settings.model_id}, 503)
    return JSONResponse(
        {
            "status": "ok" if w.drain_until is None else "shutting_down",
            "model": eng.settings.model_id,
            "n_ctx": eng.ctx,
            "busy": w.busy,
            "decoding": w.in_flight(),
            "queued": w.queued(),
            "served": w.served,
            "disconnected": w.disconnected,
            "failed": w.failed,
            "max_batch": w.max_batch,
            "prompt_cache": w.prompt_cache.stats(),
            "kv_cache": w.kv_plan,
            "memory": _memory(w),
        }
    )


def _memory(w) -> dict:
    """The share's parts (--memory), or what the batch was sized against."""
    if w.share is not None:
        return {"source": "--memory", **w.share.as_dict()}
    if w.capacity is not None:
        return {"source": "the machine's memory budget", "budget_bytes": w.capacity.budget_bytes}
    return {"source": "none (--max-batch given, no --memory)", "baseline_bytes": w.baseline_bytes}


async def metrics(request: Request) -> Response:
    """Prometheus' text format; behind the API key like every route but /health."""
    w = request.app.state.engine.worker
    return Response(w.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) and a route's 404."""
    kind = "not_found_error" if exc.status_code == 404 else None
    err = HttpError(exc.status_code, exc.detail, type_=kind)
    resp = dialects.error_response(err, request.url.path)
    resp.headers.update(getattr(exc, "headers", None) or {})  # a 405's Allow
    return resp


async def _server_error(request: Request, exc: Exception) -> Response:
    err = HttpError(500, f"internal error: {type(exc).__name__}")
    return dialects.error_response(err, request.url.path)


def create_app(settings: Settings, on_load_failed=lambda why: None):
    engine = Engine(settings, on_load_failed)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.worker.start()  # loads the model while /health already answers 503
        yield

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/models/{model_id:path}", model),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    outer = guards.cors(guards.ApiKeyGate(app, settings.api_key), settings.allowed_origins)
    if guards.is_loopback(settings.host):
        names = {settings.host.strip("[]").lower(), *guards.LOOPBACK_NAMES, *settings.allowed_hosts}
        outer = guards.HostGate(outer, frozenset(n.lower() for n in names))
    outer = CountRequests(outer, engine.worker.metrics)  # outermost: 401s and 400s count too
    outer.engine = engine  # for run(): the drain on shutdown
    return outer


DISK_FLUSH_SECONDS = 5.0  # on SIGTERM, pending disk-cache writes get this long (launchd: 20 s)


class _Server(uvicorn.Server):
    """uvicorn, draining the engine first on SIGTERM / SIGINT: queued requests get 503 at
    once, running ones `grace` seconds to finish before their streams end with an error
    event. The socket stays open meanwhile, so a request that arrives during the drain gets a
    503 with Retry-After (a client or a router retries elsewhere) rather than a refused
    connection. uvicorn then closes the connections (its own timeout is a little longer),
    and the process exits 0: a drained stop is a clean one, not a death by signal."""

    def __init__(self, config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None):
        w = self.engine.worker
        log.info("shutting down: running requests get %g s to finish", self.grace)
        w.drain(self.grace)
        # The worker stops what is still running at the grace's end; a little more lets those
        # last steps and their error events be written before uvicorn stops listening.
        end = time.monotonic() + self.grace + 1.0
        while w.in_flight() > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        disk = w.prompt_cache.disk
        if disk is not None:  # the last requests' caches, for the turn after the restart
            await asyncio.to_thread(disk.flush, DISK_FLUSH_SECONDS)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal it caught once it has shut down (exit -15); the drain
        # above is the graceful stop SIGTERM asks for, so the exit status is 0.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def check_settings(settings: Settings) -> None:
    """Refuse what would only fail after the server is up: a missing folder, a --ctx the model
    cannot reach. (The cache spec refused a missing calibration when it was resolved.)"""
    if settings.ctx is not None and settings.ctx < 2:
        # a chat turn needs a prompt token and an answer token; click's range (1..) lets the
        # profile checks pass it, so the server says it at load, before the model loads
        raise MacserveError(f"--ctx {settings.ctx} holds no answer: at least 2 tokens")
    limit = read_config(settings.model).get("max_position_embeddings")
    if settings.ctx and limit and settings.ctx > limit:
        raise MacserveError(f"--ctx {settings.ctx} is more than the model's limit {limit}")
    if not settings.ctx and not limit:
        raise MacserveError(
            f"{settings.model}: config.json has no max_position_embeddings; pass --ctx"
        )


def run(settings: Settings) -> None:
    check_settings(settings)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ranks = Ranks()
    if ranks.rank > 0:  # under mlx.launch: only rank 0 answers HTTP
        follow(settings.model, settings.options, ranks, settings.split, settings.shutdown_grace)
        return
    sock = listen.bind(settings.host, settings.port)
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_failed(why: str) -> None:
        failure.append(why)
        if server is not None:
            server.should_exit = True  # a server that can never answer should exit, not idle

    app = create_app(settings, on_load_failed)
    config = uvicorn.Config(
        app,
        log_level="info",
        http=guards.timed_protocol(settings.read_timeout),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace) + 2,
    )
    server = _Server(config, app.engine, settings.shutdown_grace)
    log.info(
        "listening on http://%s:%d (model %s, loading)",
        settings.host,
        settings.port,
        settings.model,
    )
    server.run(sockets=[sock])
    if failure:
        raise MacserveError(f"could not load {settings.model}: {failure[0]}")
