"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its request
body in, the neutral GenerationRequest (../request.py) out, parsed once.

Content blocks map onto the OpenAI-shaped messages the chat template path takes: text blocks
join into the content, `tool_use` blocks become an assistant's tool_calls, `tool_result`
blocks become "tool" messages. Thinking blocks from earlier turns are dropped (as thinking
models' own templates drop earlier reasoning; ours carry no signature to check); images and
documents get a 400. Errors (529 for overloaded included) are
rendered by web/anthropic_api.py, as the router's are.

What coding agents send is taken as Claude Code sends it (issue 44): `system` messages inside
`messages` (its environment block) are system turns, rendered where they stand by the chat
template; `thinking` (`adaptive`, `enabled`, `disabled`) becomes the template's
`enable_thinking` where it has one, else is accepted and ignored (the answer's
`x-macserve-thinking` header says which; a model's thinking comes back as `thinking` blocks:
../thinking.py); `output_config.format` (a JSON schema) constrains
the answer; `metadata`, `context_management`, `output_config.effort`, `service_tier` and any
field this server does not know are accepted and ignored (unknown ones with a log line), as
are tools of Anthropic's server-side types (web search, code execution: nothing here can run
them). `max_tokens` is cut to what the context leaves after the prompt rather than refused
(Claude Code asks for 32000 whatever the model), and an answer that ends there says
`model_context_window_exceeded`, as Anthropic's API does.
"""

from __future__ import annotations

import json
import logging

from ...web.errors import HttpError
from ..request import GenerationRequest, Tool, is_int, opt, sampling, schema_of, stop_list

log = logging.getLogger("macserve.server")
# The Messages API's fields: every other field is ignored with a log line. Those after
# `tool_choice` are accepted and mean nothing here (or are read below: thinking, output_config).
KNOWN = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "metadata",
    "context_management",
    "service_tier",
    "container",
    "mcp_servers",
    "seed",
    "mtp",
}


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise HttpError(400, f"{where} must be a string or a list of content blocks", where)
    return content


def _result_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in _blocks(content, where):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise HttpError(400, f"{where}: only text tool results are supported", where)
        parts.append(b["text"])
    return "".join(parts)


def _messages(system, msgs) -> list[dict]:
    out: list[dict] = []
    if system is not None:
        sys_text = _result_text(system, "system")
        if sys_text:
            out.append({"role": "system", "content": sys_text})
    if not isinstance(msgs, list) or not msgs:
        raise HttpError(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise HttpError(400, f"{where}.role must be user, assistant or system", f"{where}.role")
        if "content" not in m:
            raise HttpError(400, f"{where}.content is required", f"{where}.content")
        if m["role"] == "system":  # Claude Code's environment block: a system turn where it is
            out.append({"role": "system", "content": _result_text(m["content"], where)})
            continue
        texts, calls = [], []
        for j, b in enumerate(_blocks(m["content"], f"{where}.content")):
            kind, bw = b.get("type"), f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str):
                    raise HttpError(400, f"{bw}.name is required", bw)
                calls.append(
                    {
                        "id": str(b.get("id") or f"toolu_{i}_{j}"),
                        "type": "function",
                        "function": {
                            "name": b["name"],
                            "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False),
                        },
                    }
                )
            elif kind == "tool_result" and m["role"] == "user":
                text = _result_text(b.get("content"), f"{bw}.content")
                if b.get("is_error"):
                    text = "Error: " + text
                out.append(
                    {"role": "tool", "content": text, "tool_call_id": str(b.get("tool_use_id", ""))}
                )
            else:
                raise HttpError(
                    400,
                    f"{bw}: content blocks of type {json.dumps(kind)} are not supported here",
                    bw,
                )
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(v) -> tuple[Tool, ...]:
    if v in (None, []):
        return ()
    if not isinstance(v, list):
        raise HttpError(400, "tools must be a list", "tools")
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise HttpError(400, f"{where} must be an object", where)
        if t.get("type", "custom") != "custom":
            # Anthropic's server tools (web_search_..., code_execution_...) run on its side.
            log.info(
                "messages: %s of type %s ignored (only custom tools run here)", where, t["type"]
            )
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise HttpError(400, f"{where}.name is required", where)
        if t["name"] in names:
            raise HttpError(400, f"{where}: two tools are named {t['name']}", where)
        names.add(t["name"])
        schema = schema_of(t.get("input_schema"), f"{where}.input_schema")
        out.append(Tool(t["name"], str(t.get("description") or ""), schema))
    return tuple(out)


def _tool_choice(v, tools) -> tuple[str, str | None, bool]:
    if v is None:
        return "auto", None, True
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise HttpError(
            400, 'tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice"
        )
    parallel = not v.get("disable_parallel_tool_use", False)
    kind = v["type"]
    if kind in ("any", "tool") and not tools:
        raise HttpError(400, f"tool_choice {kind} needs tools", "tool_choice")
    if kind == "tool":
        name = v.get("name")
        if name not in {t.name for t in tools}:
            raise HttpError(
                400, f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        return "function", name, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], None, parallel


def _thinking(v) -> bool | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("adaptive", "enabled", "disabled"):
        raise HttpError(
            400, 'thinking must be {"type": "adaptive" | "enabled" | "disabled"}', "thinking.type"
        )
    return kind != "disabled"


def _output_format(v) -> dict | None:
    """output_config.format: {"type": "json_schema", "schema": {...}} (structured outputs)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise HttpError(400, "output_config must be an object", "output_config")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise HttpError(
            400,
            'output_config.format must be {"type": "json_schema", "schema": {...}}',
            "output_config.format",
        )
    return schema_of(fmt.get("schema"), "output_config.format.schema")


def parse(body: dict) -> GenerationRequest:
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        log.info("messages: fields ignored: %s", ", ".join(unknown))
    mt = body.get("max_tokens")
    if mt is None:
        raise HttpError(400, "max_tokens is required", "max_tokens")
    if not is_int(mt) or mt < 1:
        raise HttpError(
            400, f"max_tokens must be a positive integer, got {json.dumps(mt)[:60]}", "max_tokens"
        )
    opt(body, "model", lambda v: isinstance(v, str), "a string")
    tools = _tools(body.get("tools"))
    choice, name, parallel = _tool_choice(body.get("tool_choice"), tools)
    schema = _output_format(body.get("output_config"))
    if schema is not None and choice in ("required", "function"):
        raise HttpError(
            400, "output_config.format cannot be combined with a forced tool call", "tool_choice"
        )
    return GenerationRequest(
        kind="chat",
        messages=tuple(_messages(body.get("system"), body.get("messages"))),
        max_tokens=mt,
        stop=stop_list(body.get("stop_sequences"), "stop_sequences", most=None),
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        json_schema=schema,
        thinking=_thinking(body.get("thinking")),
        clamp_max_tokens=True,
        **sampling(body, temperature_max=1),
    )


def count_tokens_request(body: dict) -> GenerationRequest:
    """/v1/messages/count_tokens: the same body without max_tokens."""
    return parse({**body, "max_tokens": 1, "stream": False})
