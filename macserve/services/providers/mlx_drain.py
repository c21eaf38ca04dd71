"""`python -m macserve.services.providers.mlx_drain NAME DRAIN [mlx_lm.server arguments]`:
mlx-lm's own server, run in this process, with a drain on a planned stop.

What mlx-lm 0.32.2's server (mlx_lm/server.py) does on a stop: it installs no signal handler,
so SIGTERM ends the process at once (Python's default action) and a stream in flight is cut
without a last event; SIGINT raises KeyboardInterrupt in `serve_forever`, which closes the
listener and stops the generation thread, cutting it too. It keeps no count of the requests
in flight and has no /slots. What it offers: http.server's ThreadingHTTPServer with HTTP/1.0
handlers (one request per connection, no idle keep-alive), built by `_run_http_server(...,
handler_class=)`. So this runs that server with a handler of our own, a subclass of its
`APIHandler` that changes nothing while the server runs except that it counts the POSTs
(generations) in flight and passes each one's writes through a lock; and it takes SIGTERM,
SIGINT and SIGHUP (the supervisor's stop) itself:

- a POST that arrives during the stop gets 503 in the shared error format (web/openai_api.py,
  Retry-After: 1), as the engine's drain answers; GET (/health, /v1/models) is unchanged;
- the generations in flight get up to DRAIN (graceful.wait_idle: the same log lines as
  llama-server's drain) to finish;
- one still running when DRAIN ends is ended between two of the server's own writes: a stream
  with an error event and `data: [DONE]`, a completion not yet answered with a 503; the log
  says it was cut. The client always gets a response, never a bare dropped connection;
- then the process exits 0 (os._exit: the generation thread is not a daemon and would hold
  the exit; the prompt cache is in memory only, there is nothing to save).

One more thing it fixes: when mlx-lm's server fails after its generation thread started (its
port taken), that thread, not a daemon, keeps the process alive serving nothing; here the
failure is exit 1, which the supervisor sees. The supervisor's SIGKILL comes DRAIN +
values.STOP_MARGIN after its SIGTERM. `macserve run`
still execs this (one process: the supervisor's pid is the server's).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
from http import HTTPStatus

from ...web.errors import HttpError
from ...web.openai_api import error_body, error_event
from ..graceful import wait_idle

SETTLE_SECS = 2.0  # after the drain: the 503s being written, the GETs, a slow client's headers
LOCK_SECS = 1.0  # a write stuck on a client that does not read is not waited for longer
MAX_REFUSED_BODY = 1 << 24  # read (and drop) a refused request's body up to this much


class _Cut(Exception):
    """Raised in a handler's thread at its next write once its generation was cut."""


def _response(e: HttpError) -> bytes:
    """A whole HTTP/1.0 response for `e`: what a request gets before its headers were sent."""
    body = json.dumps(error_body(e)).encode()
    head = [f"HTTP/1.0 {e.status} {HTTPStatus(e.status).phrase}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in e.headers().items()]
    head += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


SHUTTING_DOWN = HttpError(
    503, "the server is shutting down", type_="unavailable_error", retry_after=1
)


class _Writer:
    """A handler's wfile: each write of the server's holds the lock, so a cut's last event goes
    between two of them, never inside one; after the cut the handler's next write raises."""

    def __init__(self, raw):
        self.raw, self.lock, self.sent, self.cut = raw, threading.Lock(), False, False

    def write(self, data):
        with self.lock:
            if self.cut:
                raise _Cut
            self.sent = self.sent or bool(data)
            return self.raw.write(data)

    def flush(self):
        with self.lock:
            if not self.cut:
                self.raw.flush()

    def __getattr__(self, name):
        return getattr(self.raw, name)


class Drain:
    """The state of one server: the POSTs in flight, and the stop."""

    def __init__(self, name: str, drain: float):
        self.name, self.drain = name, drain
        self.lock = threading.Lock()
        self.stopping = False
        # handler -> "open" (a connection), "gen" (a generation), "refuse" (answering 503)
        self.running: dict = {}

    def log(self, msg: str) -> None:
        print(f"macserve run {self.name}: {msg}", file=sys.stderr, flush=True)

    def busy(self) -> int:
        with self.lock:
            return sum(1 for kind in self.running.values() if kind == "gen")

    def handler(self, base):
        drain = self

        class Draining(base):
            def handle(self):
                # from the connection's first byte: a request still sending its headers when
                # the stop comes is answered (a 503) before the exit, not reset
                with drain.lock:
                    drain.running[self] = "open"
                try:
                    super().handle()
                finally:
                    with drain.lock:
                        drain.running.pop(self, None)

            def do_POST(self):
                self.wfile = _Writer(self.wfile)
                with drain.lock:
                    kind = "refuse" if drain.stopping else "gen"
                    drain.running[self] = kind
                try:
                    if kind == "refuse":
                        self._refuse()
                    else:
                        super().do_POST()
                except _Cut:
                    pass  # its last event is written: nothing more to send
                finally:
                    with drain.lock:
                        drain.running[self] = "open"

            def _refuse(self):
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = 0
                if 0 < n <= MAX_REFUSED_BODY:
                    self.rfile.read(n)  # a body left unread can turn the close into a reset
                self.wfile.write(_response(SHUTTING_DOWN))
                self.close_connection = True

        return Draining

    def cut(self, h) -> None:
        w = h.wfile
        if not isinstance(w, _Writer) or not w.lock.acquire(timeout=LOCK_SECS):
            return
        try:
            w.cut = True
            e = HttpError(
                503,
                f"the server stopped before this generation ended (DRAIN={self.drain:g}s)",
                type_="unavailable_error",
                retry_after=1,
            )
            if not w.sent:
                w.raw.write(_response(e))
            elif getattr(h, "stream", False):
                w.raw.write(error_event(e))
            w.raw.flush()
        except OSError:
            pass  # the client is gone
        finally:
            w.lock.release()

    def stop(self) -> None:
        """The planned stop, in its own thread: drain, cut what is left, settle, exit."""
        left = wait_idle(self.busy, self.drain, self.name, self.log)
        if left:
            with self.lock:
                cut = [h for h, kind in self.running.items() if kind == "gen"]
            for h in cut:
                self.cut(h)
            self.log(
                f"stop: ended {len(cut)} cut generation(s) with an error (a 503 or a last event)"
            )
        end = time.monotonic() + SETTLE_SECS
        while time.monotonic() < end:
            with self.lock:
                pending = [h for h in self.running if not getattr(h.wfile, "cut", False)]
            if not pending:
                break
            time.sleep(0.05)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def on_signal(self, *_) -> None:
        # in the main thread, which only accepts connections: it never holds self.lock
        with self.lock:
            if self.stopping:
                return  # a second signal changes nothing: the supervisor's SIGKILL bounds us
            self.stopping = True
        threading.Thread(target=self.stop, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit("usage: python -m macserve.services.providers.mlx_drain NAME DRAIN [ARGS...]")
    drain = Drain(argv[0], float(argv[1]))
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in signals:  # before mlx-lm's slow import: a stop then is a clean exit 0 too
        signal.signal(sig, drain.on_signal)
    # mlx-lm, in this process only: a service's server, not a cold start
    from mlx_lm import server

    own = server._run_http_server
    if "handler_class" not in inspect.signature(own).parameters:
        drain.log("this mlx-lm's server takes no handler class: a stop cuts its generations")
        for sig in signals:
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
    else:
        handler = drain.handler(server.APIHandler)

        def run_http_server(host, port, response_generator, *args, **kwargs):
            kwargs["handler_class"] = handler
            return own(host, port, response_generator, *args, **kwargs)

        server._run_http_server = run_http_server
    sys.argv = ["mlx_lm.server", *argv[2:]]
    try:
        server.main()
    except Exception:
        # e.g. its port taken: mlx-lm's generation thread (not a daemon) would keep the process
        # alive, serving nothing, where the supervisor must see a failed start
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
