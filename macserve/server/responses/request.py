"""The Responses API's request body (`POST /v1/responses`) in, a `ResponsesRequest` (the
neutral GenerationRequest plus what the answer echoes back) out, parsed once.

`input` is a string or a list of items: messages (roles user, assistant, system, developer;
developer is the system role the chat template knows), their parts (`input_text`,
`output_text`), `function_call` items (an assistant's tool calls) and `function_call_output`
items (the results, as "tool" messages); `reasoning` items from earlier turns are dropped (the
model writes none). `instructions` becomes a leading system message.

Stateless: `store` is accepted and ignored (nothing is kept), so `previous_response_id` is a
400 saying to send the whole conversation in `input` (what Codex does). Tools other than
`function` ones (hosted tools: web search, file search, ...) cannot run here: they are left
out of the prompt with a log line, as unknown fields are, rather than refused."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ...web.errors import HttpError
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


class _Loose(BaseModel):
    # Clients add fields as the API grows (ids, status, annotations): never a 400 for those.
    model_config = ConfigDict(extra="allow")


class Part(_Loose):
    type: str
    text: str | None = None


class Message(_Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCall(_Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutput(_Loose):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class Reasoning(_Loose):
    type: Literal["reasoning"]


def _item_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


Item = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[Reasoning, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="item_type",
        custom_error_message="items of this type are not supported here (messages, "
        "function_call, function_call_output and reasoning are)",
    ),
]


class FunctionTool(_Loose):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Loose):
    type: Literal["function"]
    name: str


class Format(_Loose):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")


class TextConfig(_Loose):
    format: Format | None = None


class Body(_Loose):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: dict | None = None
    metadata: dict | None = None


def _where(loc: tuple) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not str(p).startswith(("function-", "literal", "str", "list[")) and p not in (
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "NamedFunction",
        ):
            out += ("." if out else "") + str(p)
    return out or "body"


def _body(raw: dict) -> Body:
    try:
        return Body.model_validate(raw)
    except ValidationError as e:
        # Of a union's failed branches, the one that got furthest names the mistake.
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        where = _where(err["loc"])
        raise HttpError(400, f"{where}: {err['msg']}", where) from None


def _text(content: str | list[Part], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(content):
        if p.type in ("input_text", "output_text", "text", "summary_text") and p.text is not None:
            out.append(p.text)
        elif p.type == "refusal":
            out.append(str(getattr(p, "refusal", "") or ""))
        else:
            raise HttpError(
                400,
                f"{where}[{j}]: only text parts are supported (got type {json.dumps(p.type)})",
                f"{where}[{j}]",
            )
    return "".join(out)


def _messages(body: Body) -> list[dict]:
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = (
        [Message(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    )
    if not items:
        raise HttpError(400, "input must not be empty", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if isinstance(it, Message):
            role = "system" if it.role == "developer" else it.role
            out.append({"role": role, "content": _text(it.content, f"{where}.content")})
        elif isinstance(it, FunctionCall):
            call = {
                "id": it.call_id,
                "type": "function",
                "function": {"name": it.name, "arguments": it.arguments},
            }
            last = out[-1] if out else None
            # A turn's calls (and the text before them) are one assistant message.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(it, FunctionCallOutput):
            text = _text(it.output, f"{where}.output")
            out.append({"role": "tool", "content": text, "tool_call_id": it.call_id})
        # Reasoning items: the model writes none and its template has no place for them.
    return out


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
            raise HttpError(400, f"{where}.{_where(err['loc'])}: {err['msg']}", where) from None
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
    body = _body(raw)
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
    echo = {
        "instructions": body.instructions,
        "tools": tool_echo,
        "tool_choice": raw.get("tool_choice") or "auto",
        "parallel_tool_calls": parallel,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "text": {"format": (raw.get("text") or {}).get("format") or {"type": "text"}},
        "reasoning": body.reasoning,
        "temperature": s["temperature"],
        "top_p": s["top_p"],
    }
    return ResponsesRequest(
        kind="chat",
        messages=tuple(_messages(body)),
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
