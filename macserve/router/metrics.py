"""What the router sees of each answer it streams: time to first token, tokens/s, and the
engine's MTP acceptance, kept for the last minutes per model (the web page's chart).

Tokens/s is the server's own figure where it sends one (llama-server's and the engine's
`timings.predicted_per_second` in the last event); otherwise the router's: content events
(about one token each, or `usage.completion_tokens`) over the time from the first to the
last. Time to first token is the router's clock, from the request's arrival (a start on
demand included) to the first event that carries text.
"""

from __future__ import annotations

import json
import time
from collections import deque

WINDOW_S = 600.0  # the chart's span
MAX_SAMPLES = 2000  # a bound on memory whatever the request rate


class Meter:
    """One streamed answer, fed its raw SSE bytes as they pass."""

    def __init__(self, model: str, t0: float):
        self.model, self.t0 = model, t0
        self.first: float | None = None
        self.last = t0
        self.events = 0
        self.tokens: int | None = None  # usage.completion_tokens, when the server sends it
        self.timings: dict = {}
        self._buf = b""

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, raw: bytes) -> None:
        if raw == b"[DONE]" or not raw:
            return
        now = time.monotonic()
        if b'"timings"' in raw or b'"usage"' in raw:  # parse only the few events that count
            try:
                d = json.loads(raw)
            except ValueError:
                d = {}
            if isinstance(d.get("timings"), dict):
                self.timings = d["timings"]
            u = d.get("usage")
            if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
                self.tokens = u["completion_tokens"]
            if isinstance(u, dict) and isinstance(u.get("output_tokens"), int):
                self.tokens = u["output_tokens"]
        if b'"content":"' in raw.replace(b'": "', b'":"') or b'"text":"' in raw:
            if self.first is None:
                self.first = now
            self.events += 1
            self.last = now

    def sample(self) -> dict | None:
        """The answer's figures, or None if no text came back."""
        if self.first is None:
            return None
        t = self.timings
        n = self.tokens or t.get("predicted_n") or self.events
        tps, source = t.get("predicted_per_second"), "server"
        if not tps:
            span = self.last - self.first
            tps, source = ((n - 1) / span if n > 1 and span > 0 else None), "router"
        draft = (t.get("draft_n_accepted"), t.get("draft_n")) if t.get("draft_n") else None
        return {
            "t": round(time.time(), 3),
            "model": self.model,
            "ttft_s": round(self.first - self.t0, 3),
            "tps": None if tps is None else round(float(tps), 2),
            "tps_source": source,
            "tokens": n,
            "draft": draft,  # (accepted, drafted): the engine's MTP acceptance
        }


class Metrics:
    """The samples of the last WINDOW_S seconds, numbered so a reader asks for what is new."""

    def __init__(self):
        self.samples: deque[tuple[int, dict]] = deque(maxlen=MAX_SAMPLES)
        self.seq = 0

    def add(self, s: dict | None) -> None:
        if s is not None:
            self.seq += 1
            self.samples.append((self.seq, s))

    def since(self, seq: int) -> tuple[int, list[dict]]:
        cut = time.time() - WINDOW_S
        while self.samples and self.samples[0][1]["t"] < cut:
            self.samples.popleft()
        return self.seq, [s for n, s in self.samples if n > seq]
