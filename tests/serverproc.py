"""A real `macserve serve` subprocess for tests: free port, log to a file, /health polled with
a deadline, terminated in teardown."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from .conftest import REPO, TINY_MODEL


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS hands out 49152 and up


_next_port = [0]


def free_port() -> int:
    """A port no server holds now, for a server the test starts next.

    Taken below the kernel's ephemeral range: a port asked of the kernel (bind to 0) comes
    from that range, where any outgoing connection (a client, a health poll, supervisord's
    own) may take it before the server binds it; below it, only an explicit bind can, and
    the tests bind their servers one at a time. Ports are handed out in turn from a start
    spread by the pid, so consecutive tests (and a leftover server) never share one."""
    top = _ephemeral_start()
    lo = max(1024, top - 12000)
    if not _next_port[0]:
        _next_port[0] = lo + (os.getpid() * 7) % (top - lo)
    for _ in range(top - lo):
        port = _next_port[0]
        _next_port[0] = lo if port + 1 >= top else port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {lo}-{top}")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    health_codes: list[int] = field(default_factory=list)  # what /health said while starting

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@contextlib.contextmanager
def serve(log_dir: Path, *extra: str, timeout: float = 120.0, preexec_fn=None):
    """`preexec_fn`: run in the child before exec (e.g. a resource limit)."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    if "--prompt-cache-dir" not in extra:
        # Each server's disk tier in its own fresh folder: never the real home's, and never
        # hits left by an earlier test or run.
        extra = (*extra, "--prompt-cache-dir", str(log_dir / f"prompt-cache-{port}"))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "macserve",
                "serve",
                str(TINY_MODEL),
                "--port",
                str(port),
                *extra,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=preexec_fn,
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"macserve serve exited with {proc.returncode}:\n{srv.log_tail()}")
            try:
                code = httpx.get(srv.url + "/health", timeout=2).status_code
                srv.health_codes.append(code)
                if code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health 200 within {timeout:.0f}s:\n{srv.log_tail()}")
            time.sleep(0.05)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
