"""Anthropic's dialect of an HttpError: `{"type": "error", "error": {type, message}}`, the type
named by the status as Anthropic names it, and 529 for "overloaded" (our 503s); in a stream,
an `event: error`."""

from __future__ import annotations

import json

from .errors import HttpError

# Anthropic's error types, by HTTP status (docs.anthropic.com, "Errors").
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "try again later" (its clients retry it)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(e: HttpError) -> dict:
    return {"type": "error", "error": {"type": error_type(e.status), "message": e.message}}


def error_status(e: HttpError) -> int:
    return OVERLOADED if e.status == 503 else e.status


def error_event(e: HttpError) -> bytes:
    """The error as a stream's last event (the anthropic client raises on `event: error`)."""
    body = json.dumps(error_body(e), separators=(",", ":"))
    return f"event: error\ndata: {body}\n\n".encode()
