"""Anthropic's Messages API on the engine: a body parsed into a GenerationRequest, the job's
events (../events.py) rendered as a whole `message` or as the Messages API's stream of
events; an error after the 200 as web/anthropic_api.py's `event: error`. `MESSAGES` serves
/v1/messages, `count_tokens` /v1/messages/count_tokens."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...web import anthropic_api, dialects
from ...web.errors import HttpError
from ..answers import cancelled_on_disconnect, log_done, read_steps, read_whole
from ..events import Finish, Text, Thinking, ToolCall
from ..prepare import prompt_ids
from ..request import GenerationRequest
from ..serving import Engine
from . import render
from .request import count_tokens_request, parse


def _window(job, req: GenerationRequest, stats: dict) -> bool:
    """The answer ran to the context's end: its max_tokens was cut to fit (request.py) and
    it wrote all the cut budget allowed."""
    asked = req.max_tokens or 0
    return job.max_tokens < asked and stats.get("completion_tokens", 0) >= job.max_tokens


class Anthropic:
    call_prefix = "toolu_"
    kind = "chat"

    def parse(self, body: dict) -> GenerationRequest:
        return parse(body)

    def new_id(self) -> str:
        return render.new_id()

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict:
        w = await read_whole(job, req, vocab, fmt, self.call_prefix)
        ev = w.finish
        window = _window(job, req, ev.stats)
        return render.message(
            rid, model, w.text, w.calls, ev.reason, ev.stop_sequence, ev.stats, window, w.thinking
        )

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int):
        return cancelled_on_disconnect(self._events)(job, req, rid, model, vocab, fmt, n_prompt)

    async def _events(self, job, req, rid, model, vocab, fmt, n_prompt: int):
        s = render.Stream(rid, model, n_prompt, job.cached_tokens)
        for b in s.start():
            yield b
        try:
            async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
                match ev:
                    case Text():
                        out = s.text(ev.text)
                    case Thinking():
                        out = s.thinking(ev.text)
                    case ToolCall():
                        out = s.call(ev)
                    case Finish():
                        window = _window(job, req, ev.stats)
                        out = s.finish(ev.reason, ev.stop_sequence, ev.stats, window)
                        log_done(req, ev.reason, ev.stats)
                for b in out:
                    yield b
        except HttpError as e:
            yield anthropic_api.error_event(e)


MESSAGES = Anthropic()


async def count_tokens(request: Request) -> Response:
    """The prompt's length as this model's chat template writes it (no generation)."""
    eng: Engine = request.app.state.engine
    try:
        bundle = eng.bundle()
        req = count_tokens_request(await eng.body(request))
        ids = await run_in_threadpool(prompt_ids, bundle, req)
        return JSONResponse({"input_tokens": len(ids)})
    except HttpError as e:
        return dialects.error_response(e, request.url.path)
