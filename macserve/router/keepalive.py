"""What a waiting streamed request is sent while the router starts its model (or waits for
the memory to start it), every `--keep-alive` seconds, so that neither a proxy nor a
client's read timeout gives up on a cold start. Each dialect gets what its clients read
without harm before the answer's first event:

- Anthropic's Messages API: its own `event: ping` (the anthropic SDKs skip them anywhere;
  an SSE comment would be dropped by the parser before a client's idle timer sees it);
- OpenAI chat completions: the SSE comment below (`macserve chat` shows it as progress) and,
  with the note on (the default), a chunk whose delta carries only `reasoning_content`
  ("loading NAME, 12 s"), which chat UIs and agents that read reasoning show as the model's
  thinking (llama-swap's way); `--no-loading-note` leaves the comment alone;
- everything else (completions, the Responses API): an SSE comment, since a note there would
  be an event of the answer itself (a second response.created, a completion's text).
"""

from __future__ import annotations

import json
import time

from ..web import anthropic_api, dialects


def note(name: str, waited: float) -> str:
    return f"loading {name}, {waited:.0f} s\n"


def event(path: str, asked: str, name: str, waited: float, loading_note: bool) -> bytes:
    """One keep-alive for a request to `path`, `waited` seconds after it arrived."""
    if dialects.for_path(path) is anthropic_api:
        return b'event: ping\ndata: {"type":"ping"}\n\n'
    comment = f": macserve router: starting {name} ({waited:.0f}s)\n\n".encode()
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
