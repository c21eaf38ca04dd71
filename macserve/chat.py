"""Terminal chat against any OpenAI-compatible server (macserve serve, llama-server, mlx_lm).

Talks plain HTTP + SSE with httpx, so it needs nothing from the server beyond
/v1/chat/completions. Speed figures come from the server's llama-server-style `timings` when
it sends them (those count tokens exactly and include MTP draft counts); otherwise from the
client's own clock and the streamed chunk count.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from .errors import MacserveError
from .fileio import atomic_write

HELP = """commands:
  /clear         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt; /system alone clears it
  /stats         speed of the last answer and of the session
  /save FILE     write the conversation as JSON
  /bye           leave (also /exit, /quit, Ctrl-D)"""

# An answer's length when --max-tokens is not given: a few paragraphs. Servers' own defaults
# run to the context (llama-server: -1, until the context is full) or to a fixed cap that
# prints a page of a model that never ends its turn.
DEFAULT_MAX_TOKENS = 512


# ---- where to talk to --------------------------------------------------------------------------


def url_of(target: str) -> str | None:
    """A base URL (without /v1) for a URL or HOST:PORT target; None for anything else (a
    profile name, which the caller resolves)."""
    if re.match(r"^https?://", target):
        return re.sub(r"/+(v1/*)?$", "", target)
    if re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", target):
        return f"http://{target}"  # profile names cannot contain ':'
    return None


# ---- one streamed answer -----------------------------------------------------------------------


@dataclass
class TurnStats:
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    seconds: float = 0.0  # request sent -> last byte
    ttft: float | None = None  # request sent -> first text
    tokens_per_s: float | None = None
    tps_source: str = "client"  # "server" when taken from timings.predicted_per_second
    draft_n: int | None = None
    draft_accepted: int | None = None
    mtp: dict | None = None  # macserve serve's timings.mtp: drafting or not, and why
    finish_reason: str | None = None

    def line(self) -> str:
        parts = [f"{self.completion_tokens} tokens"]
        if self.tokens_per_s:
            parts.append(
                f"{self.tokens_per_s:.1f} tok/s"
                + (" (server)" if self.tps_source == "server" else "")
            )
        if self.ttft is not None:
            parts.append(f"first token {self.ttft:.2f} s")
        if self.draft_n:
            parts.append(
                f"draft acceptance {self.draft_accepted / self.draft_n:.0%} "
                f"({self.draft_accepted}/{self.draft_n})"
            )
        if self.mtp:
            parts.append(mtp_text(self.mtp))
        if self.finish_reason == "length":
            parts.append("cut at max_tokens")
        return ", ".join(parts)


def mtp_text(st: dict) -> str:
    """`MTP on|off (why[: figures])` from a macserve serve's `timings.mtp`."""
    out = f"MTP {'on' if st.get('drafting') else 'off'} ({st.get('why', '?')}"
    if "draft_tps" in st:
        acc = ", ".join(f"{a:.2f}" for a in st.get("acceptance") or [])
        out += (
            f": drafting {st['draft_tps']:.1f} tok/s, plain {st['plain_tps']:.1f} tok/s, "
            f"acceptance {acc}"
        )
    return out + ")"


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = r.text[:200]
    return f"server answered {r.status_code}: {' '.join(str(msg).split())}"


def check_key(api_key: str | None) -> None:
    """A key no HTTP client can send (httpx would raise encoding the header) is one line, said
    before anything is started or sent."""
    if api_key and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
        raise MacserveError(
            "the API key is not printable ASCII, so no client can send it "
            "(set a new one: macserve set NAME -- API_KEY=...)"
        )


class Client:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        on_note: Callable[[str], None] | None = None,
        routed: str | None = None,
    ):
        """`on_note(text)`: the server's progress comments while it prepares an answer
        (`: macserve router: starting NAME (Ns)`, sent while the router loads a model).
        `routed`: the model's name when base_url is a router: while a request waits, its
        state in the router's listing is shown through on_note each second. The router's
        own comments start only after its --keep-alive (10 s), because the first one commits
        the answer to a 200: the listing says so from the first second."""
        self.base_url = base_url
        self.on_note = on_note
        self.routed = routed
        check_key(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=5.0)
        )
        self.timeout = timeout

    def _fail(self, e: httpx.HTTPError) -> MacserveError:
        if isinstance(e, httpx.ConnectError):
            return MacserveError(
                f"cannot reach {self.base_url}: {' '.join(str(e).split()) or 'connection failed'}"
            )
        if isinstance(e, httpx.TimeoutException):
            return MacserveError(f"no answer from {self.base_url} within {self.timeout:.0f} s")
        return MacserveError(f"{self.base_url}: {type(e).__name__}: {' '.join(str(e).split())}")

    def model_id(self) -> str | None:
        """The served model's id, or None for a server without /v1/models (the field is
        optional to llama-server and ours)."""
        try:
            r = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        if r.status_code in (401, 403):
            raise MacserveError(_error_text(r))
        try:
            return r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None

    def stream_chat(self, body: dict) -> Iterator[str | TurnStats]:
        """Yields text pieces as they arrive, then one TurnStats."""
        st = TurnStats()
        chunks = 0
        t0 = time.perf_counter()
        answered, lock = threading.Event(), threading.Lock()
        if self.routed and self.on_note is not None:
            threading.Thread(
                target=self._watch_start, args=(answered, lock, t0), daemon=True
            ).start()
        try:
            with self.http.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as r:
                with lock:  # no progress line once the answer has begun
                    answered.set()
                if r.status_code >= 400:
                    r.read()
                    raise MacserveError(_error_text(r))
                for data in _sse_data(r.iter_lines(), self._note):
                    if data == "[DONE]":
                        break
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        raise MacserveError(
                            f"server sent a line that is not JSON: {data[:80]!r}"
                        ) from None
                    if "error" in ev:
                        err = ev["error"]
                        raise MacserveError(
                            f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
                        )
                    _take_stats(st, ev)
                    for ch in ev.get("choices") or []:
                        st.finish_reason = ch.get("finish_reason") or st.finish_reason
                        text = (ch.get("delta") or {}).get("content")
                        if text:
                            if st.ttft is None:
                                st.ttft = time.perf_counter() - t0
                            chunks += 1
                            yield text
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        finally:
            answered.set()
        st.seconds = time.perf_counter() - t0
        if not st.completion_tokens:
            st.completion_tokens = chunks  # servers without usage: one chunk is about one token
        if st.tokens_per_s is None and st.ttft is not None and st.seconds > st.ttft:
            st.tokens_per_s = max(st.completion_tokens - 1, 0) / (st.seconds - st.ttft) or None
        yield st

    def _watch_start(self, answered: threading.Event, lock: threading.Lock, t0: float) -> None:
        while not answered.wait(1.0):
            try:
                r = httpx.get(self.base_url + "/v1/models", headers=self.http.headers, timeout=2.0)
                data = r.json()["data"]
                state = next((m.get("state") for m in data if m.get("id") == self.routed), None)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                continue  # progress is a courtesy: the answer's own wait goes on
            with lock:
                if state == "starting" and not answered.is_set():
                    secs = time.perf_counter() - t0
                    self._note(f"macserve router: starting {self.routed} ({secs:.0f}s)")

    def _note(self, comment: str) -> None:
        if self.on_note is not None and comment.startswith("macserve router:"):
            self.on_note(comment)


def _sse_data(lines, on_comment: Callable[[str], None] | None = None) -> Iterator[str]:
    # One JSON object per `data:` line is what OpenAI, llama-server and we send; multi-line
    # data fields (legal SSE, unused by them) are joined per event for completeness. A comment
    # line (`: text`) goes to on_comment.
    buf: list[str] = []
    for line in lines:
        if line.startswith(":"):
            if on_comment is not None:
                on_comment(line[1:].strip())
        elif line.startswith("data:"):
            buf.append(line[5:].lstrip(" "))
        elif not line.strip() and buf:
            yield "\n".join(buf)
            buf = []
    if buf:
        yield "\n".join(buf)


def _take_stats(st: TurnStats, ev: dict) -> None:
    u = ev.get("usage")
    if isinstance(u, dict):
        st.completion_tokens = u.get("completion_tokens") or st.completion_tokens
        st.prompt_tokens = u.get("prompt_tokens", st.prompt_tokens)
    t = ev.get("timings")
    if isinstance(t, dict):
        if t.get("predicted_n"):
            st.completion_tokens = t["predicted_n"]
        if t.get("predicted_per_second"):
            st.tokens_per_s, st.tps_source = float(t["predicted_per_second"]), "server"
        if "draft_n" in t:
            st.draft_n, st.draft_accepted = t.get("draft_n") or 0, t.get("draft_n_accepted") or 0
        if isinstance(t.get("mtp"), dict):
            st.mtp = t["mtp"]


_ROOM = re.compile(
    r"prompt \((\d+) tokens\) \+ max_tokens \((\d+)\) is more than the context \((\d+)\)"
)


# ---- the session --------------------------------------------------------------------------------


class Session:
    def __init__(
        self,
        client: Client,
        model: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        mtp: str | None = None,
    ):
        self.client = client
        self.model = model
        self.system = system
        self.params = {
            k: v
            for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("mtp", mtp))
            if v is not None
        }
        self.messages: list[dict] = []
        self.turns: list[TurnStats] = []
        # the default cap, not the user's: shrunk to fit a small context (`_stream`)
        self.default_max = max_tokens == DEFAULT_MAX_TOKENS

    def request(self) -> dict:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        body = {"messages": msgs, "stream_options": {"include_usage": True}, **self.params}
        if self.model:
            body["model"] = self.model
        return body

    def ask(self, text: str, on_text: Callable[[str], None]) -> TurnStats:
        """One turn; the history only keeps it once the whole answer has arrived."""
        self.messages.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            for item in self._stream():
                if isinstance(item, TurnStats):
                    stats = item
                else:
                    parts.append(item)
                    on_text(item)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        self.turns.append(stats)
        return stats

    def _stream(self) -> Iterator[str | TurnStats]:
        """The answer; the default max_tokens (not one the user gave) shrunk to the room the
        context leaves, when the server refuses it as too long (`macserve serve` does;
        llama-server and mlx_lm shorten it themselves)."""
        try:
            yield from self.client.stream_chat(self.request())
        except MacserveError as e:
            room = _ROOM.search(str(e))
            if not (self.default_max and room):
                raise
            left = int(room.group(3)) - int(room.group(1))
            if left < 1:
                raise
            self.params["max_tokens"] = left
            try:
                yield from self.client.stream_chat(self.request())
            finally:
                self.params["max_tokens"] = DEFAULT_MAX_TOKENS

    def clear(self) -> None:
        self.messages.clear()

    def stats_text(self) -> str:
        if not self.turns:
            return "no answers yet"
        last = self.turns[-1]
        toks = sum(t.completion_tokens for t in self.turns)
        gen = sum(t.seconds - (t.ttft or 0) for t in self.turns)
        lines = [
            f"last: {last.line()}, {last.seconds:.2f} s total",
            f"session: {len(self.turns)} answer{'' if len(self.turns) == 1 else 's'}, {toks} tokens"
            + (f", {toks / gen:.1f} tok/s overall (client clock)" if gen > 0 else ""),
        ]
        dn = sum(t.draft_n or 0 for t in self.turns)
        if dn:
            da = sum(t.draft_accepted or 0 for t in self.turns)
            lines.append(f"draft acceptance: {da / dn:.0%} ({da}/{dn})")
        return "\n".join(lines)

    def save(self, path: str) -> Path:
        p = Path(path).expanduser()
        doc = {
            "url": self.client.base_url,
            "model": self.model,
            "system": self.system,
            "messages": self.messages,
            "turns": [asdict(t) for t in self.turns],
        }
        try:
            atomic_write(p, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise MacserveError(f"cannot write {p}: {e.strerror or e}") from None
        return p


def command(session: Session, line: str, echo: Callable[[str], None]) -> bool:
    """Run one /command; False means leave."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/bye", "/exit", "/quit"):
        return False
    if name == "/clear":
        session.clear()
        echo("(conversation cleared)")
    elif name == "/system":
        session.system = arg or None
        echo(f"(system prompt set: {arg})" if arg else "(system prompt cleared)")
    elif name == "/stats":
        echo(session.stats_text())
    elif name == "/save":
        if not arg:
            echo("usage: /save FILE")
        else:
            try:
                echo(f"(saved to {session.save(shlex.split(arg)[0])})")
            except (MacserveError, ValueError) as e:
                echo(f"error: {e}")
    elif name == "/help":
        echo(HELP)
    else:
        echo(f"unknown command {name} (/help lists them)")
    return True


def repl(
    session: Session,
    read: Callable[[], str],
    write: Callable[[str], None],
    echo: Callable[[str], None],
) -> None:
    """read() returns the next line (raises EOFError at the end); write() streams answer
    text; echo() prints a whole line. Errors end the turn, never the session; Ctrl-C at the
    prompt says how to leave (Ollama's way), Ctrl-C during an answer stops it."""
    while True:
        try:
            line = read()
        except EOFError:
            echo("")
            return
        except KeyboardInterrupt:
            echo("\n(Ctrl-D or /bye to leave)")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not command(session, line, echo):
                return
            continue
        try:
            session.ask(line, write)
            write("\n")
        except KeyboardInterrupt:
            echo("\n(stopped; that turn is not kept)")
        except MacserveError as e:
            echo(f"\nerror: {e}")
