"""A running job's Steps -> what an answer is made of, whatever the API: `Text` and
`ToolCall` events, then one `Finish` (events.py). Stop strings are cut here, tool calls split
out of the text, and the job's end (done, deadline, shutdown, failure, client gone) becomes
a Finish or an HttpError. Each dialect's serving module renders the events."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator

from ..web.errors import HttpError
from . import tools
from .events import Event, Finish, Text, TokenLogprob
from .request import GenerationRequest
from .worker import END, Job

log = logging.getLogger("macserve.server")


class StopMatcher:
    """Cuts the output at the first stop string. Text that might be the start of a stop
    string is held back until the next token decides, so a streamed stop string never leaks."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.hit: str | None = None  # the stop string that matched

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, hit a stop string)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            i, self.hit = min(hits)
            return buf[:i], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclasses.dataclass
class Whole:
    """A whole (not streamed) answer's events, gathered: what every dialect renders."""

    text: str
    calls: list
    logprobs: list
    finish: Finish


async def read_whole(job: Job, req: GenerationRequest, vocab, fmt, id_prefix: str) -> Whole:
    """`read_steps` to its end: the text joined, the tool calls, every token's logprobs and
    the Finish (logged as done)."""
    parts: list[str] = []
    calls: list = []
    lps: list = []
    async for ev in read_steps(job, req, vocab, fmt, id_prefix):
        if isinstance(ev, Text):
            parts.append(ev.text)
            lps += ev.logprobs
        elif isinstance(ev, Finish):
            log_done(req, ev.reason, ev.stats)
            return Whole("".join(parts), calls, lps + list(ev.logprobs), ev)
        else:
            calls.append(ev)
    raise HttpError(500, "generation ended without a result")


async def read_steps(
    job: Job, req: GenerationRequest, vocab, fmt, id_prefix: str
) -> AsyncIterator[Event]:
    """Text and ToolCall events, then one Finish. Stop strings are cut (and never streamed,
    even split across tokens); with tools, calls are split out of the text. Raises HttpError
    when the job fails or the server stopped it."""
    matcher = StopMatcher(req.stop)
    splitter = tools.Splitter(fmt, req.tools, id_prefix) if req.uses_tools else None
    pending: list[TokenLogprob] = []
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
                pending.append(TokenLogprob(vocab.token_bytes(item.token), lp, top))
            text, hit = matcher.feed(item.text)
            finish = "stop" if hit else item.finish_reason
        if finish and not hit:
            text = (text if item is not None else "") + matcher.flush()
        events = splitter.feed(text) if splitter else ([Text(text)] if text else [])
        if finish and splitter:
            events += splitter.flush()
        for ev in events:
            if isinstance(ev, Text):
                # The tokens read so far go with the first text they wrote.
                yield dataclasses.replace(ev, logprobs=tuple(pending))
                pending = []
            else:
                yield ev
        if finish:
            if splitter and splitter.calls and finish == "stop":
                finish = "tool_calls"
            elif hit:
                finish = "stop_sequence"
            yield Finish(finish, matcher.hit if hit else None, stats, tuple(pending))
            return


def cancelled_on_disconnect(events):
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


def log_done(req: GenerationRequest, finish: str, stats: dict) -> None:
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
