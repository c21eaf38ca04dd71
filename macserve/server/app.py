"""The HTTP side: Starlette routes, streaming, and uvicorn on a socket we bind.

Request flow: read + validate the body (the request's API, dialect.py: protocol.py or
anthropic.py) -> tokenize (chat template, tools: prepare.py, tools.py) -> check the context
limit -> build the output constraint if the request asks for one (prepare.py, grammar.py) ->
queue a Job on the worker and wait for it to start -> turn its Steps into text, tool calls
and a finish (answers.py) -> stream them out as SSE or collect them, in the shape of the API
the request came through (dialect.py).
Every failure inside a request becomes a JSON error response; nothing reaches the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import listen
from ..engine.caches import EngineOptions
from ..engine.model import read_config
from ..errors import MacserveError
from ..web import dialects, guards
from ..web.body import read_body
from ..web.errors import HttpError
from ..web.jsonbody import parse_object
from . import anthropic as A
from . import tools
from .dialect import ANTHROPIC, OPENAI
from .metrics import CONTENT_TYPE, CountRequests
from .prepare import constraint, prompt_ids, token_budget
from .ranks import Ranks, follow
from .worker import Job, Worker

log = logging.getLogger("macserve.server")


@dataclass(frozen=True)
class Settings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    ctx: int | None = None  # None: the model's max_position_embeddings
    options: EngineOptions = field(default_factory=EngineOptions)  # cache + MTP, resolved
    split: tuple[int, ...] | None = None  # under mlx.launch: pipeline layers per rank (None: even)
    default_max_tokens: int = 4096  # a request without max_tokens: min(this, the rest of ctx)
    max_queue: int = 64  # waiting requests beyond this get 503 + Retry-After
    request_timeout: float = 600.0  # seconds from arrival: queued -> 503, generating -> "length"
    read_timeout: float = 30.0  # seconds to send a request's headers, and then its body
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback's own
    shutdown_grace: float = 10.0  # on SIGTERM, seconds running requests get to finish
    max_batch: int | None = None  # sequences decoded together; None: sized at load (capacity.py)
    memory_budget: int | None = None  # bytes weights + caches may use (sizes max_batch)
    prompt_cache_bytes: int = 4 * 2**30  # the prompt cache's budget; 0: off
    prompt_cache_dir: Path | None = None  # the disk tier's folder; None: no disk tier
    prompt_cache_disk: int = 0  # the disk tier's bound in bytes; 0: off

    @property
    def model_id(self) -> str:
        return Path(self.model).expanduser().resolve().name


class _SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- the engine state shared by the handlers ------------------------------------------------


class Engine:
    def __init__(self, settings: Settings, on_load_failed):
        self.settings = settings
        self.worker = Worker(
            settings.model,
            settings.options,
            on_load_failed,
            settings.split,
            max_batch=settings.max_batch,
            prompt_cache_bytes=settings.prompt_cache_bytes,
            memory_budget=settings.memory_budget,
            ctx=settings.ctx,
            disk_dir=settings.prompt_cache_dir,
            disk_bytes=settings.prompt_cache_disk,
        )

    @property
    def ctx(self) -> int:
        b = self.worker.bundle
        return self.settings.ctx or (b.max_context if b else None) or 0

    def bundle(self):
        if self.worker.error:
            raise HttpError(
                503, f"the model failed to load: {self.worker.error}", type_="unavailable_error"
            )
        if not self.worker.ready:
            raise HttpError(
                503, "the model is still loading", type_="unavailable_error", retry_after=1
            )
        return self.worker.bundle

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved: its length times a job's average time,
        over the sequences that run at once."""
        w = self.worker
        return max(1, min(60, math.ceil((w.queued() + 1) * w.job_seconds / w.max_batch)))

    def full(self) -> bool:
        """Every batch slot taken and --max-queue requests waiting behind them."""
        w = self.worker
        return w.queued() + w.in_flight() >= w.max_batch + self.settings.max_queue

    def refuse_if_draining(self) -> None:
        if self.worker.drain_until is not None:
            raise HttpError(
                503, "the server is shutting down", type_="unavailable_error", retry_after=1
            )


async def _watch_disconnect(request: Request, job: Job) -> None:
    # The body is read, so the next message uvicorn gives is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.disconnect()


async def _admitted(eng: Engine, job: Job) -> None:
    """Wait for the worker to take the job: 503 if its deadline passes in the queue or the
    server starts shutting down first."""
    try:
        await asyncio.wait_for(job.started.wait(), max(0.0, job.deadline - time.monotonic()))
    except TimeoutError:
        job.cancel()
        raise HttpError(
            503,
            f"the request waited {eng.settings.request_timeout:g} s in the queue",
            type_="unavailable_error",
            retry_after=eng.retry_after(),
        ) from None
    if job.ended_by == "shutdown":
        raise HttpError(
            503, "the server is shutting down", type_="unavailable_error", retry_after=1
        )


async def _prepare(request: Request, api, kind: str):
    """Body -> (request, prompt ids, token budget, constraint), or an HttpError."""
    eng: Engine = request.app.state.engine
    bundle = eng.bundle()
    eng.refuse_if_draining()
    req = api.parse(parse_object(await read_body(request, eng.settings.read_timeout)), kind)
    # Templates and grammars take a while on long inputs: off the event loop, so other
    # streams keep flowing.
    ids = await run_in_threadpool(prompt_ids, bundle, req)
    max_tokens = token_budget(req, len(ids), eng.ctx, eng.settings.default_max_tokens)
    spec = await run_in_threadpool(constraint, eng.worker, req, max_tokens)
    return req, ids, max_tokens, spec


async def _generate(request: Request, kind: str, api=OPENAI) -> Response:
    eng: Engine = request.app.state.engine
    arrived = time.monotonic()
    path = request.url.path
    job = None
    try:
        req, ids, max_tokens, spec = await _prepare(request, api, kind)
        if eng.full():
            # 429, not 503: the server is well, only busy; clients (and proxies) back off
            # for Retry-After instead of marking it down.
            raise HttpError(
                429,
                f"{eng.settings.max_queue} requests are already waiting; retry later",
                type_="rate_limit_exceeded",
                code="queue_full",
                retry_after=eng.retry_after(),
            )
        job = Job(
            ids,
            max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            asyncio.get_running_loop(),
            deadline=arrived + eng.settings.request_timeout,
            top_k=req.top_k,
            constraint=spec,
            top_logprobs=req.top_logprobs if req.logprobs else None,
            mtp=req.mtp,
        )
        eng.worker.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            await _admitted(eng, job)
            vocab, model = eng.worker.vocab, eng.settings.model_id
            fmt = tools.tool_format(eng.worker.bundle.tokenizer)
            rid = api.new_id(kind)
            if not req.stream:
                try:
                    answer = await api.whole(job, req, rid, model, vocab, fmt, len(ids))
                    return JSONResponse(answer)
                finally:
                    job.cancel()  # done, or a stop string matched: either way the worker may stop
        finally:
            watcher.cancel()
        return _SSEResponse(api.stream(job, req, rid, model, vocab, fmt, len(ids), path))
    except HttpError as e:
        if job is not None:
            job.cancel()
        return dialects.error_response(e, path)
    except Exception as e:  # noqa: BLE001 - one request's bug must not become a dead server
        log.exception("request failed")
        if job is not None:
            job.cancel()
        err = HttpError(500, f"internal error: {type(e).__name__}: {e}")
        return dialects.error_response(err, path)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def messages(request: Request) -> Response:
    return await _generate(request, "chat", api=ANTHROPIC)


async def count_tokens(request: Request) -> Response:
    eng: Engine = request.app.state.engine
    try:
        bundle = eng.bundle()
        body = parse_object(await read_body(request, eng.settings.read_timeout))
        req = A.count_tokens_request(body)
        ids = await run_in_threadpool(prompt_ids, bundle, req)
        return JSONResponse({"input_tokens": len(ids)})
    except HttpError as e:
        return dialects.error_response(e, request.url.path)


def _model_entry(eng: Engine) -> dict:
    data = {
        "id": eng.settings.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "macserve",
        **A.models_entry(eng.settings.model_id),
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
        }
    )


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
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
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
