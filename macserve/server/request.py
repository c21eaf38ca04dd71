"""The neutral request between the API dialects and the engine: `GenerationRequest`, what
openai/request.py and anthropic/request.py each parse a body into (once), and what
prepare.py, answers.py and serving.py (the worker's Job) read. Also the field checks both
dialects share (sampling, stop strings, a schema), so each names the field and what was
expected, as the APIs' own 400s do."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..web.errors import HttpError


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the arguments' JSON schema

    def spec(self) -> dict:
        """The OpenAI form chat templates and mlx-lm's tool parsers take."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request, whichever API it came through (OpenAI chat or completions,
    Anthropic messages), parsed once."""

    kind: str  # "chat" | "completion"
    messages: tuple[dict, ...] = ()  # OpenAI's shape: roles system/user/assistant/tool
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None  # None: the server's default cap
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # auto | none | required | function (then tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    json_schema: dict | None = None  # response_format: {"type": "object"} for json_object
    logprobs: bool = False
    top_logprobs: int = 0
    mtp: str | None = None  # ours: auto | on | off for this request (None: the server's --mtp)
    # Thinking asked for (True), refused (False) or left to the chat template (None): passed as
    # the template's `enable_thinking` where it has one (prepare.thinking_honoured says which).
    thinking: bool | None = None
    # A max_tokens past what the context leaves is cut to fit rather than refused (agents send
    # their own model's output limit, e.g. Claude Code's 32000, whatever the context).
    clamp_max_tokens: bool = False

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


# ---- field checks both dialects use ---------------------------------------------------------


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def opt(body: dict, key: str, check, expected: str, default=None):
    """body[key] if it passes `check`, `default` if absent or null, else a 400 naming it."""
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise HttpError(400, f"{key} must be {expected}, got {json.dumps(v)[:60]}", key)
    return v


def stop_list(stop, key: str, most: int | None = 4) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list)
        and (most is None or len(stop) <= most)
        and all(isinstance(s, str) and s for s in stop)
    ):
        n = f"up to {most} " if most else ""
        raise HttpError(400, f"{key} must be a string or a list of {n}non-empty strings", key)
    return tuple(stop or ())


def schema_of(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise HttpError(400, f"{where} must be a JSON schema object", where)
    return v


def sampling(body: dict, temperature_max: float = 2) -> dict:
    """temperature, top_p, top_k, seed, stream and our mtp, checked (Anthropic's temperature
    stops at 1, OpenAI's at 2)."""
    out = {}
    out["temperature"] = float(
        opt(
            body,
            "temperature",
            lambda v: is_num(v) and 0 <= v <= temperature_max,
            f"a number from 0 to {temperature_max:g}",
            1.0,
        )
    )
    out["top_p"] = float(
        opt(body, "top_p", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    )
    out["top_k"] = opt(body, "top_k", lambda v: is_int(v) and v >= 0, "an integer >= 0", 0)
    out["seed"] = opt(body, "seed", is_int, "an integer")
    out["stream"] = opt(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    out["mtp"] = opt(body, "mtp", lambda v: v in ("auto", "on", "off"), '"auto", "on" or "off"')
    return out
