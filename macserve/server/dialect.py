"""The two APIs the server speaks, one class each: how a request body is read, what id an
answer gets, what a whole answer looks like and how a stream is written. The routes pick one
(`OPENAI` for /v1/chat/completions and /v1/completions, `ANTHROPIC` for /v1/messages) and
never test which it is; errors in either shape are web/dialects.py's.
"""

from __future__ import annotations

import asyncio

from ..web import dialects
from ..web.errors import HttpError
from . import anthropic as A
from . import protocol as P
from . import responses as R
from .answers import Finish, log_done, read_steps


def _cancelled_on_disconnect(events):
    """A stream that stops its generation when the client goes: Starlette cancels the
    response then (CancelledError / GeneratorExit), and the job is cancelled however the
    stream ends."""

    async def stream(job, *args):
        try:
            async for b in events(job, *args):
                yield b
        except (asyncio.CancelledError, GeneratorExit):
            job.disconnect()
            raise
        finally:
            job.cancel()

    return stream


class OpenAI:
    call_prefix = "call_"

    @staticmethod
    def parse(body, kind: str) -> P.GenRequest:
        return P.parse_chat(body) if kind == "chat" else P.parse_completion(body)

    @staticmethod
    def new_id(kind: str) -> str:
        return R.new_id(kind)

    @staticmethod
    def _finish(f: Finish) -> str:
        return "stop" if f.reason == "stop_sequence" else f.reason  # no stop_sequence reason

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict:
        parts, calls, lps = [], [], []
        async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
            if isinstance(ev, Finish):
                log_done(req, ev.reason, ev.stats)
                lps += ev.logprobs
                text = "".join(parts)
                return R.full_response(
                    req, rid, model, text, self._finish(ev), ev.stats, calls, lps
                )
            if ev[0] == "text":
                parts.append(ev[1])
                lps += ev[2]
            else:
                calls.append(ev[1])
        raise HttpError(500, "generation ended without a result")

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int, path: str):
        return _cancelled_on_disconnect(self._events)(job, req, rid, model, vocab, fmt, path)

    async def _events(self, job, req, rid, model, vocab, fmt, path: str):
        n_calls, offset = 0, 0
        if req.kind == "chat":
            yield R.sse(R.chunk(req, rid, model, "", role=True))
        try:
            async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
                if isinstance(ev, Finish):
                    f = self._finish(ev)
                    yield R.sse(R.chunk(req, rid, model, None, f, ev.stats, logprobs=ev.logprobs))
                    if req.include_usage:
                        yield R.sse(R.usage_chunk(req, rid, model, ev.stats))
                    log_done(req, ev.reason, ev.stats)
                elif ev[0] == "text":
                    yield R.sse(R.chunk(req, rid, model, ev[1], logprobs=ev[2], offset=offset))
                    offset += len(ev[1])
                else:
                    c = R.chunk(req, rid, model, None, calls=[ev[1]], first_call=n_calls)
                    yield R.sse(c)
                    n_calls += 1
        except HttpError as e:
            yield dialects.error_event(e, path)  # the error, then [DONE]
            return
        yield R.SSE_DONE


class Anthropic:
    call_prefix = "toolu_"

    @staticmethod
    def parse(body, kind: str) -> P.GenRequest:
        return A.parse(body)

    @staticmethod
    def new_id(kind: str) -> str:
        return A.new_id()

    async def whole(self, job, req, rid, model, vocab, fmt, n_prompt: int) -> dict:
        parts, calls = [], []
        async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
            if isinstance(ev, Finish):
                log_done(req, ev.reason, ev.stats)
                text = "".join(parts)
                return A.message(rid, model, text, calls, ev.reason, ev.stop_sequence, ev.stats)
            if ev[0] == "text":
                parts.append(ev[1])
            else:
                calls.append(ev[1])
        raise HttpError(500, "generation ended without a result")

    def stream(self, job, req, rid, model, vocab, fmt, n_prompt: int, path: str):
        return _cancelled_on_disconnect(self._events)(
            job, req, rid, model, vocab, fmt, n_prompt, path
        )

    async def _events(self, job, req, rid, model, vocab, fmt, n_prompt: int, path: str):
        s = A.Stream(rid, model, n_prompt, job.cached_tokens)
        for b in s.start():
            yield b
        try:
            async for ev in read_steps(job, req, vocab, fmt, self.call_prefix):
                if isinstance(ev, Finish):
                    out = s.finish(ev.reason, ev.stop_sequence, ev.stats)
                    log_done(req, ev.reason, ev.stats)
                elif ev[0] == "text":
                    out = s.text(ev[1])
                else:
                    out = s.call(ev[1])
                for b in out:
                    yield b
        except HttpError as e:
            yield dialects.error_event(e, path)


OPENAI, ANTHROPIC = OpenAI(), Anthropic()
