"""`python -m macserve.services.providers.mlx_drain NAME DRAIN [-m ENTRY ...] [mlx_lm.server
arguments]`: mlx-lm's own server, run in this process, with a drain on a planned stop. (With
`-m ENTRY`, a module that runs mlx-lm's server itself: the SPLIT shim, engine/pipeline.py.)

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

Several hosts (mlx.launch, MLX_RANK): every rank runs this. Rank 0 answers HTTP and drains as
above. A rank > 0 (`Follower`) takes part in every step of rank 0's generations, so the stop
signal, which reaches it at the same moment (the supervisor signals the process group), must
not end it while it generates: it keeps going until rank 0 exits, which it sees as its next
collective failing, then exits 0; DRAIN + FOLLOW_SECS at most. mlx_launch.py turns the
group's end after a stop into exit 0.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from http import HTTPStatus
from typing import Any

from ...web.errors import HttpError
from ...web.openai_api import error_body, error_event
from ..graceful import wait_idle
from . import mlx_limits

SETTLE_SECS = 2.0  # after the drain: the 503s being written, the GETs, a slow client's headers
FOLLOW_SECS = 10.0  # a rank > 0 outlives rank 0's drain by this much at most (< STOP_MARGIN)
LOCK_SECS = 1.0  # a write stuck on a client that does not read is not waited for longer
MAX_REFUSED_BODY = 1 << 24  # read (and drop) a refused request's body up to this much


def _say(line: str) -> None:
    # a rank started over ssh loses its terminal when the supervisor's SIGTERM ends its ssh
    # client (mlx.launch): its output is gone then, its drain must go on
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            f.flush()


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
        _say(f"macserve run {self.name}: {msg}")

    def busy(self) -> int:
        with self.lock:
            return sum(1 for kind in self.running.values() if kind == "gen")

    def handler(self, base: Any) -> Any:
        """mlx-lm's APIHandler (`base`, untyped: mlx-lm has no stubs) draining on a stop."""
        drain = self

        class Draining(base):
            wfile: Any  # socketserver's writer of the connection, wrapped in do_POST

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
        _flush()
        os._exit(0)

    def on_signal(self, *_) -> None:
        # in the main thread, which only accepts connections: it never holds self.lock
        with self.lock:
            if self.stopping:
                return  # a second signal changes nothing: the supervisor's SIGKILL bounds us
            self.stopping = True
        threading.Thread(target=self.stop, daemon=True).start()


class Follower:
    """A rank > 0 under mlx.launch (several hosts). It answers no HTTP, but takes part in every
    step of rank 0's generations, so it must outlive rank 0's drain: once its generation loop
    runs, the stop signal only arms a deadline (DRAIN + FOLLOW_SECS, past rank 0's drain and
    settle). It ends with rank 0: its next collective fails (`[ring] connection to a peer was
    lost`) and it exits 0. Still loading or connecting, it exits at the signal: nothing can be
    in flight without it."""

    def __init__(self, name: str, drain: float, rank: int):
        self.name, self.drain, self.rank = name, drain, rank
        self.generating = self.stopping = False

    def log(self, msg: str) -> None:
        _say(f"macserve run {self.name}: rank {self.rank}: {msg}")

    def on_signal(self, *_) -> None:
        if not self.generating:
            os._exit(0)
        if self.stopping:
            return
        self.stopping = True
        limit = self.drain + FOLLOW_SECS
        self.log(f"stop: following rank 0's drain; ending with it (at most {limit:g}s)")

        def deadline():
            time.sleep(limit)
            self.log(f"stop: rank 0 still running after {limit:g}s: exiting")
            os._exit(0)

        threading.Thread(target=deadline, daemon=True).start()

    def follow(self, server) -> None:
        """mlx-lm's generation loop, marked as running, and ended quietly once rank 0 is gone
        after a stop (before a stop, its own log of the death, as before)."""
        own = server.ResponseGenerator._generate
        follower = self

        def generate(gen):
            follower.generating = True
            try:
                own(gen)
            except Exception as e:
                if not follower.stopping:
                    raise
                follower.log(f"stop: rank 0 ended ({e}); exiting")
                os._exit(0)

        server.ResponseGenerator._generate = generate


def _rank() -> int:
    """This process's rank: mlx.launch exports MLX_RANK to each; one host has none (0)."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit(
            "usage: python -m macserve.services.providers.mlx_drain NAME DRAIN "
            "[-m ENTRY ...] [ARGS...]"
        )
    rank = _rank()
    drain = Drain(argv[0], float(argv[1])) if rank == 0 else Follower(argv[0], float(argv[1]), rank)
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in signals:  # before mlx-lm's slow import: a stop then is a clean exit 0 too
        signal.signal(sig, drain.on_signal)
    # mlx-lm, in this process only: a service's server, not a cold start
    from mlx_lm import server

    # the memory share: MLX's limits, and a prompt past CTX refused (mlx_limits.py)
    bounded = mlx_limits.apply(server, drain.log)
    own = server._run_http_server
    if isinstance(drain, Follower):
        drain.follow(server)
    elif "handler_class" not in inspect.signature(own).parameters:
        drain.log("this mlx-lm's server takes no handler class: a stop cuts its generations")
        for sig in signals:
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
    else:
        base = server.APIHandler
        handler = drain.handler(bounded(base) if bounded else base)

        def run_http_server(host, port, response_generator, *args, **kwargs):
            kwargs["handler_class"] = handler
            return own(host, port, response_generator, *args, **kwargs)

        server._run_http_server = run_http_server
    rest = argv[2:]
    try:
        if rest[:1] == ["-m"] and len(rest) > 1:
            # an entry that runs mlx-lm's server itself (the SPLIT shim, engine/pipeline.py):
            # named, not imported (services do not import the engine); it finds the server
            # patched above
            sys.argv = [rest[1], *rest[2:]]
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["mlx_lm.server", *rest]
            server.main()
    except Exception:
        # e.g. its port taken: mlx-lm's generation thread (not a daemon) would keep the process
        # alive, serving nothing, where the supervisor must see a failed start
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
