"""The rows behind `ls`, `status` and `show`: each profile's values, its supervisor's record,
the process's uptime and memory, and (for `ls`) the running routers that serve it, from what
they publish (`routed.py`).
"""

from __future__ import annotations

import time

import psutil

from ..errors import MacserveError
from . import journal, providers, routed, run, share
from .health import base_url, store
from .profiles import ProfileStore
from .supervisors import Status, get_backend, log_path, logs


def _proc_info(pid: int | None) -> dict:
    if not pid:
        return {"uptime_s": None, "rss_bytes": None}
    try:
        p = psutil.Process(pid)
        rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        return {"uptime_s": max(0.0, time.time() - p.create_time()), "rss_bytes": rss}
    except psutil.Error:
        return {"uptime_s": None, "rss_bytes": None}


def row(name: str, health: bool = False, backend=None) -> dict:
    backend = backend or get_backend()
    r: dict = {
        "name": name,
        "provider": None,
        "model": None,
        "port": None,
        "url": None,
        "error": None,
    }
    try:
        p = store().load(name)
        r.update(provider=p.provider, model=p.model, port=p.port, host=p.host, url=base_url(p))
    except MacserveError as e:
        p = None
        r["error"] = str(e)
    r["journal"] = _settle(name, backend)
    s: Status = backend.status(name)
    state, detail = s.state, s.detail
    # A supervisor calls a respawn "starting", then "running", while `macserve run` backs off
    # between two crashes (the run's own record, run/NAME.json); launchd's print says
    # crash-loop itself (launchd_ctl.py). Either way the server's last error line says why.
    looping = state == "crash-loop" or (
        p is not None
        and state in ("running", "starting")
        and run.backing_off(name) >= 2 * run.BACKOFF_FIRST
        and not providers.for_profile(p).ready(p, timeout=2.0)
    )
    if looping:
        tail = logs.tail(log_path(name), 40)
        line = (providers.for_profile(p).error_line(tail) if p else None) or (
            tail[-1] if tail else ""
        )
        why = line.strip() or "it keeps exiting"
        state, detail = "crash-loop", why + (f" ({s.detail})" if s.state == "crash-loop" else "")
    r.update(state=state, pid=s.pid, exit_code=s.exit_code, signal=s.signal, detail=detail)
    r.update(_proc_info(s.pid if s.state in ("running", "starting", "orphaned") else None))
    if health:
        r["healthy"] = bool(
            p and s.state == "running" and providers.for_profile(p).ready(p, timeout=2.0)
        )
    return r


def _settle(name: str, backend) -> str | None:
    """What ls/status say of a change journal: settled now (a killed `set`), in progress, or
    not settled with the command that settles it."""
    try:
        done = journal.recover(name, backend)
        if done:
            return done
        entry = journal.read(ProfileStore(), name)
    except MacserveError as e:
        return f"{journal.pending_note(name)} ({e})"
    if entry is None:
        return None
    if journal.owner_alive(entry):
        return f"{name}: a change is in progress (macserve set, pid {entry.owner})"
    return journal.pending_note(name)


def rows(health: bool = False) -> list[dict]:
    """Every profile's row; `routed` lists the running routers that serve it (the router's
    own state file: its URL, the profile's TTL there, None for always on, its state)."""
    backend = get_backend()
    routers = routed.live()
    out = []
    for n in store().names():
        r = row(n, health, backend)
        r["routed"] = [
            {"router": x.get("url"), **x["models"][n]}
            for x in routers
            if n in (x.get("models") or {})
        ]
        out.append(r)
    return out


def show(name: str) -> dict:
    st = store()
    p = st.load(name)
    prov = providers.for_profile(p)
    try:
        argv = prov.argv(providers.typed(p), share.share_of(p).limits())
    except MacserveError as e:
        argv = [f"<{e}>"]
    secrets = st.load_secrets(name)
    r = row(name)
    r.update(
        file=str(st.path(name)),
        text=st.text(name),
        values=dict(p.values),
        argv=argv,
        # names only: the values stay in the 0600 file
        secrets={k: sorted(prov.secret_env({k: secrets[k]})) for k in sorted(secrets)},
        secrets_file=str(st.secrets_path(name)) if secrets else None,
        health_url=prov.health_url(p),
        log=str(log_path(name)),
        backend=get_backend().name,
    )
    return r


def outcome_line(name: str, what: str, url: str, pid: int | None, healthy: bool = True) -> str:
    """The one shape new, set, start, restart and stop print: `NAME: WHAT, healthy at URL/v1
    (pid N)`; `stopped, was at ...` for a stop, `..., not waited for` without a health wait."""
    where = f"at {url}/v1" + (f" (pid {pid})" if pid else "")
    if what == "stopped":
        return f"{name}: stopped, was {where}"
    return (
        f"{name}: {what}, healthy {where}"
        if healthy
        else f"{name}: {what} {where}, health not waited for"
    )
