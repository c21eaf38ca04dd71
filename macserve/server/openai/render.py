"""OpenAI's response shapes: a whole answer, a stream's chunks, usage (with llama-server's
`timings`, which `macserve chat` reads), log-probabilities and tool calls. (Its errors'
shape is web/openai_api.py's, shared with the router.)"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

from ..events import TokenLogprob, ToolCall
from ..request import GenerationRequest


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(stats: dict) -> dict:
    p, c = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)},
    }


def timings(stats: dict) -> dict:
    """llama-server's names, so clients written for it (and `macserve chat`) read ours too."""
    p_s, g_s = stats.get("prompt_seconds", 0.0), stats.get("generation_seconds", 0.0)
    out = {
        "prompt_n": stats.get("prompt_tokens", 0),
        "cache_n": stats.get("cached_tokens", 0),
        "prompt_ms": round(p_s * 1000, 3),
        "prompt_per_second": round(stats.get("prompt_tps", 0.0), 3),
        "predicted_n": stats.get("completion_tokens", 0),
        "predicted_ms": round(g_s * 1000, 3),
        "predicted_per_second": round(stats.get("generation_tps", 0.0), 3),
        "draft_n": stats.get("draft_tokens", 0),
        "draft_n_accepted": stats.get("accepted_tokens", 0),
    }
    if stats.get("mtp"):
        out["mtp"] = stats["mtp"]  # ours: drafting or not, why, --mtp auto's figures
    return out


def _lp_entry(raw: bytes, lp: float) -> dict:
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_lp_entry(e.raw, e.logprob), "top_logprobs": [_lp_entry(r, v) for r, v in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {r.decode("utf-8", errors="replace"): v for r, v in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def full_response(
    req: GenerationRequest,
    rid: str,
    model: str,
    text: str,
    finish: str,
    stats: dict,
    calls: list[ToolCall] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    reasoning: str = "",
) -> dict:
    if req.kind == "chat":
        msg: dict = {"role": "assistant", "content": text if (text or not calls) else None}
        if reasoning:  # the model's thinking: llama-server's and DeepSeek's field for it
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [tool_call_json(c) for c in calls]
        choice = {
            "index": 0,
            "message": msg,
            "logprobs": chat_logprobs(logprobs) if req.logprobs else None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(logprobs or []) if req.logprobs else None,
            "finish_reason": finish,
        }
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
    req: GenerationRequest,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None = None,
    stats: dict | None = None,
    role: bool = False,
    calls: list[ToolCall] | None = None,
    first_call: int = 0,
    logprobs: Sequence[TokenLogprob] | None = None,
    offset: int = 0,
    reasoning: str | None = None,
) -> dict:
    """One streamed chunk. `first_call`: the index of calls[0] among the answer's calls;
    `offset`: where `text` starts in the answer (the legacy logprobs' text_offset);
    `reasoning`: a piece of the model's thinking (`reasoning_content`)."""
    lp = None
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [tool_call_json(c, first_call + i) for i, c in enumerate(calls)]
        if req.logprobs and logprobs:
            lp = chat_logprobs(logprobs)
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        if req.logprobs and logprobs:
            lp = completion_logprobs(logprobs, offset)
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
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


def usage_chunk(req: GenerationRequest, rid: str, model: str, stats: dict) -> dict:
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
