"""OpenAI's request bodies (/v1/chat/completions, /v1/completions) in, a validated
GenerationRequest (../request.py) out.

Validation names the field and what was expected, as OpenAI's own 400s do, so a client
author sees the mistake without reading the server log (an HttpError, rendered by
web/openai_api.py). Unknown fields are ignored (clients send penalties, logit_bias, user,
...), but fields whose meaning we would silently change (n > 1, echo, best_of, the old
`functions`) are refused.
"""

from __future__ import annotations

import json
from typing import Any

from ...web.errors import HttpError
from ..request import GenerationRequest, Tool, is_int, opt, sampling, schema_of, stop_list

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
# Fields we would otherwise silently ignore, with the values that mean "not asked for".
_REFUSED = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "best_of": (None, 1),
}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    # The array form: [{"type": "text", "text": "..."}]; other part types need a vision model.
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise HttpError(400, f"{where}: only text content parts are supported", where)
            parts.append(p["text"])
        return "".join(parts)
    raise HttpError(400, f"{where} must be a string or a list of text parts", where)


def _tool_list(body: dict) -> tuple:
    from_tools = body.get("tools")
    if from_tools in (None, []):
        return ()
    if not isinstance(from_tools, list):
        raise HttpError(400, "tools must be a list", "tools")
    out, names = [], set()
    for i, t in enumerate(from_tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise HttpError(400, f'{where} must be {{"type": "function", "function": ...}}', where)
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise HttpError(400, f"{where}.function.name is required", f"{where}.function.name")
        params = f.get("parameters")
        params = (
            {"type": "object"}
            if params in (None, {})
            else schema_of(params, f"{where}.function.parameters")
        )
        desc = f.get("description") or ""
        if not isinstance(desc, str):
            raise HttpError(400, f"{where}.function.description must be a string", where)
        if f["name"] in names:
            raise HttpError(400, f"{where}: two tools are named {f['name']}", where)
        names.add(f["name"])
        out.append(Tool(f["name"], desc, params))
    return tuple(out)


def _tool_choice(v, tools: tuple) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if v in ("auto", "none", "required"):
        choice, name = v, None
    elif (
        isinstance(v, dict)
        and v.get("type") == "function"
        and isinstance(v.get("function"), dict)
        and isinstance(v["function"].get("name"), str)
    ):
        choice, name = "function", v["function"]["name"]
    else:
        raise HttpError(
            400,
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice in ("required", "function") and not tools:
        raise HttpError(400, f"tool_choice {json.dumps(v)} needs tools", "tool_choice")
    if name is not None and name not in {t.name for t in tools}:
        raise HttpError(400, f"tool_choice names {name}, which is not in tools", "tool_choice")
    return choice, name


def _response_format(v) -> dict | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise HttpError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                "response_format",
            )
        return schema_of(js["schema"], "response_format.json_schema.schema")
    raise HttpError(
        400,
        'response_format.type must be "text", "json_object" or "json_schema"',
        "response_format",
    )


def _common(body: dict, kind: str) -> dict:
    kw: dict[str, Any] = {"kind": kind}
    opt(body, "model", lambda v: isinstance(v, str), "a string")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is not None:
        if not is_int(mt) or mt < 1:
            raise HttpError(
                400, f"{key} must be a positive integer, got {json.dumps(mt)[:60]}", key
            )
        kw["max_tokens"] = mt
    kw.update(sampling(body))
    so = opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    kw["include_usage"] = bool(so.get("include_usage"))
    kw["stop"] = stop_list(body.get("stop"), "stop")
    if opt(body, "n", is_int, "an integer", 1) != 1:
        raise HttpError(400, "only n=1 is supported", "n")
    for key, harmless in _REFUSED.items():
        if body.get(key) not in harmless:
            raise HttpError(400, f"{key} is not supported by this server", key)
    kw["json_schema"] = _response_format(body.get("response_format"))
    return kw


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise HttpError(400, f"{where} must be an object", where)
    role = m.get("role")
    if role not in ROLES:
        raise HttpError(400, f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
    role = "system" if role == "developer" else role
    calls = m.get("tool_calls") if role == "assistant" else None
    if "content" not in m and not calls:
        raise HttpError(400, f"{where}.content is required", f"{where}.content")
    content = m.get("content")
    out = {"role": role, "content": "" if content is None else _text(content, f"{where}.content")}
    if calls:
        if not isinstance(calls, list):
            raise HttpError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise HttpError(
                    400, f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls"
                )
            args = f.get("arguments", "{}")
            if not isinstance(args, (str, dict)):
                raise HttpError(
                    400, f"{where}.tool_calls[{j}].function.arguments must be a string", where
                )
            out["tool_calls"].append(
                {
                    "id": str(c.get("id") or f"call_{i}_{j}"),
                    "type": "function",
                    "function": {"name": f["name"], "arguments": args},
                }
            )
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or "")
    return out


def _thinking(body: dict) -> bool | None:
    """Thinking asked for: `chat_template_kwargs.enable_thinking` (llama-server's and vLLM's
    way) or `reasoning_effort` ("none" or "minimal": off; any other: on); None: the model's
    default. Passed to the chat template's switch where it has one (prepare.py)."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise HttpError(
                400,
                "chat_template_kwargs.enable_thinking must be true or false",
                "chat_template_kwargs",
            )
        return kwargs["enable_thinking"]
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if not isinstance(effort, str):
        raise HttpError(400, "reasoning_effort must be a string", "reasoning_effort")
    return effort not in ("none", "minimal")


def parse_chat(body: dict) -> GenerationRequest:
    msgs = body.get("messages")
    if msgs is None:
        raise HttpError(400, "messages is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise HttpError(400, "messages must be a non-empty list", "messages")
    kw = _common(body, "chat")
    kw["messages"] = tuple(_message(m, i) for i, m in enumerate(msgs))
    kw["tools"] = _tool_list(body)
    kw["tool_choice"], kw["tool_name"] = _tool_choice(body.get("tool_choice"), kw["tools"])
    kw["parallel_tool_calls"] = opt(
        body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false", True
    )
    if kw["json_schema"] is not None and kw["tool_choice"] in ("required", "function"):
        raise HttpError(
            400, "response_format cannot be combined with a forced tool call", "tool_choice"
        )
    kw["logprobs"] = opt(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
    kw["top_logprobs"] = opt(
        body,
        "top_logprobs",
        lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"an integer from 0 to {MAX_TOP_LOGPROBS}",
        0,
    )
    if kw["top_logprobs"] and not kw["logprobs"]:
        raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    kw["thinking"] = _thinking(body)
    return GenerationRequest(**kw)


def parse_completion(body: dict) -> GenerationRequest:
    p = body.get("prompt")
    if p is None:
        raise HttpError(400, "prompt is required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]  # the one-prompt batch form clients send
    if isinstance(p, list):
        if not p or not all(is_int(t) and t >= 0 for t in p):
            raise HttpError(
                400, "prompt must be a string, or a non-empty list of token ids", "prompt"
            )
        p = tuple(p)
    elif not isinstance(p, str) or not p:
        raise HttpError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    kw = _common(body, "completion")
    for key in ("tools", "tool_choice"):
        if body.get(key) not in (None, [], "none"):
            raise HttpError(400, f"{key} needs /v1/chat/completions (a chat template)", key)
    # The legacy API: logprobs is how many alternatives to list (0..5), null for none.
    lp = opt(body, "logprobs", lambda v: is_int(v) and 0 <= v <= 5, "an integer from 0 to 5")
    kw["logprobs"], kw["top_logprobs"] = lp is not None, lp or 0
    return GenerationRequest(prompt=p, **kw)
