"""What a running generation yields, whatever the API it answers: `Text` (with its tokens'
log-probabilities), `Thinking` (the model's reasoning: thinking.py), `ToolCall`, then one
`Finish`. thinking.Splitter, tools.Splitter and answers.read_steps make them; each dialect's serving module (openai/, anthropic/) renders them, so the dialects
match on a type, never on a tuple's first string."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, with the most likely alternatives."""

    raw: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Text:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens that wrote it (when asked for)


@dataclass(frozen=True)
class Thinking:
    text: str  # a piece of the model's reasoning (its think block), not of the answer


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def input(self) -> dict:
        """The arguments as an object (Anthropic's `input`)."""
        try:
            v = json.loads(self.arguments)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {"value": v}


@dataclass(frozen=True)
class Finish:
    reason: str  # stop | length | tool_calls | stop_sequence (a stop string matched)
    stop_sequence: str | None  # the stop string that matched
    stats: dict  # the worker's counts and timings (usage, timings)
    logprobs: tuple[TokenLogprob, ...] = ()  # entries not yet sent with a Text


Event = Text | Thinking | ToolCall | Finish
