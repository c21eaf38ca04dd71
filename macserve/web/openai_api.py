"""OpenAI's dialect of an HttpError: `{"error": {message, type, param, code}}` with the
error's own status; in a stream, a `data:` event with that body, then `data: [DONE]`."""

from __future__ import annotations

import json

from .errors import HttpError


def error_body(e: HttpError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_status(e: HttpError) -> int:
    return e.status


def error_event(e: HttpError) -> bytes:
    """The error as a stream's last events (the openai client raises on an `error` key)."""
    body = json.dumps(error_body(e), separators=(",", ":"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()
