"""An agent's loop replayed from its recorded requests (`macserve bench agent`): each turn sent
as the agent sent it (its dialect, its body: system prompt, tools, the turns so far with their
tool results), streamed, timed to its first generated token, and read back for the prompt's
size and how much of it the server's prompt cache gave.

Only what a request asks of the model changes: the model name (the router's profile), a
short answer (`max_tokens`: the prompt is what is measured) and `stream` on (for the time to
first token). The recorded assistant turns are the stand-in's scripted ones (agent_capture.py),
so every provider sees the same prompts whatever its model answers.

Where reuse breaks: `first_change` says, for two consecutive requests, where the later one
stops extending the earlier (the body's fields in the order a chat template renders them:
system, tools, then each message), or None when it only appends.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .agent_capture import dialect

# Fields that change per request without reaching a prompt (a chat template renders none).
UNRENDERED = {"cache_control"}


@dataclass(frozen=True)
class Turn:
    path: str  # with its query (Claude Code's `?beta=true`)
    body: dict

    @property
    def dialect(self) -> str:
        kind = dialect(self.path)
        if kind is None:
            raise ValueError(f"not a generation route: {self.path}")
        return kind


@dataclass(frozen=True)
class Result:
    turn: int
    prompt: int  # prompt tokens, as the server counts them
    cached: int  # of those, read from its prompt cache
    ttft: float  # seconds from sending to the first generated token
    seconds: float  # the whole request

    @property
    def share(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


def load(folder: Path) -> list[Turn]:
    """The agent's main-loop requests (those offering tools), in the order it sent them."""
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no recorded requests in {folder}")
    out = []
    for f in files:
        r = json.loads(f.read_text())
        if r.get("loop"):
            out.append(Turn(r["path"], r["body"]))
    return out


def prepared(turn: Turn, model: str, max_tokens: int) -> dict:
    """The body to send: the recorded one with the profile's name, a short answer, streamed."""
    body = copy.deepcopy(turn.body)
    body["model"], body["stream"] = model, True
    if turn.dialect == "responses":
        body["max_output_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
        body.pop("max_completion_tokens", None)
    if turn.dialect == "chat":
        body["stream_options"] = {"include_usage": True}
    return body


def _first_token(kind: str, event: dict) -> bool:
    """Whether a stream event carries the first generated text or tool call."""
    t = event.get("type")
    if kind == "messages":
        return t == "content_block_delta"
    if kind == "responses":
        return t in ("response.output_text.delta", "response.function_call_arguments.delta")
    for c in event.get("choices") or []:
        d = c.get("delta") or {}
        if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
            return True
    return False


def _usage(kind: str, event: dict, seen: dict) -> None:
    """The prompt's size and its cached part, from whichever event carries them."""
    if kind == "messages":
        u = (event.get("message") or {}).get("usage") or event.get("usage") or {}
        if "input_tokens" in u:  # Anthropic's input_tokens leave out what the cache gave
            read = u.get("cache_read_input_tokens") or 0
            made = u.get("cache_creation_input_tokens") or 0
            seen["prompt"], seen["cached"] = u["input_tokens"] + read + made, read
        return
    if kind == "responses":
        u = (event.get("response") or {}).get("usage") or {}
        if u.get("input_tokens"):
            seen["prompt"] = u["input_tokens"]
            seen["cached"] = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return
    u = event.get("usage") or {}
    if u.get("prompt_tokens"):
        seen["prompt"] = u["prompt_tokens"]
        seen["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def send(client: httpx.Client, url: str, turn: Turn, n: int, body: dict, key=None) -> Result:
    """One turn through the server at `url` (no /v1), streamed."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    seen: dict = {}
    ttft = None
    t0 = time.perf_counter()
    with client.stream("POST", url + turn.path, json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"turn {n}: {r.status_code} {r.text[:400]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            if ttft is None and _first_token(turn.dialect, event):
                ttft = time.perf_counter() - t0
            _usage(turn.dialect, event, seen)
    total = time.perf_counter() - t0
    if not seen.get("prompt"):
        # e.g. the engine's request timeout cut a long prefill off: an answer of no tokens
        raise RuntimeError(f"turn {n}: no prompt tokens in the answer's usage (cut off?)")
    return Result(n, seen["prompt"], seen["cached"], total if ttft is None else ttft, total)


def replay(url: str, model: str, turns: list[Turn], max_tokens: int = 8, key=None, timeout=3600):
    """Each turn in order; yields its Result as it completes."""
    with httpx.Client(timeout=timeout) as client:
        for n, t in enumerate(turns, 1):
            yield send(client, url, t, n, prepared(t, model, max_tokens), key)


def _rendered(body: dict) -> list:
    """A body's prompt-bearing parts in the order templates render them, each part's text as
    a template sees it (a list of text parts is its joined text; UNRENDERED keys dropped)."""

    def norm(x):
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items() if k not in UNRENDERED}
        if isinstance(x, list):
            if x and all(isinstance(p, dict) and p.get("type") == "text" for p in x):
                return "".join(p.get("text", "") for p in x)
            return [norm(v) for v in x]
        return x

    parts = [("system", norm(body.get("system"))), ("instructions", body.get("instructions"))]
    parts.append(("tools", norm(body.get("tools"))))
    for i, m in enumerate(body.get("messages") or body.get("input") or []):
        parts.append((f"message {i}", norm(m)))
    return [p for p in parts if p[1] is not None]


def first_change(before: dict, after: dict) -> str | None:
    """Where `after` stops extending `before` (the first rendered part that differs, None if
    it only appends)."""
    a, b = _rendered(before), _rendered(after)
    for (name, x), (_, y) in zip(a, b):
        if x != y:
            return name
    return None if len(b) >= len(a) else "a part removed"


# A ChatML template that renders tools, for llama-server (`--chat-template-file`): SmolLM2's
# own template drops them, so llama-server would see 4-5K of an agent's 15-20K-token first
# turn. This is Qwen 2.5's rendering (the tools listed in the first system turn, calls as
# <tool_call> blocks, results as <tool_response> blocks in user turns), the one the engine
# uses for a model whose template knows no tools (server/tools.py): both providers see the
# agent's whole prompt.
CHATML_TOOLS = """\
{%- macro text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}{{ p.text if p.text is defined else '' }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ text(m.content) }}
{%- if m.tool_calls -%}{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}
</tool_call>
{%- endfor -%}{%- endif %}<|im_end|>
{% elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ text(m.content) }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ m.role }}
{{ text(m.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
