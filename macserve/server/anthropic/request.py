"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its request
body in, the neutral GenerationRequest (../request.py) out, parsed once.

Content blocks map onto the OpenAI-shaped messages the chat template path takes: text blocks
join into the content, `tool_use` blocks become an assistant's tool_calls, `tool_result`
blocks become "tool" messages. Thinking blocks from earlier turns are dropped (the model
writes none); images and documents get a 400. Errors (529 for overloaded included) are
rendered by web/anthropic_api.py, as the router's are.
"""

from __future__ import annotations

import json

from ...web.errors import HttpError
from ..request import GenerationRequest, Tool, is_int, opt, sampling, schema_of, stop_list


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
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise HttpError(400, f"{where}.role must be user or assistant", f"{where}.role")
        if "content" not in m:
            raise HttpError(400, f"{where}.content is required", f"{where}.content")
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
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise HttpError(
                400,
                f"{where}: only custom tools are supported (got type {json.dumps(kind)})",
                where,
            )
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


def parse(body: dict) -> GenerationRequest:
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
    return GenerationRequest(
        kind="chat",
        messages=tuple(_messages(body.get("system"), body.get("messages"))),
        max_tokens=mt,
        stop=stop_list(body.get("stop_sequences"), "stop_sequences", most=None),
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        **sampling(body, temperature_max=1),
    )


def count_tokens_request(body: dict) -> GenerationRequest:
    """/v1/messages/count_tokens: the same body without max_tokens."""
    return parse({**body, "max_tokens": 1, "stream": False})
