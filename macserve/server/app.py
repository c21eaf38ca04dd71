"""The HTTP side: Starlette routes, streaming, and uvicorn on a socket we bind.

Request flow: read + validate the body (protocol.py, anthropic.py) -> tokenize (chat
template, tools: tools.py) -> check the context limit -> build the output constraint if the
request asks for one (grammar.py) -> queue a Job on the worker and wait for it to start ->
turn its Steps into text, tool calls and a finish (`_read`) -> stream them out as SSE or
collect them, in the shape of the API the request came through.
Every failure inside a request becomes a JSON error response; nothing reaches the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
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
from . import anthropic as A
from . import protocol as P
from . import tools
from .grammar import ConstraintSpec, json_grammar
from .metrics import CONTENT_TYPE, CountRequests
from .ranks import Ranks, follow
from .worker import END, Job, Worker

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


def _prompt_ids(bundle, req: P.GenRequest) -> list[int]:
    tok = bundle.tokenizer
    if req.kind == "chat":
        if not getattr(tok, "chat_template", None):
            raise HttpError(400, "this model has no chat template; use /v1/completions")
        fmt = tools.tool_format(tok)
        msgs, extra = tools.render(list(req.messages), req.tools if req.uses_tools else (), fmt)
        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja, role order rules)
            raise HttpError(
                400, f"the chat template rejected these messages: {e}", "messages"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if isinstance(req.prompt, tuple):
        vocab = bundle.config.get("vocab_size")
        if vocab and max(req.prompt) >= vocab:
            raise HttpError(400, f"prompt has a token id >= the vocabulary size {vocab}", "prompt")
        return list(req.prompt)
    # mlx-lm's rule: add BOS etc. unless the prompt already starts with the BOS text.
    bos = tok.bos_token
    return tok.encode(req.prompt, add_special_tokens=bos is None or not req.prompt.startswith(bos))


def _n(k: int) -> str:
    return f"{k} token" + ("" if k == 1 else "s")


def _budget(req: P.GenRequest, n_prompt: int, ctx: int, default: int) -> int:
    if n_prompt == 0:
        raise HttpError(400, "the prompt is empty after tokenization", "prompt")
    if n_prompt >= ctx:
        raise HttpError(
            400,
            f"the prompt is {_n(n_prompt)}; the context is {ctx}",
            "messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(default, ctx - n_prompt)
    if n_prompt + req.max_tokens > ctx:
        raise HttpError(
            400,
            f"prompt ({_n(n_prompt)}) + max_tokens ({req.max_tokens}) is more "
            f"than the context ({ctx})",
            "max_tokens",
            code="context_length_exceeded",
        )
    return req.max_tokens


def _constraint(worker: Worker, req: P.GenRequest, max_tokens: int) -> ConstraintSpec | None:
    """The grammar the answer must follow, checked by compiling it once (a schema llguidance
    cannot take is the client's 400, before the request queues)."""
    if req.json_schema is not None:
        grammar, param = json_grammar(req.json_schema), "response_format"
    elif req.uses_tools and req.tool_choice in ("required", "function"):
        fmt = tools.tool_format(worker.bundle.tokenizer)
        grammar = tools.forced_grammar(req.tools, fmt, req.tool_name, req.parallel_tool_calls)
        param = "tool_choice"
    else:
        return None
    spec = ConstraintSpec(grammar, param, max_tokens, req.temperature, req.top_p, req.top_k)
    worker.vocab.matcher(grammar, param)
    return spec


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


# ---- a job's Steps -> text, tool calls, a finish ------------------------------------------------


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls | stop_sequence (a stop string matched)
    stop_sequence: str | None
    stats: dict
    logprobs: list  # entries not yet sent with text


async def _read(job: Job, req: P.GenRequest, vocab, fmt, id_prefix: str) -> AsyncIterator:
    """("text", str, [TokenLogprob]) and ("call", ToolCall) events, then one Finish. Stop
    strings are cut (and never streamed, even split across tokens); with tools, calls are
    split out of the text. Raises HttpError when the job fails or the server stopped it."""
    matcher = P.StopMatcher(req.stop)
    splitter = tools.Splitter(fmt, req.tools, id_prefix) if req.uses_tools else None
    pending: list[P.TokenLogprob] = []
    stats: dict = {}
    while True:
        item = await job.out.get()
        if item is END:
            if job.ended_by == "deadline":
                finish, hit = "length", False  # the server's time limit cut it, as max_tokens would
                item = None
            elif job.ended_by == "shutdown":
                raise HttpError(
                    503, "the server is shutting down", type_="unavailable_error", retry_after=1
                )
            elif job.disconnected:
                return
            else:
                raise HttpError(500, "generation ended without a result")
        elif isinstance(item, Exception):
            raise HttpError(500, f"generation failed: {item}")
        else:
            stats = item.stats
            if item.logprob is not None:
                # Tokens the grammar masked have logprob -inf: not alternatives (nor JSON).
                top = tuple(
                    (vocab.token_bytes(t), v) for t, v in item.top_logprobs if math.isfinite(v)
                )
                lp = item.logprob if math.isfinite(item.logprob) else -1e30
                pending.append(P.TokenLogprob(vocab.token_bytes(item.token), lp, top))
            text, hit = matcher.feed(item.text)
            finish = "stop" if hit else item.finish_reason
        if finish and not hit:
            text = (text if item is not None else "") + matcher.flush()
        events = splitter.feed(text) if splitter else ([("text", text)] if text else [])
        if finish and splitter:
            events += splitter.flush()
        for ev in events:
            if ev[0] == "text":
                yield ("text", ev[1], pending)
                pending = []
            else:
                yield ev
        if finish:
            if splitter and splitter.calls and finish == "stop":
                finish = "tool_calls"
            elif hit:
                finish = "stop_sequence"
            yield Finish(finish, matcher.hit if hit else None, stats, pending)
            return


def _openai_finish(f: Finish) -> str:
    return "stop" if f.reason == "stop_sequence" else f.reason


async def _collect(job, req, rid, model, vocab, fmt, api: str) -> dict:
    parts, calls, lps = [], [], []
    async for ev in _read(job, req, vocab, fmt, "toolu_" if api == "anthropic" else "call_"):
        if isinstance(ev, Finish):
            lps += ev.logprobs
            _log_done(req, ev.reason, ev.stats)
            text = "".join(parts)
            if api == "anthropic":
                return A.message(rid, model, text, calls, ev.reason, ev.stop_sequence, ev.stats)
            return P.full_response(req, rid, model, text, _openai_finish(ev), ev.stats, calls, lps)
        if ev[0] == "text":
            parts.append(ev[1])
            lps += ev[2]
        else:
            calls.append(ev[1])
    raise HttpError(500, "generation ended without a result")


async def _openai_events(job, req, rid, model, vocab, fmt, path: str):
    n_calls, offset = 0, 0
    try:
        if req.kind == "chat":
            yield P.sse(P.chunk(req, rid, model, "", role=True))
        try:
            async for ev in _read(job, req, vocab, fmt, "call_"):
                if isinstance(ev, Finish):
                    f = _openai_finish(ev)
                    yield P.sse(P.chunk(req, rid, model, None, f, ev.stats, logprobs=ev.logprobs))
                    if req.include_usage:
                        yield P.sse(P.usage_chunk(req, rid, model, ev.stats))
                    _log_done(req, ev.reason, ev.stats)
                elif ev[0] == "text":
                    yield P.sse(P.chunk(req, rid, model, ev[1], logprobs=ev[2], offset=offset))
                    offset += len(ev[1])
                else:
                    c = P.chunk(req, rid, model, None, calls=[ev[1]], first_call=n_calls)
                    yield P.sse(c)
                    n_calls += 1
        except HttpError as e:
            yield dialects.error_event(e, path)  # the error, then [DONE]
            return
        yield P.SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):
        # Starlette cancels the response when the client disconnects: stop that generation.
        job.disconnect()
        raise
    finally:
        job.cancel()


async def _anthropic_events(job, req, rid, model, vocab, fmt, n_prompt: int, path: str):
    s = A.Stream(rid, model, n_prompt, job.cached_tokens)
    try:
        for b in s.start():
            yield b
        try:
            async for ev in _read(job, req, vocab, fmt, "toolu_"):
                if isinstance(ev, Finish):
                    out = s.finish(ev.reason, ev.stop_sequence, ev.stats)
                    _log_done(req, ev.reason, ev.stats)
                elif ev[0] == "text":
                    out = s.text(ev[1])
                else:
                    out = s.call(ev[1])
                for b in out:
                    yield b
        except HttpError as e:
            yield dialects.error_event(e, path)
    except (asyncio.CancelledError, GeneratorExit):
        job.disconnect()
        raise
    finally:
        job.cancel()


async def _prepare(request: Request, api: str, kind: str):
    """Body -> (request, prompt ids, token budget, constraint), or an HttpError."""
    eng: Engine = request.app.state.engine
    bundle = eng.bundle()
    eng.refuse_if_draining()
    body = P.parse_json(await read_body(request, eng.settings.read_timeout))
    if api == "anthropic":
        req = A.parse(body)
    else:
        req = P.parse_chat(body) if kind == "chat" else P.parse_completion(body)
    # Templates and grammars take a while on long inputs: off the event loop, so other
    # streams keep flowing.
    ids = await run_in_threadpool(_prompt_ids, bundle, req)
    max_tokens = _budget(req, len(ids), eng.ctx, eng.settings.default_max_tokens)
    spec = await run_in_threadpool(_constraint, eng.worker, req, max_tokens)
    return req, ids, max_tokens, spec


async def _generate(request: Request, kind: str, api: str = "openai") -> Response:
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
        )
        eng.worker.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            await _admitted(eng, job)
            vocab, model = eng.worker.vocab, eng.settings.model_id
            fmt = tools.tool_format(eng.worker.bundle.tokenizer)
            rid = A.new_id() if api == "anthropic" else P.new_id(kind)
            if not req.stream:
                try:
                    return JSONResponse(await _collect(job, req, rid, model, vocab, fmt, api))
                finally:
                    job.cancel()  # done, or a stop string matched: either way the worker may stop
        finally:
            watcher.cancel()
        if api == "anthropic":
            events = _anthropic_events(job, req, rid, model, vocab, fmt, len(ids), path)
            return _SSEResponse(events)
        return _SSEResponse(_openai_events(job, req, rid, model, vocab, fmt, path))
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
    return await _generate(request, "chat", api="anthropic")


async def count_tokens(request: Request) -> Response:
    eng: Engine = request.app.state.engine
    try:
        bundle = eng.bundle()
        body = P.parse_json(await read_body(request, eng.settings.read_timeout))
        req = A.count_tokens_request(body)
        ids = await run_in_threadpool(_prompt_ids, bundle, req)
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
        follow(settings.model, settings.options, ranks, settings.split)
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
