"""The real llama-server on a GGUF, stopped as soon as it has made its caches (or failed):
its exit code and its log, for skeleton_tensors.py (which tensors it misses) and
llama_truth.py (the caches it made).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path


def run_llama_server(
    server: str, model: Path, ctx: int, extra=(), timeout: float = 120.0, verbosity=4
):
    """llama-server on `model`: (exit code or None if it came up, its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [server, "-m", str(model), "--fit", "off", "--no-warmup", "-lv", str(verbosity)]
    argv += ["-c", str(ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    # Its own session: a crash on a skeleton can make llama.cpp fork a debugger to print a
    # backtrace, and those children must go with it (killpg below).
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    lines: list[str] = []
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break  # it exited
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                line = raw.decode("utf-8", "replace")
                lines.append(line)
                # The caches are made before the scheduler reserves its graphs: what follows
                # (a graph over zero weights, a test decode) is of no interest here.
                if "sched_reserve" in line or "server is listening" in line:
                    return None, "\n".join(lines)
        lines.append(buf.decode("utf-8", "replace"))
        try:
            return p.wait(timeout=30), "\n".join(lines)
        except subprocess.TimeoutExpired:  # alive but silent past the deadline
            return -1, "\n".join(lines + ["(llama-server timed out)"])
    finally:
        stop_group(p)
        p.stdout.close()


def stop_group(p: subprocess.Popen) -> None:
    """Stop a server started in a process group of its own (start_new_session): SIGTERM to the
    group we started, nothing else; SIGKILL if it has not gone in 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
