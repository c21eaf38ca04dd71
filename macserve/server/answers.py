"""A running job's Steps -> what an answer is made of, whatever the API: `Text`, `Thinking`
and `ToolCall` events, then one `Finish` (events.py). Stop strings are cut here, the model's
thinking and tool calls split out of the text, and the job's end (done, deadline, shutdown, failure, client gone) becomes
a Finish or an HttpError. Each dialect's serving module renders the events."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator

from ..web.errors import HttpError
from . import thinking, tools
from .events import Event, Finish, Text, Thinking, TokenLogprob
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


@dataclasses.dataclass(frozen=True)
class Output:
    """How a model's output is read: its tool-call format, and its think markers (None: no
    thinking mode, or not a chat answer). Made per request by serving.py; the dialects pass
    it through to read_steps unopened."""

    tools: tools.ToolFormat
    think: thinking.Think | None = None


@dataclasses.dataclass
class Whole:
    """A whole (not streamed) answer's events, gathered: what every dialect renders."""

    text: str
    calls: list
    logprobs: list
    finish: Finish
    thinking: str = ""  # the model's reasoning, when it has a thinking mode and thought


async def read_whole(job: Job, req: GenerationRequest, vocab, out: Output, id_prefix: str) -> Whole:
    """`read_steps` to its end: the text joined, the thinking joined, the tool calls, every
    token's logprobs and the Finish (logged as done)."""
    parts: list[str] = []
    thought: list[str] = []
    calls: list = []
    lps: list = []
    async for ev in read_steps(job, req, vocab, out, id_prefix):
        if isinstance(ev, Text):
            parts.append(ev.text)
            lps += ev.logprobs
        elif isinstance(ev, Thinking):
            thought.append(ev.text)
        elif isinstance(ev, Finish):
            log_done(req, ev.reason, ev.stats)
            return Whole("".join(parts), calls, lps + list(ev.logprobs), ev, "".join(thought))
        else:
            calls.append(ev)
    raise HttpError(500, "generation ended without a result")


async def read_steps(
    job: Job, req: GenerationRequest, vocab, out: Output, id_prefix: str
) -> AsyncIterator[Event]:
    """Text, Thinking and ToolCall events, then one Finish. Stop strings are cut (and never
    streamed, even split across tokens); a think block is split out of the text first, then,
    with tools, calls out of what is left. Raises HttpError when the job fails or the server
    stopped it. The Finish's stats count the reasoning tokens (`reasoning_tokens`)."""
    matcher = StopMatcher(req.stop)
    splitter = tools.Splitter(out.tools, req.tools, id_prefix) if req.uses_tools else None
    thinker = thinking.Splitter(out.think) if out.think is not None else None
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
        events = _split(text, bool(finish), thinker, splitter)
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
            if thinker is not None:
                stats = {**stats, "reasoning_tokens": thinker.tokens}
            yield Finish(finish, matcher.hit if hit else None, stats, tuple(pending))
            return


def _split(text: str, last: bool, thinker, splitter) -> list[Event]:
    """One step's text -> its events: thinking first split out, then tool calls out of the
    answer's text; `last`: the answer ends here (what each splitter holds is let out)."""
    if thinker is not None:
        if thinker.inside:
            thinker.tokens += 1  # this step's token was written inside the think block
        pieces = thinker.feed(text) + (thinker.flush() if last else [])
    else:
        pieces = [Text(text)] if text else []
    events: list[Event] = []
    for p in pieces:
        if isinstance(p, Text) and splitter is not None:
            events += splitter.feed(p.text)
        else:
            events.append(p)
    if last and splitter is not None:
        events += splitter.flush()
    return events


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
