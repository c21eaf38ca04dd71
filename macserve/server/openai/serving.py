"""OpenAI's two endpoints on the engine: a body parsed into a GenerationRequest, the job's
events (../events.py) rendered as a whole `chat.completion` / `text_completion` or as a
stream of chunks ending in `data: [DONE]`; an error after the 200 as web/openai_api.py's
last event. One object per endpoint: `CHAT` (/v1/chat/completions), `COMPLETION`
(/v1/completions)."""

from __future__ import annotations

from ...web import openai_api
from ...web.errors import HttpError
from ..answers import cancelled_on_disconnect, log_done, read_steps, read_whole
from ..events import Finish, Text, Thinking, ToolCall
from ..request import GenerationRequest
from . import render as R
from .request import parse_chat, parse_completion


def _finish(f: Finish) -> str:
    return "stop" if f.reason == "stop_sequence" else f.reason  # OpenAI has no stop_sequence


class OpenAI:
    call_prefix = "call_"

    def __init__(self, kind: str):
        self.kind = kind  # "chat" | "completion"

    def parse(self, body: dict) -> GenerationRequest:
        return parse_chat(body) if self.kind == "chat" else parse_completion(body)

    def new_id(self) -> str:
        return R.new_id(self.kind)

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict:
        w = await read_whole(job, req, vocab, fmt, self.call_prefix)
        ev = w.finish
        return R.full_response(
            req, rid, model, w.text, _finish(ev), ev.stats, w.calls, w.logprobs, w.thinking
        )

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int):
        return cancelled_on_disconnect(self._events)(job, req, rid, model, vocab, fmt)

    async def _events(self, job, req, rid, model, vocab, fmt):
        n_calls, offset = 0, 0
        if req.kind == "chat":
            yield R.sse(R.chunk(req, rid, model, "", role=True))
        try:
            async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
                match ev:
                    case Text():
                        c = R.chunk(req, rid, model, ev.text, logprobs=ev.logprobs, offset=offset)
                        yield R.sse(c)
                        offset += len(ev.text)
                    case Thinking():
                        yield R.sse(R.chunk(req, rid, model, None, reasoning=ev.text))
                    case ToolCall():
                        yield R.sse(R.chunk(req, rid, model, None, calls=[ev], first_call=n_calls))
                        n_calls += 1
                    case Finish():
                        f = _finish(ev)
                        c = R.chunk(req, rid, model, None, f, ev.stats, logprobs=ev.logprobs)
                        yield R.sse(c)
                        if req.include_usage:
                            yield R.sse(R.usage_chunk(req, rid, model, ev.stats))
                        log_done(req, ev.reason, ev.stats)
        except HttpError as e:
            yield openai_api.error_event(e)  # the error, then [DONE]
            return
        yield R.SSE_DONE


CHAT, COMPLETION = OpenAI("chat"), OpenAI("completion")
