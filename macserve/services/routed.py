"""What a running router publishes for `macserve ls`: `$MACSERVE_HOME/run/routers/PORT.json`.

A services-level file format, so the router (the router/ wing, which writes it) and `ls`
(views.py, which reads it) share it without the services wing importing the router.

Written (atomically) by the router when what it manages changes; read by `ls`, which trusts a
file only while the process that wrote it is alive (its pid and that process's start time
match), so a killed router leaves no false claim behind.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import psutil

from .. import env
from ..fileio import atomic_write


def folder() -> Path:
    return env.home() / "run" / "routers"


def path(port: int) -> Path:
    return folder() / f"{port}.json"


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def write(port: int, state: dict) -> None:
    """`state`: {"url", "ttl_s", "budget_bytes", "models": {name: {...}}}; pid added here."""
    pid = psutil.Process().pid
    atomic_write(path(port), json.dumps({**state, "pid": pid, "started": _started(pid)}))


def remove(port: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path(port).unlink()


def live() -> list[dict]:
    """The states of the routers running now (each file whose writer is still that process)."""
    out: list[dict] = []
    d = folder()
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            s = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        pid = s.get("pid")
        if isinstance(pid, int) and s.get("started") and _started(pid) == s["started"]:
            out.append(s)
    return out
