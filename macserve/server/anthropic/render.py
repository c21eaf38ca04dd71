"""Anthropic's response shapes: a whole message, the Messages API's stream of events, usage
and stop reasons, and the fields its models API adds. (Its errors' shape is
web/anthropic_api.py's, shared with the router.)"""

from __future__ import annotations

import json
import time
import uuid

from ..events import ToolCall


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(finish: str, calls: int, window: bool = False) -> str:
    """`window`: a length finish came from the context's end (max_tokens was cut to fit)."""
    if calls and finish in ("stop", "tool_calls"):
        return "tool_use"
    if finish == "length" and window:
        return "model_context_window_exceeded"
    return {"length": "max_tokens", "stop_sequence": "stop_sequence"}.get(finish, "end_turn")


def usage(stats: dict) -> dict:
    """Anthropic's split: `input_tokens` are those not read from the cache."""
    cached = stats.get("cached_tokens", 0)
    return {
        "input_tokens": stats.get("prompt_tokens", 0) - cached,
        "output_tokens": stats.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def message(
    rid: str,
    model: str,
    text: str,
    calls: list[ToolCall],
    finish: str,
    stop_seq: str | None,
    stats: dict,
    window: bool = False,
    thinking: str = "",
) -> dict:
    content: list[dict] = []
    if thinking:
        # No signature: nothing here signs thinking (and blocks sent back are dropped).
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text or not (calls or thinking):
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input()} for c in calls]
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, len(calls), window),
        "stop_sequence": stop_seq,
        "usage": usage(stats),
    }


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Stream:
    """The Messages API's event sequence: message_start, then content blocks (start, deltas,
    stop), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, rid: str, model: str, prompt_tokens: int, cached: int = 0):
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self.cached = cached  # prompt tokens the prompt cache gave (known once the job starts)
        self.index = -1
        self.open: str | None = None  # the type of the block being written
        self.calls = 0

    def start(self) -> list[bytes]:
        msg = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage({"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached}),
        }
        return [
            event("message_start", {"type": "message_start", "message": msg}),
            event("ping", {"type": "ping"}),
        ]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            sig = {"type": "signature_delta", "signature": ""}
            out.append(
                event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": self.index, "delta": sig},
                )
            )
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return out + [event("content_block_stop", stop)]

    def _begin(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [event("content_block_start", start)]

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._begin({"type": "text", "text": ""})
        delta = {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {"type": "text_delta", "text": text},
        }
        return out + [event("content_block_delta", delta)]

    def thinking(self, text: str) -> list[bytes]:
        """A piece of the model's reasoning, in a `thinking` block (streamed as thinking
        deltas; closed by an empty signature delta, as Anthropic closes its own)."""
        out = (
            []
            if self.open == "thinking"
            else self._begin({"type": "thinking", "thinking": "", "signature": ""})
        )
        delta = {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {"type": "thinking_delta", "thinking": text},
        }
        return out + [event("content_block_delta", delta)]

    def call(self, c: ToolCall) -> list[bytes]:
        self.calls += 1
        out = self._begin({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
        delta = {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {
                "type": "input_json_delta",
                "partial_json": json.dumps(c.input(), ensure_ascii=False),
            },
        }
        return out + [event("content_block_delta", delta)] + self._close()

    def finish(
        self, finish: str, stop_seq: str | None, stats: dict, window: bool = False
    ) -> list[bytes]:
        out = (
            self._close()
            if self.index >= 0
            else self._begin({"type": "text", "text": ""}) + self._close()
        )
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(finish, self.calls, window),
                "stop_sequence": stop_seq,
            },
            "usage": usage(stats),
        }
        return out + [
            event("message_delta", delta),
            event("message_stop", {"type": "message_stop"}),
        ]


def models_entry(model_id: str) -> dict:
    """The fields Anthropic's models API adds to an entry (its clients read these)."""
    return {
        "type": "model",
        "display_name": model_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(0)),
    }
