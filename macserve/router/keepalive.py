"""What a waiting streamed request is sent while the router starts its model (or waits for
the memory to start it), every `--keep-alive` seconds, so that neither a proxy nor a
client's read timeout gives up on a cold start; and, with the loading note on (the default;
`--no-loading-note` leaves only the keep-alives), a note the client shows, "loading NAME,
12 s", one line a tick, in each dialect's place for the model's reasoning, never in the
answer itself (an agent keeps its answers in the conversation; the note would go back to
the model in the next turn):

- OpenAI chat completions: an SSE comment (`macserve chat` shows it as progress) and a
  chunk whose delta carries only `reasoning_content` (llama-swap's way: chat UIs and agents
  that read reasoning show it as the model's thinking). Chunks stand alone, so the answer's
  own chunks follow as the server wrote them.
- Anthropic's Messages API: the answer's `message_start` (the router's, with the model asked
  for) and a `thinking` block holding the note, one thinking delta a tick (Claude Code shows
  it as the model's thinking, and drops thinking from the turns it sends back). Once the
  server answers, the block is closed and the server's stream follows with its own
  `message_start` left out, its content blocks numbered after the note's, and its usage's
  prompt counts carried to `message_delta` when the server put them only in the start.
  Without the note: Anthropic's own `event: ping` (the anthropic SDKs skip them anywhere; an
  SSE comment would be dropped by the parser before a client's idle timer sees it).
- The Responses API: `response.created` (the router's) and a `reasoning` item whose
  summary holds the note (a summary is what Codex shows of reasoning by default), one
  summary delta a tick. The server's stream follows without its own created and in_progress,
  its output indexes after the note's item, its sequence numbers continuing the router's,
  and its final response given the router's id with the note's item first in its output
  (the openai SDK checks that a stream's response keeps one id).
- everything else (completions): an SSE comment, since a note there would be the answer's
  text.
"""

from __future__ import annotations

import json
import time

from ..web import anthropic_api, dialects
from ..web import responses_api as responses


def note(name: str, waited: float) -> str:
    return f"loading {name}, {waited:.0f} s\n"


def _comment(name: str, waited: float) -> bytes:
    return f": macserve router: starting {name} ({waited:.0f}s)\n\n".encode()


PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def event(path: str, asked: str, name: str, waited: float, loading_note: bool) -> bytes:
    """One keep-alive for a request to `path`, `waited` seconds after it arrived, for the
    dialects whose note stands alone (and Anthropic's without a note: a ping)."""
    if dialects.for_path(path) is anthropic_api:
        return PING
    comment = _comment(name, waited)
    if loading_note and path == "/v1/chat/completions":
        chunk = {
            "id": "chatcmpl-loading",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": asked,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": note(name, waited)},
                    "finish_reason": None,
                }
            ],
        }
        return comment + b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return comment


class Kept:
    """One waiting request: `tick` is sent at each keep-alive, then the server's stream goes
    through `feed` (and `rest` at its end). Here: the stand-alone keep-alives, the stream
    unchanged."""

    def __init__(self, path: str, asked: str, name: str, loading_note: bool):
        self.path, self.asked, self.name, self.loading_note = path, asked, name, loading_note

    def tick(self, waited: float) -> bytes:
        return event(self.path, self.asked, self.name, waited, self.loading_note)

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def rest(self) -> bytes:
        return b""


class _Rewritten(Kept):
    """A note that opens the answer's own stream: the server's events then rewritten one
    whole SSE event at a time (`_event`), the bytes of an event cut across chunks held."""

    def __init__(self, *a):
        super().__init__(*a)
        self.noted = False  # a tick has been sent: the server's stream is rewritten after it
        self.closed = False  # the note's block or item was closed
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.noted:
            return chunk
        out = b"" if self.closed else self._close()
        self.closed = True
        self._buf += chunk
        *events, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        return out + b"".join(self._rewrite(e) for e in events if e.strip())

    def rest(self) -> bytes:
        if not self.noted:
            return b""
        buf, self._buf = self._buf, b""
        return self.feed(b"") + (self._rewrite(buf) if buf.strip() else b"")

    def _rewrite(self, raw: bytes) -> bytes:
        name, data = None, None
        for line in raw.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                try:
                    data = json.loads(line[5:].strip())
                except ValueError:
                    data = None
        if not isinstance(data, dict):
            return raw + b"\n\n"  # a comment, [DONE], an error in another shape: as it is
        kept = self._event(data)
        if kept is None:
            return b""
        head = f"event: {name}\n" if name else ""
        return (head + "data: " + json.dumps(kept, separators=(",", ":")) + "\n\n").encode()

    def _close(self) -> bytes:
        raise NotImplementedError

    def _event(self, data: dict) -> dict | None:
        raise NotImplementedError


def _sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class _Messages(_Rewritten):
    """Anthropic's Messages API: the note in a thinking block at index 0."""

    def __init__(self, *a):
        super().__init__(*a)
        self.start_usage: dict = {}  # the server's message_start usage

    def tick(self, waited: float) -> bytes:
        out = b""
        if not self.noted:
            self.noted = True
            msg: dict = {
                "id": "msg_" + responses.new_id().removeprefix("resp_"),
                "type": "message",
                "role": "assistant",
                "model": self.asked,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out = _sse("message_start", {"type": "message_start", "message": msg}) + _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        delta = {"type": "thinking_delta", "thinking": note(self.name, waited)}
        return out + _sse(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def _close(self) -> bytes:
        sig = {"type": "signature_delta", "signature": ""}
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": sig}
        ) + _sse("content_block_stop", {"type": "content_block_stop", "index": 0})

    def _event(self, data: dict) -> dict | None:
        kind = data.get("type")
        if kind == "message_start":
            self.start_usage = (data.get("message") or {}).get("usage") or {}
            return None
        if kind in ("content_block_start", "content_block_delta", "content_block_stop"):
            return {**data, "index": int(data.get("index", 0)) + 1}
        if kind == "message_delta":
            return {**data, "usage": {**self.start_usage, **(data.get("usage") or {})}}
        return data


class _Responses(_Rewritten):
    """The Responses API: the note in a reasoning item's summary at output index 0."""

    def __init__(self, *a):
        super().__init__(*a)
        self.stream = responses.Stream(responses.new_id(), self.asked, {})

    def tick(self, waited: float) -> bytes:
        out = [] if self.noted else self.stream.start()
        self.noted = True
        return b"".join(out + self.stream.reasoning(note(self.name, waited), summary=True))

    def _close(self) -> bytes:
        return b"".join(self.stream.close())

    def _event(self, data: dict) -> dict | None:
        kind = data.get("type")
        if kind in ("response.created", "response.in_progress"):
            return None
        out = dict(data)
        notes = self.stream.output
        if "output_index" in out:
            out["output_index"] = int(out["output_index"]) + len(notes)
        if "sequence_number" in out:
            out["sequence_number"] = self.stream.seq
            self.stream.seq += 1
        if isinstance(out.get("response"), dict):
            r = out["response"]
            out["response"] = {
                **r,
                "id": self.stream.rid,
                "output": notes + (r.get("output") or []),
            }
        return out


def for_request(path: str, asked: str, name: str, loading_note: bool) -> Kept:
    """What a streamed request to `path` is sent while it waits."""
    if loading_note and dialects.for_path(path) is anthropic_api:
        return _Messages(path, asked, name, loading_note)
    if loading_note and path == "/v1/responses":
        return _Responses(path, asked, name, loading_note)
    return Kept(path, asked, name, loading_note)
