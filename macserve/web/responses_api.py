"""OpenAI's Responses API's answers (`POST /v1/responses`), shared by the engine's route
(server/responses/) and the router's translation for servers without it (router/responses.py):
a `response` object (its output items: a `reasoning` item with the model's thinking as
`reasoning_text`, or a note as `summary_text`; an assistant `message` with `output_text`
parts; `function_call` items), usage, and the stream of typed events (response.created,
response.output_item.added, response.output_text.delta,
response.function_call_arguments.delta/done, ..., response.completed), each event's JSON
carrying its `type` and a `sequence_number`. Its errors are OpenAI's (openai_api.py); its
request body is responses_input.py's."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex[:24]


def _item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage(stats: dict) -> dict:
    p, c = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
    return {
        "input_tokens": p,
        # cache_write_tokens: what a provider bills for storing; nothing here is billed.
        "input_tokens_details": {
            "cached_tokens": stats.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": stats.get("reasoning_tokens", 0)},
        "total_tokens": p + c,
    }


def status_of(finish: str | None) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for a job's finish reason."""
    if finish is None:
        return "in_progress", None
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response(rid: str, model: str, echo: dict, created: int, output: list, finish, stats) -> dict:
    status, incomplete = status_of(finish)
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage(stats) if stats is not None else None,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "user": None,
        **echo,
    }


def message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [text_part(text)] if status == "completed" else [],
    }


def reasoning_item(rid: str, text: str, status: str = "completed", summary: bool = False) -> dict:
    """The model's thinking as `reasoning_text` content (what OpenAI's open-weight models
    return); `summary`: as a `summary_text` part instead (what Codex shows by default)."""
    parts = [] if status != "completed" else [{"type": kind_of(summary), "text": text}]
    return {
        "type": "reasoning",
        "id": rid,
        "status": status,
        "summary": parts if summary else [],
        "content": [] if summary else parts,
    }


def kind_of(summary: bool) -> str:
    return "summary_text" if summary else "reasoning_text"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(frozen=True)
class Call:
    """A function call as the output writes it: its id, the function, its JSON arguments."""

    id: str
    name: str
    arguments: str


def call_item(fid: str, c: Call, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": fid,
        "call_id": c.id,
        "name": c.name,
        "arguments": arguments,
        "status": status,
    }


def whole(
    rid, model, echo, text: str, calls: list[Call], finish: str, stats, thinking: str = ""
) -> dict:
    output = []
    if thinking:
        output.append(reasoning_item(_item_id("rs_"), thinking))
    if text or not calls:
        output.append(message_item(_item_id("msg_"), text))
    output += [call_item(_item_id("fc_"), c, c.arguments) for c in calls]
    return response(rid, model, echo, int(time.time()), output, finish, stats)


class Stream:
    """The event sequence of one streamed response: created and in_progress, then each
    output item (added, its parts or arguments as deltas, done), then completed (or
    incomplete, or failed)."""

    def __init__(self, rid: str, model: str, echo: dict):
        self.rid, self.model, self.echo = rid, model, echo
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict] = []
        self.text: str | None = None  # the open message's text so far (None: no message open)
        self.mid = ""
        self.thought: str | None = None  # the open reasoning item's text so far
        self.summary = False  # the open reasoning item writes a summary (a note), not content
        self.rsid = ""

    def _event(self, kind: str, **data) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def _response(self, finish=None, stats=None) -> dict:
        return response(self.rid, self.model, self.echo, self.created, self.output, finish, stats)

    def start(self) -> list[bytes]:
        r = self._response()
        return [
            self._event("response.created", response=r),
            self._event("response.in_progress", response=r),
        ]

    def _index(self) -> int:
        return len(self.output)

    def reasoning(self, text: str, summary: bool = False) -> list[bytes]:
        """A piece of reasoning: the model's thinking (`reasoning_text` deltas), or with
        `summary` a note (`summary_text` deltas), in a reasoning item opened by the first."""
        out = self._close_message()
        i = self._index()
        if self.thought is None:
            self.thought, self.rsid, self.summary = "", _item_id("rs_"), summary
            item = reasoning_item(self.rsid, "", "in_progress", summary)
            out.append(self._event("response.output_item.added", output_index=i, item=item))
            part = {"type": kind_of(summary), "text": ""}
            where = {"summary_index": 0} if summary else {"content_index": 0}
            added = "reasoning_summary_part" if summary else "content_part"
            out.append(
                self._event(
                    f"response.{added}.added", item_id=self.rsid, output_index=i, **where, part=part
                )
            )
        self.thought += text
        kind = "reasoning_summary_text" if self.summary else "reasoning_text"
        where = {"summary_index": 0} if self.summary else {"content_index": 0}
        out.append(
            self._event(
                f"response.{kind}.delta", item_id=self.rsid, output_index=i, **where, delta=text
            )
        )
        return out

    def _close_reasoning(self) -> list[bytes]:
        if self.thought is None:
            return []
        i, text, summary = self._index(), self.thought, self.summary
        where = {"summary_index": 0} if summary else {"content_index": 0}
        ref = {"item_id": self.rsid, "output_index": i, **where}
        kind = "reasoning_summary_text" if summary else "reasoning_text"
        part = "reasoning_summary_part" if summary else "content_part"
        out = [
            self._event(f"response.{kind}.done", **ref, text=text),
            self._event(
                f"response.{part}.done", **ref, part={"type": kind_of(summary), "text": text}
            ),
        ]
        item = reasoning_item(self.rsid, text, summary=summary)
        self.output.append(item)
        self.thought = None
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def delta(self, text: str) -> list[bytes]:
        out = self._close_reasoning()
        if self.text is None:
            self.text, self.mid = "", _item_id("msg_")
            item = message_item(self.mid, "", "in_progress")
            out.append(
                self._event("response.output_item.added", output_index=self._index(), item=item)
            )
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.mid,
                    output_index=self._index(),
                    content_index=0,
                    part=text_part(""),
                )
            )
        self.text += text
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.mid,
                output_index=self._index(),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def close(self) -> list[bytes]:
        """Closes the open item (what a stream another writes continues after)."""
        return self._close_text()

    def _close_text(self) -> list[bytes]:
        """Closes the open item: a message, or a reasoning item."""
        return self._close_message() + self._close_reasoning()

    def _close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        i, text, mid = self._index(), self.text, self.mid
        ref = {"item_id": mid, "output_index": i, "content_index": 0}
        out = [
            self._event("response.output_text.done", **ref, text=text, logprobs=[]),
            self._event("response.content_part.done", **ref, part=text_part(text)),
        ]
        item = message_item(mid, text)
        self.output.append(item)
        self.text = None
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def call(self, c: Call) -> list[bytes]:
        out = self._close_text()
        i, fid = self._index(), _item_id("fc_")
        added = call_item(fid, c, "", "in_progress")
        done = call_item(fid, c, c.arguments)
        self.output.append(done)
        return out + [
            self._event("response.output_item.added", output_index=i, item=added),
            self._event(
                "response.function_call_arguments.delta",
                item_id=fid,
                output_index=i,
                delta=c.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=fid,
                output_index=i,
                name=c.name,
                arguments=c.arguments,
            ),
            self._event("response.output_item.done", output_index=i, item=done),
        ]

    def finish(self, finish: str, stats: dict) -> list[bytes]:
        out = self._close_text()
        if not self.output or all(o["type"] == "reasoning" for o in self.output):
            # an empty answer (or one that only thought) is still one (empty) message
            out += self.delta("") + self._close_text()
        r = self._response(finish, stats)
        kind = "response.completed" if r["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=r)]

    def failed(self, code: str, message: str) -> bytes:
        r = self._response()
        r["status"], r["error"] = "failed", {"code": code, "message": message}
        return self._event("response.failed", response=r)
