"""A running job's Steps -> what an answer is made of, whatever the API: ("text", str,
logprobs) and ("call", ToolCall) events, then one Finish. Stop strings are cut here, tool
calls split out of the text, and the job's end (done, deadline, shutdown, failure, client
gone) becomes a finish or an HttpError."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..web.errors import HttpError
from . import protocol as P
from . import responses as R
from . import tools
from .worker import END, Job

log = logging.getLogger("macserve.server")


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls | stop_sequence (a stop string matched)
    stop_sequence: str | None
    stats: dict
    logprobs: list  # entries not yet sent with text


async def read_steps(job: Job, req: P.GenRequest, vocab, fmt, id_prefix: str) -> AsyncIterator:
    """("text", str, [TokenLogprob]) and ("call", ToolCall) events, then one Finish. Stop
    strings are cut (and never streamed, even split across tokens); with tools, calls are
    split out of the text. Raises HttpError when the job fails or the server stopped it."""
    matcher = P.StopMatcher(req.stop)
    splitter = tools.Splitter(fmt, req.tools, id_prefix) if req.uses_tools else None
    pending: list[R.TokenLogprob] = []
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
                pending.append(R.TokenLogprob(vocab.token_bytes(item.token), lp, top))
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


def log_done(req: P.GenRequest, finish: str, stats: dict) -> None:
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
