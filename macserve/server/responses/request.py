"""The Responses API's request body (`POST /v1/responses`) in, a `ResponsesRequest` (the
neutral GenerationRequest plus what the answer echoes back) out, parsed once.

`input` is a string or a list of items: messages (roles user, assistant, system, developer;
developer is the system role the chat template knows), their parts (`input_text`,
`output_text`), `function_call` items (an assistant's tool calls) and `function_call_output`
items (the results, as "tool" messages); `reasoning` items from earlier turns are dropped (the
model's thinking, or the router's loading note: templates drop earlier reasoning). `instructions` becomes a leading system message.

Stateless: `store` is accepted and ignored (nothing is kept), so `previous_response_id` is a
400 saying to send the whole conversation in `input` (what Codex does). Tools other than
`function` ones (hosted tools: web search, file search, ...) cannot run here: they are left
out of the prompt with a log line, as unknown fields are, rather than refused."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import ValidationError

from ...web.errors import HttpError
from ...web.responses_input import (
    FunctionTool,
    NamedFunction,
    TextConfig,
    chat_messages,
    echo_of,
    parse_body,
    where_of,
)
from ..request import GenerationRequest, Tool, sampling, schema_of

log = logging.getLogger("macserve.server")

# Fields a client may send whose meaning here is "nothing to do": no log line for these.
QUIET = {
    "store",
    "include",
    "truncation",
    "user",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "safety_identifier",
    "background",
    "stream_options",
    "top_logprobs",
    "seed",
    "top_k",
    "mtp",
    "prompt",
    "conversation",
    "max_tool_calls",
}


@dataclass(frozen=True)
class ResponsesRequest(GenerationRequest):
    """The neutral request, plus the request's fields a `response` object repeats."""

    echo: dict = field(default_factory=dict)


def _tools(raw: list[dict] | None) -> tuple[tuple[Tool, ...], list[dict]]:
    tools, echo, names = [], [], set()
    for i, t in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise HttpError(400, f"{where} must be an object", where)
        if t.get("type") != "function":
            log.info(
                "responses: %s of type %s ignored (only function tools run here)",
                where,
                t.get("type"),
            )
            continue
        try:
            f = FunctionTool.model_validate(t)
        except ValidationError as e:
            err = e.errors()[0]
            raise HttpError(400, f"{where}.{where_of(err['loc'])}: {err['msg']}", where) from None
        if f.name in names:
            raise HttpError(400, f"{where}: two tools are named {f.name}", where)
        names.add(f.name)
        params = (
            {"type": "object"}
            if not f.parameters
            else schema_of(f.parameters, f"{where}.parameters")
        )
        tools.append(Tool(f.name, f.description or "", params))
        echo.append(t)
    return tuple(tools), echo


def _choice(v, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if isinstance(v, NamedFunction):
        if v.name not in {t.name for t in tools}:
            raise HttpError(
                400, f"tool_choice names {v.name}, which is not in tools", "tool_choice"
            )
        return "function", v.name
    if v == "required" and not tools:
        raise HttpError(400, "tool_choice required needs function tools", "tool_choice")
    return v, None


def _json_schema(text: TextConfig | None) -> dict | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema_ is None:
        raise HttpError(400, "text.format json_schema needs a schema", "text.format.schema")
    return schema_of(fmt.schema_, "text.format.schema")


def thinking_of(reasoning: dict | None) -> bool | None:
    """`reasoning.effort`: "none" (or "minimal") asks for no thinking, any other effort for
    thinking; absent: the model's default."""
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    return effort not in ("none", "minimal")


def parse(raw: dict) -> ResponsesRequest:
    body = parse_body(raw)
    if body.previous_response_id is not None:
        raise HttpError(
            400,
            "previous_response_id is not supported: this server stores no responses (store is "
            "ignored); send the whole conversation in input",
            "previous_response_id",
        )
    unknown = sorted(set(body.model_extra or {}) - QUIET - {"temperature", "top_p", "stream"})
    if unknown:
        log.info("responses: fields ignored: %s", ", ".join(unknown))
    tools, tool_echo = _tools(body.tools)
    choice, name = _choice(body.tool_choice, tools)
    schema = _json_schema(body.text)
    if schema is not None and choice in ("required", "function"):
        raise HttpError(
            400, "text.format cannot be combined with a forced tool call", "tool_choice"
        )
    s = sampling(
        {k: raw.get(k) for k in ("temperature", "top_p", "top_k", "seed", "stream", "mtp")}
    )
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    echo = echo_of(body, raw, tool_echo, parallel, s["temperature"], s["top_p"])
    return ResponsesRequest(
        kind="chat",
        messages=tuple(chat_messages(body)),
        max_tokens=body.max_output_tokens,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        json_schema=schema,
        thinking=thinking_of(body.reasoning),
        clamp_max_tokens=True,
        echo=echo,
        **s,
    )
