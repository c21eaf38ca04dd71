"""What the web page shows and does, on the router's own pool: the overview rows and the
memory bar, the actions (start, stop, restart through the pool, so the budget admits every
start; CTX and KV through `set`'s own code, so its checks, health wait and rollback apply),
and new log lines. Nothing here reads or returns a profile's secrets; log lines have them
masked in case a server printed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ..errors import MacserveError
from ..services import providers
from ..services.edit import set_values
from ..services.health import SetFailed, failing_before
from ..services.profiles import ProfileStore
from ..services.share import share_of
from ..services.supervisors import log_path, logs
from . import admission
from .admission import IN_MEMORY
from .errors import RouteError
from .model import Model, size
from .pool import Pool
from .state import State

TAIL = 40  # log lines a profile's panel starts with
EDITABLE = ("CTX", "KV")  # what the page changes; everything else is `macserve set`'s


async def overview(pool: Pool) -> dict:
    """One row per profile (invalid ones too), and the budget split by loaded model."""
    pool.refresh()
    sts = await pool.statuses()
    now = time.monotonic()
    rows: list[dict] = []
    used: list[dict] = []
    for name in sorted(set(pool.models) | set(pool.broken)):
        m = pool.models.get(name)
        if m is None:
            rows.append({"name": name, "state": "invalid", "why": pool.broken[name][0]})
            continue
        st = sts[name]
        fp = await pool.footprint(m)
        state, why = pool.state_of(m), m.error
        broken = await asyncio.to_thread(failing_before, st, m.profile)
        if broken and state != "starting":
            state = "crash-loop"
            why = await asyncio.to_thread(_last_error, m, broken)
        ttl = m.ttl(pool.settings.ttl)
        idle = m.idle(now) if st.state in IN_MEMORY else None
        p = m.profile
        rows.append(
            {
                "name": name,
                "provider": p.provider,
                "model": p.model,
                "state": state,
                "why": why,
                "port": p.port,
                "ctx": p.ctx or fp.ctx,
                "ctx_set": p.ctx is not None,
                # The provider's own name for its default cache (what `KV=` takes), not
                # inspect's key for it ("mlx/bf16").
                "kv": p.kv or _own_name(m.provider, fp.cache_key),
                "kv_set": p.kv is not None,
                "kv_choices": list(m.provider.cache_types),
                "weights": fp.weights_bytes,
                "cache": fp.kv_total_bytes,
                "footprint": fp.share_bytes,
                "footprint_note": fp.note or fp.error,
                "idle_s": idle,
                "ttl_s": ttl,
                "ttl_left_s": None if ttl is None or idle is None else max(0.0, ttl - idle),
                "in_flight": m.inflight,
                "keyed": bool(m.api_key),  # whether, never what
            }
        )
        if st.state in IN_MEMORY or m.admitted:
            used.append({"name": name, "bytes": fp.share_bytes or 0})
    b = pool.budget.budget_bytes
    return {
        "rows": rows,
        "budget": {
            "bytes": b,
            "source": pool.budget.source,
            "used": used,
            "free": max(0, b - sum(u["bytes"] for u in used)),
        },
    }


def _last_error(m: Model, broken: str) -> str:
    tail = logs.tail(log_path(m.name), 30)
    line = m.provider.error_line(tail)
    return f"{line} ({broken})" if line else broken


# ---- actions ------------------------------------------------------------------------------------


async def act(pool: Pool, name: str, action: str, values: dict | None = None) -> dict:
    """Do one action; {"ok", "line"}: the outcome line `macserve` would print."""
    pool.refresh()
    m = pool.resolve(name)
    if action == "stop":
        await pool.stop(m, "stopped from the web page")
        return {"ok": True, "line": f"{name}: stopped"}
    if action in ("start", "restart"):
        if action == "restart":
            await pool.stop(m, "restarted from the web page")
        lease = pool.lease(m)  # counted as used from now: its TTL runs from here
        try:
            await pool.ready(m)
        finally:
            lease.release()
        return {"ok": True, "line": f"{name}: running (pid {m.ready_pid})"}
    if action == "set":
        return await _set(pool, m, values or {})
    raise RouteError(400, f"unknown action {action!r}: start, stop, restart or set")


async def _set(pool: Pool, m: Model, values: dict) -> dict:
    changes = {k: str(v).strip() for k, v in values.items()}
    bad = sorted(set(changes) - set(EDITABLE))
    if bad or not changes:
        raise RouteError(400, f"the page changes {' and '.join(EDITABLE)} only (got {bad})")
    if m.start_task is not None or m.stop_task is not None:
        raise RouteError(409, f"{m.name} is starting or stopping: try again when it is done")
    try:
        new = m.profile.updated(changes)  # the file format's checks, before anything else
        providers.for_profile(new).validate(new)
    except MacserveError as e:
        return {"ok": False, "line": f"refused: {e}"}
    st = await pool.status(m)
    if st.state in IN_MEMORY:
        # The budget first: a bigger context must fit beside what else is loaded.
        async with pool.admission_lock:
            fp = await asyncio.to_thread(share_of, new)
            others = await admission.holders(pool, m)
            used = sum(b for _, b in others)
            need, budget = fp.share_bytes or 0, pool.budget.budget_bytes
            if used + need > budget:
                return {
                    "ok": False,
                    "line": f"refused: {m.name} would need {size(need)} at CTX "
                    f"{fp.ctx or 0:,} ({fp.cache_key}); {size(used)} of the {size(budget)} "
                    f"budget is held by {', '.join(o.name for o, _ in others)}: stop one first",
                }
            m.footprint = fp
    # `set` restarts the service itself: meanwhile the pool's requests for it wait on this
    # task (as on a start), and neither the reaper nor an eviction touches it.
    task = asyncio.ensure_future(asyncio.to_thread(_run_set, m.name, changes))
    if m.state is not State.STARTING:
        m.transition(State.STARTING, f"set {' '.join(f'{k}={v}' for k, v in changes.items())}")
    m.start_task = task
    lease = pool.lease(m)
    try:
        out = await asyncio.shield(task)
    finally:
        if m.start_task is task:
            m.start_task = None
        lease.release()
        m.ready_pid = None  # a new process (or the old settings' again): waited for anew
        m.footprint = None
        with contextlib.suppress(MacserveError):
            await pool.status(m)  # the state machine follows what the supervisor runs now
    return out


def _run_set(name: str, changes: dict) -> dict:
    try:
        out = set_values(name, changes)
    except SetFailed as e:
        head = "rolled back" if e.restored else "failed"
        return {"ok": False, "line": f"{head}: {e}", "log": e.log_tail[-10:]}
    except MacserveError as e:
        return {"ok": False, "line": f"refused: {e}"}
    lines = [f"{name}: {n}" for n in out.notes]
    if out.pid:
        lines.append(f"{name}: restarted, healthy (pid {out.pid})")
    return {"ok": True, "line": "; ".join(lines) or f"{name}: saved"}


# ---- logs ---------------------------------------------------------------------------------------


class LogTails:
    """New lines of each profile's log since the last call (the first call: the last TAIL)."""

    def __init__(self):
        self.offsets: dict[str, int] = {}

    def read(self, names: list[str]) -> dict[str, list[str]]:
        st = ProfileStore()
        out = {}
        for n in names:
            path = log_path(n)
            end = logs.size(path)
            start = self.offsets.get(n)
            if start is not None and start > end:  # rotated
                start = 0
            lines = logs.tail(path, TAIL if start is None else 10_000, since=start or 0, until=end)
            self.offsets[n] = end
            if lines:
                out[n] = _masked(lines, st, n)
        return out


def _masked(lines: list[str], st: ProfileStore, name: str) -> list[str]:
    secrets = []
    with contextlib.suppress(MacserveError, OSError):
        secrets = [v for v in st.load_secrets(name).values() if len(v) >= 4]
    for s in secrets:
        lines = [ln.replace(s, "***") for ln in lines]
    return lines


def _own_name(provider, cache_key: str | None) -> str | None:
    """The provider's name (KV=...) of the cache inspect counts as `cache_key`."""
    names = [k for k, v in provider.cache_types.items() if v == cache_key]
    return f"default ({names[0]})" if names else cache_key
