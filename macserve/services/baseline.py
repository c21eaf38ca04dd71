"""A server process's baseline: what its process tree holds at idle after loading, less the
weights it holds (the runtime, its buffers, the HTTP server). Part of every share (share.py).

Measured once per provider + model on this machine, after a start is ready (lifecycle.py), and
stored in `$MACSERVE_HOME/state/baselines.json` (atomic writes), keyed by provider and model;
shown with its date. Until it is measured, the provider's assumed figure is counted
(`Provider.assumed_baseline`), said as "assumed (not measured yet)".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
from pathlib import Path

import psutil

from .. import env
from ..fileio import atomic_write
from .profiles import local_model_path

ASSUMED = "assumed (not measured yet)"


def path() -> Path:
    return env.home() / "state" / "baselines.json"


def key(provider: str, model: str) -> str:
    """provider + the model's path (a local one resolved, so two spellings are one key)."""
    try:
        local = local_model_path(model)
    except Exception:  # noqa: BLE001 - a model that is no path is keyed by its text
        local = None
    return f"{provider} {local if local is not None else model}"


def _read() -> dict:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}  # none measured yet, or a torn hand edit: measured again at the next start
    return data if isinstance(data, dict) else {}


def lookup(provider: str, model: str, assumed: int) -> tuple[int, str]:
    """(bytes, source): the stored measurement, or `assumed` until there is one."""
    entry = _read().get(key(provider, model))
    if isinstance(entry, dict) and isinstance(entry.get("bytes"), int):
        return entry["bytes"], f"measured {entry.get('date', '?')}"
    return assumed, ASSUMED


def measured(provider: str, model: str) -> bool:
    return isinstance(_read().get(key(provider, model)), dict)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for pr in procs:
        with contextlib.suppress(psutil.Error):
            total += pr.memory_info().rss
    return total


def record(provider: str, model: str, rss_bytes: int, held_bytes: int) -> int:
    """Store resident - what the share counts apart (the weights; the cache too for a server
    that allocates it at start), at least 0, for provider + model; returns the baseline."""
    value = max(0, rss_bytes - held_bytes)
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(".baselines.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two services ready at once: neither entry lost
        data = _read()
        data[key(provider, model)] = {
            "bytes": value,
            "rss_bytes": rss_bytes,
            "held_bytes": held_bytes,  # weights (+ the cache a server allocates at start)
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        }
        atomic_write(p, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return value
