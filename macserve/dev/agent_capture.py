"""A recording stand-in for a model server: what a coding agent really sends, turn by turn
(`macserve bench agent --record`).

It speaks the three dialects the agents use (Anthropic messages, the Responses API, chat
completions), streamed or not, and answers from a script: the first turns each call one of
the agent's own tools (list the folder, read a file, grep it: the agent runs them and sends
the results back, so the next request is the agent's real next turn), the last a short text,
which ends the agent's run. Every request is written as JSON (path, headers without
credentials, body) to the recording folder, numbered in arrival order; side requests (a title,
a quota probe) are answered with text and recorded too.

The recordings are the agents' own text (their system prompts, tool schemas): they stay in the
user's cache folder, never in the repository.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ..fileio import atomic_write
from ..web import responses_api

# Credentials never reach a recording.
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "openai-organization", "openai-project"}


@dataclass(frozen=True)
class Action:
    """One scripted turn: a shell command (`shell`), `lines` lines of a file read from line
    `start` (`read`), or the closing text (`text`)."""

    kind: str
    arg: str
    start: int = 1
    lines: int = 60


# Ten turns of an agent's loop: nine tool calls whose results are a working session's (a
# listing, a file read a screen at a time as the agents page large files, greps), then a text
# answer that ends the run. Whole 400-line files would add 5-6K tokens a turn: more than a
# tenth of the prompt, so no turn could be 90 % cached however well the cache works.
SCRIPT = (
    Action("shell", "ls -la"),
    Action("read", "prompt_cache.py"),
    Action("shell", "grep -n 'def ' prompt_cache.py"),
    Action("read", "scheduler.py", 180),
    Action("shell", "wc -l *.py"),
    Action("read", "disk_blocks.py"),
    Action("shell", "grep -n 'trim' prompt_cache.py scheduler.py"),
    Action("read", "README.md", 1, 40),
    Action("shell", "head -30 worker.py"),
    Action("text", "The prompt cache keeps recent sequences and evicts the least recently used."),
)


def _call(agent: str, tools: dict, a: Action, cwd: Path) -> tuple[str, dict] | None:
    """The agent's own tool (name, arguments) for an action, None if it has none such."""
    path = str(cwd / a.arg)
    if agent == "claude":
        if a.kind == "shell" and "Bash" in tools:
            return "Bash", {"command": a.arg, "description": "Inspect the code"}
        if a.kind == "read" and "Read" in tools:
            return "Read", {"file_path": path, "offset": a.start, "limit": a.lines}
    elif agent == "opencode":
        if a.kind == "shell" and "bash" in tools:
            return "bash", {"command": a.arg}
        if a.kind == "read" and "read" in tools:
            return "read", {"filePath": path, "offset": a.start, "limit": a.lines}
    elif agent == "codex":
        cmd = a.arg
        if a.kind == "read":
            cmd = f"sed -n '{a.start},{a.start + a.lines - 1}p' {a.arg}"
        if "exec_command" in tools:
            return "exec_command", {"cmd": cmd}
        if "shell_command" in tools:
            return "shell_command", {"command": cmd}
        if "shell" in tools:
            return "shell", {"command": ["bash", "-lc", cmd]}
    return None


def tool_names(body: dict) -> dict:
    """A request's tools by name (each dialect's shape)."""
    out = {}
    for t in body.get("tools") or []:
        name = t.get("name") or (t.get("function") or {}).get("name")
        if name:
            out[name] = t
    return out


def _sse(event: str | None, data) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def anthropic_answer(model: str, text: str | None, call: tuple[str, dict] | None, stream: bool):
    """Anthropic messages: a text block or one tool_use block."""
    mid = "msg_" + uuid.uuid4().hex[:24]
    usage = {"input_tokens": 1, "output_tokens": 1}
    if call:
        block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call[0]}
        stop = "tool_use"
    else:
        block, stop = {"type": "text", "text": text or ""}, "end_turn"
    if not stream:
        whole = {**block, "input": call[1]} if call else block
        return "application/json", json.dumps(
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [whole],
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": usage,
            }
        ).encode()
    msg = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    out = [_sse("message_start", {"type": "message_start", "message": msg})]
    if call:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call[1])}
    else:
        start = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": text or ""}
    out += [
        _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start}),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 1}},
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return "text/event-stream", b"".join(out)


def chat_answer(model: str, text: str | None, call: tuple[str, dict] | None, stream: bool):
    """Chat completions: a text or one tool call."""
    cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
    tc = None
    if call:
        tc = {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": call[0], "arguments": json.dumps(call[1])},
        }
    finish = "tool_calls" if call else "stop"
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if not stream:
        msg: dict = {"role": "assistant", "content": None if call else text}
        if tc:
            msg["tool_calls"] = [tc]
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": usage,
        }
        return "application/json", json.dumps(body).encode()

    def chunk(delta, fin=None, **extra):
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": fin}],
            **extra,
        }

    delta: dict = {"role": "assistant"}
    if tc:
        delta["tool_calls"] = [{"index": 0, **tc}]
    else:
        delta["content"] = text
    out = [chunk(delta), chunk({}, finish)]
    out.append({**chunk({}), "choices": [], "usage": usage})
    return "text/event-stream", b"".join(_sse(None, c) for c in out) + b"data: [DONE]\n\n"


def responses_answer(model: str, text: str | None, call: tuple[str, dict] | None, stream: bool):
    """The Responses API: a message or one function_call item (web/responses_api.py's)."""
    rid = responses_api.new_id()
    calls = []
    if call:
        calls = [responses_api.Call("call_" + uuid.uuid4().hex[:24], call[0], json.dumps(call[1]))]
    stats = {"prompt_tokens": 1, "completion_tokens": 1}
    finish = "tool_calls" if call else "stop"
    if not stream:
        body = responses_api.whole(rid, model, {}, "" if call else text or "", calls, finish, stats)
        return "application/json", json.dumps(body).encode()
    s = responses_api.Stream(rid, model, {})
    out = s.start()
    for c in calls:
        out += s.call(c)
    if not calls:
        out += s.delta(text or "")
    out += s.finish(finish, stats)
    return "text/event-stream", b"".join(out)


ANSWERS = {"messages": anthropic_answer, "chat": chat_answer, "responses": responses_answer}


def dialect(path: str) -> str | None:
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/messages"):
        return "messages"
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/responses"):
        return "responses"
    return None


class Capture:
    """The stand-in server for one agent's run: requests recorded into `out`, the agent's
    main-loop requests (those offering tools) answered from SCRIPT in order."""

    def __init__(self, agent: str, out: Path, cwd: Path, model: str):
        self.agent, self.out, self.cwd, self.model = agent, out, cwd, model
        self.turn = 0
        self.seq = itertools.count(1)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.out.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, headers: dict, body: dict) -> tuple[int, str, bytes]:
        kind = dialect(path)
        with self.lock:
            n = next(self.seq)
            tools = tool_names(body)
            text, call = "Hello.", None
            if kind and tools and self.turn < len(SCRIPT):
                a = SCRIPT[self.turn]
                self.turn += 1
                call = None if a.kind == "text" else _call(self.agent, tools, a, self.cwd)
                text = a.arg if a.kind == "text" else "Done."
            record = {"n": n, "path": path, "headers": headers, "body": body, "loop": bool(tools)}
            atomic_write(self.out / f"{n:03d}.json", json.dumps(record, indent=1))
        if kind is None:
            return 404, "application/json", b'{"error": "not recorded"}'
        model = body.get("model") or self.model
        ctype, data = ANSWERS[kind](model, text, call, bool(body.get("stream")))
        return 200, ctype, data

    def _handler(self):
        cap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # the agent's output is what the user watches
                pass

            def do_GET(self):
                data = json.dumps(
                    {"object": "list", "data": [{"id": cap.model, "object": "model"}]}
                )
                self._send(200, "application/json", data.encode())

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"unparsed": raw.decode(errors="replace")}
                headers = {
                    k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS
                }
                status, ctype, data = cap.answer(self.path, headers, body)
                self._send(status, ctype, data)

            def _send(self, status, ctype, data):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
