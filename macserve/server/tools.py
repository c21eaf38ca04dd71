"""Tool calling: how tools reach the prompt, how calls come back out of the text.

Two formats, chosen per model:

- **native**: mlx-lm knows the model's tool format (its tokenizer has a tool parser, inferred
  from the chat template, e.g. Qwen's or Kimi's). Tools go to the chat template as `tools=`,
  past calls and results as the template expects them, and mlx-lm's parser reads the calls.
- **ours**, for every other model (the demo model's template knows no tools; nor does one
  mlx-lm cannot parse): the tools are described in a system message (the Hermes / Qwen 2.5
  wording, `TOOLS_PROMPT`), each call is a `<tool_call>` block holding
  `{"name": ..., "arguments": {...}}` (mlx-lm's `json_tools` format), past calls are written
  back as such blocks and tool results as user turns holding `<tool_response>` blocks.

tool_choice "required" or a named function constrains the output to one or more such blocks
(see grammar.py), which needs the JSON-bodied format: ours or a native `json_tools` one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from mlx_lm.tool_parsers import json_tools

from ..web.errors import HttpError
from . import grammar
from .events import Text, ToolCall
from .request import Tool

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str
    parse: Callable  # (text between the markers, tools) -> dict or list of dicts
    native: bool  # the chat template renders the tools itself
    json_body: (
        bool  # the block holds {"name": ..., "arguments": ...}: a forced call can be constrained
    )


OURS = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call, False, True)


def tool_format(tokenizer) -> ToolFormat:
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        return ToolFormat(
            tokenizer.tool_call_start,
            tokenizer.tool_call_end,
            parser,
            True,
            parser is json_tools.parse_tool_call,
        )
    return OURS


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _args_obj(args):
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _block(fmt: ToolFormat, name: str, args) -> str:
    body = json.dumps({"name": name, "arguments": _args_obj(args)}, ensure_ascii=False)
    return f"{fmt.start}\n{body}\n{fmt.end}"


def render(messages: list[dict], tools: tuple[Tool, ...], fmt: ToolFormat) -> tuple[list, dict]:
    """Messages (OpenAI's shape, with tool_calls and role "tool") -> what the chat template
    takes, and the extra template arguments."""
    if fmt.native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _args_obj(c["function"]["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": [t.spec() for t in tools]} if tools else {})
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [
                _block(fmt, c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = m.get("content") or ""
            out.append(
                {"role": "assistant", "content": "\n".join(([text] if text else []) + calls)}
            )
            continue
        out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
        text = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def forced_grammar(
    tools: tuple[Tool, ...], fmt: ToolFormat, name: str | None, parallel: bool
) -> str:
    """The grammar of an answer that is only tool calls: of `name`, or of any of `tools`."""
    if not fmt.json_body:
        raise HttpError(
            400,
            "tool_choice 'required' or a named function needs a JSON tool-call format; this "
            "model's template uses another one (use tool_choice 'auto')",
            "tool_choice",
        )
    chosen = [t for t in tools if name is None or t.name == name]
    bodies = []
    for i, t in enumerate(chosen):
        schema = {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
        }
        bodies.append(f"body{i}: {grammar.lark_json(schema)}")
    start, end = json.dumps(fmt.start + "\n"), json.dumps("\n" + fmt.end)
    lines = [
        'start: call ("\\n" call)*' if parallel else "start: call",
        f"call: {start} body {end}",
        "body: " + " | ".join(f"body{i}" for i in range(len(chosen))),
        *bodies,
    ]
    return grammar.lark_grammar("\n".join(lines))


class Splitter:
    """Splits streamed text into plain text and tool calls. Text that may be the start of a
    call marker is held back until the next piece decides; so is whitespace, which is dropped
    if nothing but calls follow it."""

    def __init__(self, fmt: ToolFormat, tools: tuple[Tool, ...], id_prefix: str = "call_"):
        self.fmt, self.tools, self.prefix = fmt, tools, id_prefix
        self.buf = ""
        self.inside = False
        self.space = ""  # whitespace waiting for non-whitespace text
        self.calls = 0

    def _text(self, s: str) -> list[Text]:
        """Text out, except trailing whitespace: held until more text follows (then sent
        before it) or a call does (then dropped), however the text was split into pieces."""
        body = s.rstrip()
        if not body:
            self.space += s
            return []
        out, self.space = self.space + body, s[len(body) :]
        return [Text(out)]

    def _calls(self, body: str) -> list[ToolCall] | None:
        try:
            parsed = self.fmt.parse(body, [t.spec() for t in self.tools])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for p in parsed:
            if not isinstance(p, dict) or not isinstance(p.get("name"), str):
                return None
            args = p.get("arguments", {})
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append(ToolCall(p.get("id") or new_call_id(self.prefix), p["name"], text))
        self.calls += len(out)
        self.space = ""
        return out

    def feed(self, text: str) -> list[Text | ToolCall]:
        self.buf += text
        out = []
        while True:
            if not self.inside:
                i = self.buf.find(self.fmt.start)
                if i < 0:
                    hold = _partial_suffix(self.buf, self.fmt.start)
                    out += self._text(self.buf[: len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold :]
                    return out
                out += self._text(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.fmt.start) :], True
            j = self.buf.find(self.fmt.end)
            if j < 0:
                return out
            body = self.buf[:j]
            calls = self._calls(body)
            out += calls if calls is not None else self._text(self.fmt.start + body + self.fmt.end)
            self.buf, self.inside = self.buf[j + len(self.fmt.end) :], False

    def flush(self) -> list[Text | ToolCall]:
        """The end of the text: a call cut short (max_tokens) is parsed if it can be, else kept
        as text."""
        buf, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            cut = _partial_suffix(buf, self.fmt.end)
            calls = self._calls(buf[: len(buf) - cut])
            if calls is not None:
                return calls
            buf = self.fmt.start + buf
        out = self._text(buf)
        if self.space and not self.calls:
            out.append(Text(self.space))
        self.space = ""
        return out


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0
