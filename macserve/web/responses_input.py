"""OpenAI's Responses API's request body (`POST /v1/responses`), shared by the engine's route
(server/responses/request.py) and the router's translation for servers without it
(router/responses.py): the body and its input items as pydantic models, validated once into a
400 naming the field at fault; the items as chat messages (OpenAI chat's shape, which chat
templates take); the request's fields a `response` object repeats. The answer's shapes are
responses_api.py's."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from .errors import HttpError


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


def where_of(loc: tuple) -> str:
    """A pydantic error's location as the body's path: `input[3].role`."""
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


def parse_body(raw: dict) -> Body:
    """The body validated, or a 400 naming the field at fault."""
    try:
        return Body.model_validate(raw)
    except ValidationError as e:
        # Of a union's failed branches, the one that got furthest names the mistake.
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        where = where_of(err["loc"])
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


def chat_messages(body: Body) -> list[dict]:
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
        # Reasoning items (a model's thinking, the router's loading note): dropped, as
        # thinking models' templates drop earlier reasoning.
    return out


def echo_of(body: Body, raw: dict, tools: list, parallel: bool, temp: float, top_p: float) -> dict:
    """The request's fields a `response` object repeats."""
    return {
        "instructions": body.instructions,
        "tools": tools,
        "tool_choice": raw.get("tool_choice") or "auto",
        "parallel_tool_calls": parallel,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "text": {"format": (raw.get("text") or {}).get("format") or {"type": "text"}},
        "reasoning": body.reasoning,
        "temperature": temp,
        "top_p": top_p,
    }
