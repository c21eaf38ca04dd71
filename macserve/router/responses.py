"""/v1/responses for a server that has only chat completions (mlx_lm.server): the request
translated to /v1/chat/completions, the answer translated back into the Responses API's
shapes (a `response` object, or its stream of typed events), both written by
web/responses_api.py, as the engine's own route writes them.

The model's thinking, which mlx_lm.server returns as a `reasoning` field in the message or
delta (0.32.2; llama-server and DeepSeek's API name it `reasoning_content`), becomes a
`reasoning` output item with `reasoning_text` content, streamed as reasoning_text deltas, as
the engine's route returns it; the whitespace around the think block is dropped as the
engine drops it (the answer starts at its first word), and `reasoning_tokens` is counted where
the usage gives it (`completion_tokens_details`; mlx_lm.server's does not). `reasoning.effort`
goes to the chat template as `enable_thinking` ("none" and "minimal" off), as on the engine.

Stateless like the engine's route: `previous_response_id` is a 400, `store` is ignored.
Servers with the route (the engine, llama-server) get the request as it came (proxy.py)."""

from __future__ import annotations

import json

from ..web import responses_api as api
from ..web import responses_input as body_of
from ..web.errors import HttpError
from .errors import RouteError

CHAT_PATH = "/v1/chat/completions"


def _route_error(e: HttpError) -> RouteError:
    return RouteError(e.status, e.message, e.type)


def _tool(t: dict) -> dict:
    f = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
    if t.get("description"):
        f["description"] = t["description"]
    return {"type": "function", "function": f}


class Translation:
    """One request: its chat-completions body, then its answer's bytes as they come."""

    path = CHAT_PATH

    def __init__(self, data: dict, asked: str):
        try:
            body = body_of.parse_body(data)
            messages = body_of.chat_messages(body)
        except HttpError as e:
            raise _route_error(e) from None
        if body.previous_response_id is not None:
            raise RouteError(
                400,
                "previous_response_id is not supported: the router stores no responses "
                "(store is ignored); send the whole conversation in input",
                "invalid_request_error",
            )
        tools = [t for t in body.tools or [] if isinstance(t, dict) and t.get("type") == "function"]
        chat: dict = {"model": data.get("model"), "messages": messages}
        if tools:
            chat["tools"] = [_tool(t) for t in tools]
        choice = body.tool_choice
        if choice is not None:
            chat["tool_choice"] = (
                choice
                if isinstance(choice, str)
                else {"type": "function", "function": {"name": choice.name}}
            )
        parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
        if body.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = parallel
        if body.max_output_tokens is not None:
            chat["max_tokens"] = body.max_output_tokens
        effort = (body.reasoning or {}).get("effort")
        if effort is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
        for key in ("temperature", "top_p", "seed"):
            if data.get(key) is not None:
                chat[key] = data[key]
        self.stream = bool(data.get("stream"))
        if self.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        temp = data.get("temperature")
        top_p = data.get("top_p")
        echo = body_of.echo_of(
            body,
            data,
            tools,
            parallel,
            1.0 if temp is None else temp,
            1.0 if top_p is None else top_p,
        )
        self.chat = json.dumps(chat).encode()
        self.events = api.Stream(api.new_id(), asked, echo)
        self._buf = b""
        self._calls: dict[int, dict] = {}  # a streamed call's pieces, by its index
        self._finish: str | None = None
        self._stats: dict = {}
        self._thought = False  # reasoning written: the answer's leading whitespace is dropped
        self._held = ""  # reasoning's trailing whitespace: written if more reasoning follows
        self._answered = False  # the answer's first non-space text written
        self._lead = ""  # space the answer began with, before any thinking: written with its text

    # ---- a whole answer ------------------------------------------------------------------------

    def whole(self, content: bytes, status: int) -> bytes:
        """A chat.completion as a `response` (an error body passes as it is: same dialect)."""
        if status >= 400:
            return content
        try:
            d = json.loads(content)
            choice = d["choices"][0]
            msg = choice.get("message") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            return content
        calls = [
            api.Call(
                c.get("id") or f"call_{i}",
                c["function"]["name"],
                _arguments(c["function"].get("arguments")),
            )
            for i, c in enumerate(msg.get("tool_calls") or [])
        ]
        thinking = _reasoning(msg).strip()
        text = msg.get("content") or ""
        s = self.events
        out = api.whole(
            s.rid,
            s.model,
            s.echo,
            text.lstrip() if thinking else text,
            calls,
            choice.get("finish_reason") or "stop",
            _stats(d.get("usage")),
            thinking,
        )
        return json.dumps(out).encode()

    # ---- a stream ------------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        """Chat chunks in (whole SSE events or parts of them), Responses events out."""
        self._buf += chunk
        *events, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        out: list[bytes] = []
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    out += self._data(line[5:].strip())
        return b"".join(out)

    def start(self) -> bytes:
        return b"".join(self.events.start())

    def _data(self, raw: bytes) -> list[bytes]:
        if raw == b"[DONE]":
            return self._end()
        try:
            d = json.loads(raw)
        except ValueError:
            return []
        if isinstance(d.get("error"), dict):  # the server's own error event: the stream fails
            err = d["error"]
            return [self.events.failed(str(err.get("code") or "server_error"), str(err))]
        if isinstance(d.get("usage"), dict):
            self._stats = _stats(d["usage"])
        out: list[bytes] = []
        for choice in d.get("choices") or []:
            delta = choice.get("delta") or {}
            out += self._reason(_reasoning(delta))
            out += self._answer(delta.get("content") or "")
            for c in delta.get("tool_calls") or []:
                piece = self._calls.setdefault(c.get("index", len(self._calls)), {"args": ""})
                f = c.get("function") or {}
                piece.setdefault("id", c.get("id"))
                piece["id"] = piece["id"] or c.get("id")
                if f.get("name"):
                    piece["name"] = f["name"]
                piece["args"] += f.get("arguments") or ""
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _reason(self, text: str) -> list[bytes]:
        """A piece of thinking, without the block's leading and trailing whitespace."""
        if not self._thought:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._held += text if self._thought else ""
            return []
        out = self.events.reasoning(self._held + body)
        self._thought, self._held, self._lead = True, text[len(body) :], ""
        return out

    def _answer(self, text: str) -> list[bytes]:
        """A piece of the answer; after thinking, from its first non-space character. Space
        before any waits: a think block may follow it (GLM writes `\n<think>`)."""
        if not self._answered:
            if not text.strip():
                self._lead += "" if self._thought else text
                return []
            text = text.lstrip() if self._thought else self._lead + text
        self._answered, self._held, self._lead = True, "", ""
        return self.events.delta(text)

    def _end(self) -> list[bytes]:
        out: list[bytes] = self.events.delta(self._lead) if self._lead else []
        self._lead = ""
        for i in sorted(self._calls):
            c = self._calls[i]
            out += self.events.call(
                api.Call(c.get("id") or f"call_{i}", c.get("name", ""), _arguments(c["args"]))
            )
        self._calls = {}
        return out + self.events.finish(self._finish or "stop", self._stats)


def _arguments(v) -> str:
    if v is None:
        return "{}"
    return v if isinstance(v, str) else json.dumps(v)


def _reasoning(msg: dict) -> str:
    """The thinking in a chat message or delta: mlx_lm.server's `reasoning`, or the
    `reasoning_content` of llama-server and DeepSeek's API."""
    v = msg.get("reasoning") or msg.get("reasoning_content")
    return v if isinstance(v, str) else ""


def _stats(usage) -> dict:
    """A chat usage object in the worker's names, which api.usage reads."""
    u = usage if isinstance(usage, dict) else {}
    prompt = u.get("prompt_tokens_details")
    done = u.get("completion_tokens_details")
    return {
        "prompt_tokens": u.get("prompt_tokens", 0),
        "completion_tokens": u.get("completion_tokens", 0),
        "cached_tokens": (prompt.get("cached_tokens") or 0) if isinstance(prompt, dict) else 0,
        "reasoning_tokens": (done.get("reasoning_tokens") or 0) if isinstance(done, dict) else 0,
    }
