"""A real `macserve serve` subprocess for tests: free port, log to a file, /health polled with
a deadline, terminated in teardown."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from .conftest import REPO, TINY_MODEL
from .fixtures import free_port  # noqa: F401  (its home before fixtures.py)


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
def serve(log_dir: Path, *extra: str, timeout: float = 120.0, preexec_fn=None, model=TINY_MODEL):
    """`preexec_fn`: run in the child before exec (e.g. a resource limit); `model`: the
    folder served (the demo model unless a test built another)."""
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
                str(model),
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
