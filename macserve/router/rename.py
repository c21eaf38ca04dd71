"""The one change the router makes to an upstream answer's bytes: the model's name."""

from __future__ import annotations

import json
import re


class Renamer:
    """Each JSON line's `"model": "..."` (an SSE event, or a whole body) rewritten to the name
    the client asked for: upstreams answer with their file path (llama-server) or their own id.
    Lines are held until their newline, so a name split across chunks is still found."""

    FIELD = re.compile(rb'(?<!\\)("model"\s*:\s*)"(?:[^"\\]|\\.)*"')

    def __init__(self, name: str | None):
        self.value = json.dumps(name).encode() if name else None
        self.buf = b""

    def _sub(self, b: bytes) -> bytes:
        value = self.value
        return self.FIELD.sub(lambda mt: mt.group(1) + value, b) if value else b

    def whole(self, b: bytes) -> bytes:
        return self._sub(b)

    def feed(self, chunk: bytes) -> bytes:
        if self.value is None:
            return chunk
        self.buf += chunk
        i = self.buf.rfind(b"\n")
        if i < 0:
            return b""
        out, self.buf = self.buf[: i + 1], self.buf[i + 1 :]
        return self._sub(out)

    def rest(self) -> bytes:
        out, self.buf = self._sub(self.buf), b""
        return out
