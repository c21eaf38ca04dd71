"""Which API a request speaks, from its path, and an HttpError in that API's shape: the one
place the servers choose between `openai_api` and `anthropic_api` for an error."""

from __future__ import annotations

import json
from types import ModuleType

from starlette.responses import Response

from . import anthropic_api, openai_api
from .errors import HttpError


def for_path(path: str) -> ModuleType:
    """Anthropic's Messages API lives under /v1/messages; everything else is OpenAI's."""
    return anthropic_api if path.startswith("/v1/messages") else openai_api


def error_parts(e: HttpError, path: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (content-type included) and body bytes, for a plain ASGI sender."""
    api = for_path(path)
    body = json.dumps(api.error_body(e), ensure_ascii=False, separators=(",", ":")).encode()
    return api.error_status(e), {"content-type": "application/json", **e.headers()}, body


def error_response(e: HttpError, path: str) -> Response:
    status, headers, body = error_parts(e, path)
    return Response(body, status, headers=headers)


def error_event(e: HttpError, path: str) -> bytes:
    """The error as a stream's last event, for a stream whose 200 is already sent."""
    return for_path(path).error_event(e)
