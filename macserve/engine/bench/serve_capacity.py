"""`bench serve`'s capacity scenario: many clients at once against the engine with its default
settings (`--max-batch` sized from the memory budget, server/capacity.py) and against the same
server with each fixed `--max-batch`: the same code with one thing changed, all in one run,
measured in turn round after round. The question it answers: does the default leave throughput
on the table (issue 25 asks for at least 0.9x the best fixed setting at 32 clients)?
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import httpx

from .serve_http import Plan, Target, load, load_summary, running


def capacity_targets(model: Path, batches: tuple[int, ...]) -> list[Target]:
    serve = (sys.executable, "-m", "macserve", "serve", str(model))
    fixed = [
        Target(f"--max-batch {b}", serve + ("--max-batch", str(b)), "macserve") for b in batches
    ]
    return [Target("default", serve, "macserve"), *fixed]


def _lines(plan: Plan, k: int, n: int) -> list[str]:
    """Round k's n messages, taken cyclically from the held-out lines: every request also
    starts with its own nonce (serve_http.load), so a repeated line shares no prefix."""
    pool = plan.lines[1:]
    return [pool[(k * n + i) % len(pool)] for i in range(n)]


def capacity(plan: Plan, log_dir: Path, progress) -> dict:
    clients = plan.capacity_clients
    with contextlib.ExitStack() as stack:
        urls = {}
        for t in capacity_targets(plan.model, plan.capacity_batches):
            progress(f"capacity: starting {t.name}")
            urls[t.name] = stack.enter_context(running(t, plan, log_dir))
        # What each server runs with, from itself: the default's is sized at load.
        max_batch = {
            n: httpx.get(u + "/health", timeout=30).json()["max_batch"] for n, u in urls.items()
        }
        raw: dict[str, list[dict]] = {n: [] for n in urls}
        for k in range(plan.rounds):
            lines = _lines(plan, k, clients * plan.requests)
            for name, url in urls.items():
                progress(f"capacity round {k + 1}/{plan.rounds}: {name}, {clients} clients")
                raw[name].append(load(url, plan, clients, list(lines)))
    servers = {n: {"max_batch": max_batch[n], **load_summary(runs)} for n, runs in raw.items()}
    fixed = {n: s for n, s in servers.items() if n != "default"}
    best = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
    return {
        "clients": clients,
        "servers": servers,
        "default_max_batch": max_batch["default"],
        "best_fixed": best,
        # > 1: the default beats every fixed setting measured
        "default_over_best": round(
            servers["default"]["tokens_per_s"] / fixed[best]["tokens_per_s"], 3
        ),
    }
