"""OpenAI request bodies in, a validated GenRequest out; OpenAI response shapes back.

Validation names the field and what was expected, as OpenAI's own 400s do, so a client
author sees the mistake without reading the server log. Unknown fields are ignored (clients
send penalties, logit_bias, user, ...), but fields whose meaning we would silently change
(n > 1, echo, logprobs, tools) are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
# Fields we would otherwise silently ignore, with the values that mean "not asked for".
_REFUSED = {
    "tools": (None, []),
    "functions": (None, []),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type_,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    model: str | None = None


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, key: str, check, expected: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise ApiError(400, f"{key} must be {expected}, got {json.dumps(v)[:60]}", key)
    return v


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    # The array form: [{"type": "text", "text": "..."}]; other part types need a vision model.
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", where)
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def _common(body: dict, req: GenRequest) -> GenRequest:
    req.model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is not None:
        if not _is_int(mt) or mt < 1:
            raise ApiError(400, f"{key} must be a positive integer, got {json.dumps(mt)[:60]}", key)
        req.max_tokens = mt
    req.temperature = float(
        _opt(body, "temperature", lambda v: _is_num(v) and 0 <= v <= 2, "a number from 0 to 2", 1.0)
    )
    req.top_p = float(
        _opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    )
    req.stream = _opt(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    so = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    req.include_usage = bool(so.get("include_usage"))
    req.seed = _opt(body, "seed", _is_int, "an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", "stop")
    req.stop = stop or []
    if _opt(body, "n", _is_int, "an integer", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    for key, harmless in _REFUSED.items():
        if body.get(key) not in harmless:
            raise ApiError(400, f"{key} is not supported by this server", key)
    return req


def parse_chat(body: dict) -> GenRequest:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "messages is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", where)
        if m.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        if "content" not in m:
            raise ApiError(400, f"{where}.content is required", f"{where}.content")
        out.append({"role": m["role"], "content": _text(m["content"], f"{where}.content")})
    return _common(body, GenRequest("chat", messages=out))


def parse_completion(body: dict) -> GenRequest:
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "prompt is required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]  # the one-prompt batch form clients send
    if isinstance(p, list):
        if not p or not all(_is_int(t) and t >= 0 for t in p):
            raise ApiError(
                400, "prompt must be a string, or a non-empty list of token ids", "prompt"
            )
    elif not isinstance(p, str) or not p:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    return _common(body, GenRequest("completion", prompt=p))


class StopMatcher:
    """Cuts the output at the first stop string. Text that might be the start of a stop
    string is held back until the next token decides, so a streamed stop string never leaks."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, hit a stop string)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---- responses --------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(stats: dict) -> dict:
    p, c = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def timings(stats: dict) -> dict:
    """llama-server's names, so clients written for it (and `macserve chat`) read ours too."""
    p_s, g_s = stats.get("prompt_seconds", 0.0), stats.get("generation_seconds", 0.0)
    return {
        "prompt_n": stats.get("prompt_tokens", 0),
        "prompt_ms": round(p_s * 1000, 3),
        "prompt_per_second": round(stats.get("prompt_tps", 0.0), 3),
        "predicted_n": stats.get("completion_tokens", 0),
        "predicted_ms": round(g_s * 1000, 3),
        "predicted_per_second": round(stats.get("generation_tps", 0.0), 3),
        "draft_n": stats.get("draft_tokens", 0),
        "draft_n_accepted": stats.get("accepted_tokens", 0),
    }


def full_response(
    req: GenRequest, rid: str, model: str, text: str, finish: str, stats: dict
) -> dict:
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(stats),
        "timings": timings(stats),
    }


def chunk(
    req: GenRequest,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None = None,
    stats: dict | None = None,
    role: bool = False,
) -> dict:
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if stats is not None:
        out["usage"] = usage(stats)
        out["timings"] = timings(stats)
    return out


def usage_chunk(req: GenRequest, rid: str, model: str, stats: dict) -> dict:
    """OpenAI's stream_options.include_usage: a last chunk with no choices."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(stats),
        "timings": timings(stats),
    }


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
