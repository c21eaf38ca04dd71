"""The HTTP side: Starlette routes, the API-key gate, streaming, and uvicorn on a socket we bind.

Request flow: read + validate the body (protocol.py) -> tokenize (chat template) -> check the
context limit -> queue a Job on the worker -> stream its Steps out as SSE or collect them.
Every failure inside a request becomes a JSON error response; nothing reaches the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.caches import EngineOptions
from ..engine.model import read_config
from ..errors import MacserveError
from . import protocol as P
from .ranks import Ranks, follow
from .worker import END, Job, Worker

log = logging.getLogger("macserve.server")

MAX_BODY = 8 * 2**20  # far above any prompt that fits a context; stops a runaway upload early
MAX_QUEUE = 64  # beyond this a client gets 503 + Retry-After instead of an unbounded wait


@dataclass(frozen=True)
class Settings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    ctx: int | None = None  # None: the model's max_position_embeddings
    options: EngineOptions = field(default_factory=EngineOptions)  # cache + MTP, resolved
    split: tuple[int, ...] | None = None  # under mlx.launch: pipeline layers per rank (None: even)

    @property
    def model_id(self) -> str:
        return Path(self.model).expanduser().resolve().name


class ApiKeyGate:
    """Bearer-token check as plain ASGI middleware (a BaseHTTPMiddleware would buffer and
    hide client disconnects from the streaming responses). /health stays open for monitors."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.key or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.key.encode()
        ):
            body = P.error_body(
                "invalid or missing API key (send Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )
            return await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send
            )
        return await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- the engine state shared by the handlers ------------------------------------------------


class Engine:
    def __init__(self, settings: Settings, on_load_failed):
        self.settings = settings
        self.worker = Worker(settings.model, settings.options, on_load_failed, settings.split)

    @property
    def ctx(self) -> int:
        b = self.worker.bundle
        return self.settings.ctx or (b.max_context if b else None) or 0

    def bundle(self):
        if self.worker.error:
            raise P.ApiError(
                503, f"the model failed to load: {self.worker.error}", type_="unavailable_error"
            )
        if not self.worker.ready:
            raise P.ApiError(503, "the model is still loading", type_="unavailable_error")
        return self.worker.bundle


def _prompt_ids(bundle, req: P.GenRequest) -> list[int]:
    tok = bundle.tokenizer
    if req.kind == "chat":
        if not getattr(tok, "chat_template", None):
            raise P.ApiError(400, "this model has no chat template; use /v1/completions")
        try:
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja, role order rules)
            raise P.ApiError(
                400, f"the chat template rejected these messages: {e}", "messages"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if isinstance(req.prompt, list):
        vocab = bundle.config.get("vocab_size")
        if vocab and max(req.prompt) >= vocab:
            raise P.ApiError(400, f"prompt has a token id >= the vocabulary size {vocab}", "prompt")
        return list(req.prompt)
    # mlx-lm's rule: add BOS etc. unless the prompt already starts with the BOS text.
    bos = tok.bos_token
    return tok.encode(req.prompt, add_special_tokens=bos is None or not req.prompt.startswith(bos))


def _n(k: int) -> str:
    return f"{k} token" + ("" if k == 1 else "s")


def _budget(req: P.GenRequest, n_prompt: int, ctx: int) -> int:
    if n_prompt == 0:
        raise P.ApiError(400, "the prompt is empty after tokenization", "prompt")
    if n_prompt >= ctx:
        raise P.ApiError(
            400,
            f"the prompt is {_n(n_prompt)}; the context is {ctx}",
            "messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return ctx - n_prompt
    if n_prompt + req.max_tokens > ctx:
        raise P.ApiError(
            400,
            f"prompt ({_n(n_prompt)}) + max_tokens ({req.max_tokens}) is more "
            f"than the context ({ctx})",
            "max_tokens",
            code="context_length_exceeded",
        )
    return req.max_tokens


async def _read_body(request: Request) -> bytes:
    n = request.headers.get("content-length")
    if n and n.isdigit() and int(n) > MAX_BODY:
        raise P.ApiError(413, f"request body is over {MAX_BODY // 2**20} MB")
    chunks, size = [], 0
    async for c in request.stream():
        size += len(c)
        if size > MAX_BODY:
            raise P.ApiError(413, f"request body is over {MAX_BODY // 2**20} MB")
        chunks.append(c)
    return b"".join(chunks)


def _log_done(req: P.GenRequest, finish: str, stats: dict) -> None:
    log.info(
        "%s: %d prompt + %d completion tokens, %.1f tok/s, draft %d/%d accepted, %s",
        req.kind,
        stats.get("prompt_tokens", 0),
        stats.get("completion_tokens", 0),
        stats.get("generation_tps", 0.0),
        stats.get("accepted_tokens", 0),
        stats.get("draft_tokens", 0),
        finish,
    )


async def _watch_disconnect(request: Request, job: Job) -> None:
    # The body is read, so the next message uvicorn gives is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.disconnect()


async def _collect(request: Request, job: Job, req: P.GenRequest, rid: str, model: str) -> dict:
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    matcher = P.StopMatcher(req.stop)
    parts, finish, stats, hit = [], None, {}, False
    try:
        while finish is None:
            item = await job.out.get()
            if item is END:
                raise P.ApiError(500, "generation ended without a result", type_="server_error")
            if isinstance(item, Exception):
                raise P.ApiError(500, f"generation failed: {item}", type_="server_error")
            text, hit = matcher.feed(item.text)
            parts.append(text)
            stats = item.stats
            finish = "stop" if hit else item.finish_reason
        if not hit:
            parts.append(matcher.flush())  # held-back text that never became a stop string
    finally:
        watcher.cancel()
        job.cancel()  # done already, or a stop string matched: either way the worker may stop
    _log_done(req, finish, stats)
    return P.full_response(req, rid, model, "".join(parts), finish, stats)


async def _events(job: Job, req: P.GenRequest, rid: str, model: str):
    matcher = P.StopMatcher(req.stop)
    try:
        if req.kind == "chat":
            yield P.sse(P.chunk(req, rid, model, "", role=True))
        while True:
            item = await job.out.get()
            if item is END:
                break
            if isinstance(item, Exception):
                yield P.sse(P.error_body(f"generation failed: {item}", "server_error"))
                break
            text, hit = matcher.feed(item.text)
            finish = "stop" if hit else item.finish_reason
            if finish and not hit:
                text += matcher.flush()
            if text:
                yield P.sse(P.chunk(req, rid, model, text))
            if finish:
                yield P.sse(P.chunk(req, rid, model, None, finish, item.stats))
                if req.include_usage:
                    yield P.sse(P.usage_chunk(req, rid, model, item.stats))
                _log_done(req, finish, item.stats)
                break
        yield P.SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):
        # Starlette cancels the response when the client disconnects: stop that generation.
        job.disconnect()
        raise
    finally:
        job.cancel()


async def _generate(request: Request, kind: str) -> Response:
    eng: Engine = request.app.state.engine
    try:
        bundle = eng.bundle()
        body = P.parse_json(await _read_body(request))
        req = P.parse_chat(body) if kind == "chat" else P.parse_completion(body)
        ids = await run_in_threadpool(
            _prompt_ids, bundle, req
        )  # a long prompt must not stall other streams
        max_tokens = _budget(req, len(ids), eng.ctx)
        if eng.worker.queued() >= MAX_QUEUE:
            raise P.ApiError(
                503,
                f"{MAX_QUEUE} requests are already waiting; retry later",
                type_="unavailable_error",
            )
        job = Job(ids, max_tokens, req.temperature, req.top_p, req.seed, asyncio.get_running_loop())
        eng.worker.submit(job)
        rid = P.new_id(kind)
        model = eng.settings.model_id
        if req.stream:
            return _SSEResponse(_events(job, req, rid, model))
        return JSONResponse(await _collect(request, job, req, rid, model))
    except P.ApiError as e:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), e.status, headers=headers)
    except Exception as e:  # noqa: BLE001 - one request's bug must not become a dead server
        log.exception("request failed")
        return JSONResponse(
            P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500
        )


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def models(request: Request) -> Response:
    eng: Engine = request.app.state.engine
    data = {"id": eng.settings.model_id, "object": "model", "created": 0, "owned_by": "macserve"}
    if eng.worker.ready:
        data["meta"] = {"n_ctx": eng.ctx, "vocab_size": eng.worker.bundle.config.get("vocab_size")}
    return JSONResponse({"object": "list", "data": [data]})


async def health(request: Request) -> Response:
    eng: Engine = request.app.state.engine
    w = eng.worker
    if w.error:
        return JSONResponse({"status": "error", "error": w.error}, 503)
    if not w.ready:
        return JSONResponse({"status": "loading", "model": eng.settings.model_id}, 503)
    return JSONResponse(
        {
            "status": "ok",
            "model": eng.settings.model_id,
            "n_ctx": eng.ctx,
            "busy": w.busy,
            "queued": w.queued(),
            "served": w.served,
            "disconnected": w.disconnected,
            "failed": w.failed,
        }
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        P.error_body(exc.detail, kind), exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


def create_app(settings: Settings, on_load_failed=lambda why: None):
    engine = Engine(settings, on_load_failed)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.worker.start()  # loads the model while /health already answers 503
        yield

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    return ApiKeyGate(app, settings.api_key)


def _bind(host: str, port: int) -> socket.socket:
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
        follow(settings.model, settings.options, ranks, settings.split)
        return
    sock = _bind(settings.host, settings.port)
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_failed(why: str) -> None:
        failure.append(why)
        if server is not None:
            server.should_exit = True  # a server that can never answer should exit, not idle

    app = create_app(settings, on_load_failed)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3))
    log.info(
        "listening on http://%s:%d (model %s, loading)",
        settings.host,
        settings.port,
        settings.model,
    )
    server.run(sockets=[sock])
    if failure:
        raise MacserveError(f"could not load {settings.model}: {failure[0]}")
