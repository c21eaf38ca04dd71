"""The Responses API on the engine: a body parsed into a ResponsesRequest, the job's events
(../events.py) rendered as a whole `response` or as its stream of typed events; an error
after the 200 as a `response.failed` event. `RESPONSES` serves /v1/responses."""

from __future__ import annotations

from ...web import responses_api as render
from ...web.errors import HttpError
from ..answers import cancelled_on_disconnect, log_done, read_steps, read_whole
from ..events import Finish, Text, Thinking, ToolCall
from ..request import GenerationRequest
from .request import parse


class Responses:
    call_prefix = "call_"
    kind = "chat"

    def parse(self, body: dict) -> GenerationRequest:
        return parse(body)

    def new_id(self) -> str:
        return render.new_id()

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict:
        w = await read_whole(job, req, vocab, fmt, self.call_prefix)
        f = w.finish
        return render.whole(rid, model, req.echo, w.text, w.calls, f.reason, f.stats, w.thinking)

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int):
        return cancelled_on_disconnect(self._events)(job, req, rid, model, vocab, fmt)

    async def _events(self, job, req, rid, model, vocab, fmt):
        s = render.Stream(rid, model, req.echo)
        for b in s.start():
            yield b
        try:
            async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
                match ev:
                    case Text():
                        out = s.delta(ev.text)
                    case Thinking():
                        out = s.reasoning(ev.text)
                    case ToolCall():
                        out = s.call(ev)
                    case Finish():
                        out = s.finish(ev.reason, ev.stats)
                        log_done(req, ev.reason, ev.stats)
                for b in out:
                    yield b
        except HttpError as e:
            yield s.failed(e.code or e.type, e.message)


RESPONSES = Responses()
