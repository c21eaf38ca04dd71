"""One generation request's way through the engine, whichever API it speaks: read the body
and parse it (the dialect's request.py) -> tokenize and check the context (prepare.py) ->
queue a Job on the worker and wait for it to start -> the dialect renders the job's events
whole or as a stream. `Engine` is the state the handlers share (the worker, load and drain
state, the queue's limits). Every failure inside a request becomes an error response in
the request's API; nothing reaches the process."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..web import dialects
from ..web.body import read_body
from ..web.errors import HttpError
from ..web.jsonbody import parse_object
from . import thinking, tools
from .answers import Output
from .grammar import ConstraintSpec
from .prepare import constraint, prompt_ids, thinking_honoured, token_budget
from .request import GenerationRequest
from .settings import Settings
from .worker import Job, Worker

log = logging.getLogger("macserve.server")


class Dialect(Protocol):
    """What an endpoint's API does (openai/serving.py, anthropic/serving.py): parse a body
    once, name an answer, and render a job's events whole or as a stream."""

    def parse(self, body: dict) -> GenerationRequest: ...

    def new_id(self) -> str: ...

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict: ...

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int): ...


@dataclass(frozen=True)
class Prepared:
    """A request ready to queue: what it asked, its prompt's ids, its token budget within the
    context, and the grammar its output must follow (if any)."""

    req: GenerationRequest
    ids: list[int]
    max_tokens: int
    constraint: ConstraintSpec | None


class _SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, headers: dict[str, str]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        super().__init__(content, headers=headers)


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
            memory_share=settings.memory_share,
            kv_window=settings.kv_window,
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
        """Every batch slot taken and --max-queue requests waiting behind them. The slots are
        what the memory holds (--max-batch, sized inside --memory's share): a request beyond
        them waits holding only its token ids, never a cache."""
        w = self.worker
        return w.queued() + w.in_flight() >= w.max_batch + self.settings.max_queue

    def refuse_if_draining(self) -> None:
        if self.worker.drain_until is not None:
            raise HttpError(
                503, "the server is shutting down", type_="unavailable_error", retry_after=1
            )

    async def body(self, request: Request) -> dict:
        """The request's JSON object, read within the time, size and nesting bounds."""
        return parse_object(await read_body(request, self.settings.read_timeout))


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


async def _prepare(eng: Engine, request: Request, api: Dialect) -> Prepared:
    bundle = eng.bundle()
    eng.refuse_if_draining()
    req = api.parse(await eng.body(request))
    # Templates and grammars take a while on long inputs: off the event loop, so other
    # streams keep flowing.
    ids = await run_in_threadpool(prompt_ids, bundle, req)
    max_tokens = token_budget(req, len(ids), eng.ctx, eng.settings.default_max_tokens)
    spec = await run_in_threadpool(constraint, eng.worker, req, max_tokens)
    return Prepared(req, ids, max_tokens, spec)


def _job(eng: Engine, p: Prepared, arrived: float) -> Job:
    req = p.req
    return Job(
        p.ids,
        p.max_tokens,
        req.temperature,
        req.top_p,
        req.seed,
        asyncio.get_running_loop(),
        deadline=arrived + eng.settings.request_timeout,
        top_k=req.top_k,
        constraint=p.constraint,
        top_logprobs=req.top_logprobs if req.logprobs else None,
        mtp=req.mtp,
    )


def _notes(eng: Engine, req: GenerationRequest) -> dict[str, str]:
    """Headers saying what a request asked that the model could not do: thinking on a model
    whose chat template has no thinking switch is accepted and ignored, and said so here."""
    if req.thinking is None:
        return {}
    if thinking_honoured(eng.worker.bundle):
        return {"x-macserve-thinking": "on" if req.thinking else "off"}
    if thinking.markers(eng.worker.bundle.tokenizer) is not None:
        return {
            "x-macserve-thinking": "ignored: this model's chat template has no thinking "
            "switch (what it thinks is returned as thinking)"
        }
    return {"x-macserve-thinking": "ignored: this model's chat template has no thinking mode"}


def _output(eng: Engine, p: Prepared) -> Output:
    """How this answer is read: the model's tool-call format, and for a chat answer its
    think markers (and whether the prompt opened a think block)."""
    tok = eng.worker.bundle.tokenizer
    think = thinking.think_of(tok, p.ids) if p.req.kind == "chat" else None
    return Output(tools.tool_format(tok), think)


async def generate(request: Request, api: Dialect) -> Response:
    """One request to a generating endpoint, answered in `api`'s shapes."""
    eng: Engine = request.app.state.engine
    arrived = time.monotonic()
    path = request.url.path
    job = None
    try:
        p = await _prepare(eng, request, api)
        if eng.full():
            # 429, not 503: the server is well, only busy; clients (and proxies) back off
            # for Retry-After instead of marking it down.
            raise HttpError(
                429,
                f"{eng.worker.max_batch} requests are running (all the memory holds at "
                f"once) and {eng.settings.max_queue} already waiting; retry later",
                type_="rate_limit_exceeded",
                code="queue_full",
                retry_after=eng.retry_after(),
            )
        job = _job(eng, p, arrived)
        eng.worker.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            await _admitted(eng, job)
            vocab, model = eng.worker.vocab, eng.settings.model_id
            args = (job, p.req, api.new_id(), model, vocab, _output(eng, p), len(p.ids))
            notes = _notes(eng, p.req)
            if not p.req.stream:
                try:
                    return JSONResponse(await api.whole(*args), headers=notes)
                finally:
                    job.cancel()  # done, or a stop string matched: either way the worker may stop
        finally:
            watcher.cancel()
        return _SSEResponse(api.stream(*args), notes)
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
