"""What the service commands do: new, set (with health check and rollback), start/stop/restart,
rm, and the rows behind ls/status/show. The CLI only parses and prints.

Flow: profiles -> providers (argv, flag check) -> supervisors (the backend) -> health wait.
Nothing on disk changes until the new values have passed validation and the provider's check.
"""

from __future__ import annotations

import re
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..errors import MacserveError
from . import plan as sizing_plan
from . import providers
from .profiles import KEYS, Profile, ProfileStore, check_name
from .providers.llama_rpc import DEFAULT_PORT as RPC_DEFAULT_PORT
from .supervisors import Status, get_backend, log_path, logs, spec_for

DEFAULT_PORT = 8080
# Seconds between health polls, growing to POLL_MAX: quick for small models, and a model that
# loads for minutes does not get its log filled with probe requests. The wait is bounded by a
# deadline, never by a fixed sleep.
POLL, POLL_MAX = 0.25, 2.0
CRASH_RUNS = 2  # launchd: this many failed respawns after a restart = the settings do not start


class SetFailed(MacserveError):
    """New settings did not become healthy; the previous profile was restored."""

    def __init__(self, msg: str, log_tail: list[str], restored: bool):
        super().__init__(msg)
        self.log_tail = log_tail
        self.restored = restored


@dataclass
class Outcome:
    name: str
    url: str | None = None
    notes: list[str] = field(default_factory=list)
    pid: int | None = None


def store() -> ProfileStore:
    return ProfileStore()


def _spec(profile: Profile):
    return spec_for(profile, providers.for_profile(profile).env(profile))


def base_url(profile: Profile) -> str:
    return providers.base_url(profile)


# ---- waiting for health -------------------------------------------------------------------------


def wait_ready(
    profile: Profile,
    timeout: float,
    old_pid: int | None = None,
    tick=lambda elapsed, status: None,
    backend=None,
) -> tuple[bool, str]:
    """Poll until the service runs a new process that passes the provider's readiness probe.

    Gives up early when the supervisor has given up (supervisord FATAL) or launchd keeps
    respawning a process that exits non-zero: waiting out the deadline would not help.
    """
    backend = backend or get_backend()
    provider = providers.for_profile(profile)
    start = time.monotonic()
    runs0 = None
    interval = POLL
    while True:
        st = backend.status(profile.name)
        if runs0 is None:
            runs0 = st.runs
        elapsed = time.monotonic() - start
        tick(elapsed, st)
        if st.failed:
            return False, f"the supervisor gave up starting it ({st.detail or st.state})"
        if (
            st.runs is not None
            and runs0 is not None
            and st.runs - runs0 >= CRASH_RUNS
            and st.state != "running"
            and st.exit_code
        ):
            return False, f"it keeps exiting (last exit code {st.exit_code})"
        if st.state == "not installed":
            return False, "the service is not installed"
        if st.state == "running" and st.pid and st.pid != old_pid:
            if provider.ready(profile, timeout=min(5.0, max(1.0, timeout - elapsed))):
                return True, ""
            why = provider.failed(profile)
            if why:
                return False, why
        if elapsed > timeout:
            return False, f"not healthy within {timeout:.0f}s (state: {st.state})"
        time.sleep(interval)
        interval = min(POLL_MAX, interval * 1.5)


# ---- new ------------------------------------------------------------------------------------------


def default_name(source: str, quant: str | None) -> str:
    base = Path(source.rstrip("/")).name if "/" in source or source.endswith(".gguf") else source
    base = re.sub(r"\.gguf$", "", base, flags=re.I)
    if ":" in base:
        base, quant = base.split(":", 1)[0], quant or base.split(":", 1)[1]
    name = re.sub(r"[^a-z0-9._-]+", "-", (base + (f"-{quant}" if quant else "")).lower()).strip(
        "-."
    )
    return check_name(name[:64] or "model")


def port_free(host: str, port: int) -> bool:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pick_port(host: str, used: set[int], start: int = DEFAULT_PORT) -> int:
    for port in range(start, start + 1000):
        if port not in used and port_free(host, port):
            return port
    raise MacserveError(f"no free port in {start}..{start + 999}; pass --port")


def new(
    source: str,
    quant=None,
    name=None,
    provider=None,
    ctx="auto",
    port=None,
    host="127.0.0.1",
    extra_args: str = "",
    start=True,
    timeout=300.0,
    tick=None,
) -> Outcome:
    name = check_name(name) if name else default_name(source, quant)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    plan = sizing_plan.plan(source, quant, provider, ctx)
    prov = providers.get(plan.provider)
    notes = list(plan.notes)
    args: list[str] = []
    ctx_args = prov.context_args(plan.n_ctx) if plan.n_ctx else None
    if ctx_args:
        args += ctx_args
        why = (
            "from --ctx"
            if ctx not in (None, "auto")
            else (
                "the model's own limit, which fits the budget"
                if plan.n_ctx == plan.model_max
                else f"the most that fits the {plan.budget_bytes / 2**30:.1f} GB budget"
            )
        )
        notes.append(f"context {plan.n_ctx:,} tokens ({why}; {plan.cache_key} cache)")
    elif plan.n_ctx:
        notes.append(
            f"{plan.provider} has no context-size flag: its cache grows per request; "
            f"{plan.fits:,} tokens fit the budget with {plan.cache_key}"
            if plan.fits
            else f"{plan.provider} has no context-size flag"
        )
    if plan.mtp_layers:
        draft = prov.draft_args(plan.mtp_layers)
        args += draft
        notes.append(
            f"MTP drafting on ({shlex.join(draft)})"
            if draft
            else f"model has {plan.mtp_layers} MTP layer(s); {plan.provider} here cannot draft with them"
        )
    try:
        args += shlex.split(extra_args or "")
    except ValueError as e:
        raise MacserveError(f"--extra-args does not parse: {e}") from None
    values = {
        "PROVIDER": plan.provider,
        "MODEL": plan.model,
        "HOST": host,
        "PORT": None,
        "EXTRA_ARGS": shlex.join(args),
    }
    comment = f"# macserve new {shlex.quote(source)}" + (f" --quant {quant}" if quant else "")
    return _create(st, name, values, comment, port, start, timeout, tick, notes)


def new_worker(
    name: str,
    host: str,
    port: int | None = None,
    extra_args: str = "",
    start=True,
    timeout: float = 60.0,
    tick=None,
) -> Outcome:
    """A supervised llama.cpp RPC worker (rpc-server) for another Mac's llama-server."""
    name = check_name(name)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    try:
        args = shlex.split(extra_args or "")
    except ValueError as e:
        raise MacserveError(f"--extra-args does not parse: {e}") from None
    values = {
        "PROVIDER": "llama.cpp-rpc",
        "HOST": host,
        "PORT": None,
        "EXTRA_ARGS": shlex.join(args),
    }
    out = _create(
        st,
        name,
        values,
        f"# macserve worker {name} --host {host}",
        port or RPC_DEFAULT_PORT,
        start,
        timeout,
        tick,
        [],
    )
    out.url = f"{host}:{store().load(name).port}"
    return out


def _create(
    st: ProfileStore,
    name: str,
    values: dict,
    comment: str,
    port: int | None,
    start: bool,
    timeout: float,
    tick,
    notes: list[str],
) -> Outcome:
    """Write a new profile (port picked or checked, flags checked), then install and start it."""
    host = values["HOST"]
    with st.lock():
        if st.exists(name):
            raise MacserveError(f"profile {name} exists")
        used = {_port_of(n) for n in st.names()}
        if port is None:
            port = pick_port(host, used)
        elif port in used:
            raise MacserveError(f"port {port} is already used by another profile")
        elif start and not port_free(host, port):
            raise MacserveError(f"port {port} on {host} is in use by another program")
        profile = Profile(name, {**values, "PORT": str(port)}, (comment,))
        providers.for_profile(profile).check_args(
            profile
        )  # a profile that cannot start is never written
        st.save(profile)
    out = Outcome(name, base_url(profile), notes)
    if not start:
        return out
    backend = get_backend()
    offset = logs.size(log_path(name))
    backend.apply(_spec(profile))
    ok, why = wait_ready(profile, timeout, tick=tick or (lambda e, s: None), backend=backend)
    if not ok:
        tail = logs.tail(log_path(name), 20, since=offset)
        backend.stop(name)  # do not leave a crash loop behind
        raise SetFailed(
            f"{name} did not become healthy: {why}; service stopped, profile kept "
            f"(fix with macserve set {name} ..., then macserve start {name})",
            tail,
            False,
        )
    out.pid = backend.status(name).pid
    return out


def _port_of(name: str) -> int | None:
    try:
        return store().load(name).port
    except MacserveError:
        return None


# ---- set ------------------------------------------------------------------------------------------


def parse_assignments(items: tuple[str, ...]) -> dict[str, str]:
    """`KEY=VALUE ...` or `KEY VALUE`."""
    if not items:
        raise MacserveError("nothing to set: give KEY=VALUE ... or KEY VALUE")
    if all("=" in i for i in items):
        pairs = [i.split("=", 1) for i in items]
    elif len(items) == 2 and "=" not in items[0]:
        pairs = [list(items)]
    else:
        raise MacserveError("expected KEY=VALUE ... or KEY VALUE")
    out = {}
    for k, v in pairs:
        k = k.strip()
        if not k:
            raise MacserveError("empty key")
        out[k.upper() if k.upper() in KEYS else k] = v  # `set NAME port 8081` is fine
    return out


def _prepare(
    st: ProfileStore, name: str, changes: dict[str, str], checked: Profile | None = None
) -> tuple[Profile, Profile]:
    """(old, new) profiles; the new one checked by its provider unless it equals `checked`
    (a check is slow for multi-host profiles: it inspects the model and ssh-checks hosts)."""
    old = st.load(name)
    new = old.updated(changes)
    if new.values != old.values and new != checked:
        providers.for_profile(new).check_args(new)  # refuse before anything is written or restarted
    return old, new


def set_values(
    name: str, changes: dict[str, str], restart: bool = True, timeout: float = 300.0, tick=None
) -> Outcome:
    st = store()
    _, checked = _prepare(st, name, changes)  # bad input fails here, before the lock file exists
    with st.lock(name):
        # Again under the lock: the file may have moved on (then the result is checked again).
        old, new = _prepare(st, name, changes, checked)
        out = Outcome(name, base_url(new))
        if new.values == old.values:
            out.notes.append("no change")
            return out
        st.save(new)
        backend = get_backend()
        before = backend.status(name)
        if not restart:
            out.notes.append("saved; not restarted (--no-restart)")
            return out
        if before.state in ("not installed", "stopped"):
            out.notes.append(f"saved; {name} is {before.state}, so nothing was restarted")
            return out
        offset = logs.size(log_path(name))
        tick = tick or (lambda e, s: None)
        try:
            backend.apply(_spec(new))
            ok, why = wait_ready(new, timeout, old_pid=before.pid, tick=tick, backend=backend)
        except MacserveError as e:
            ok, why = False, str(e)
        if ok:
            out.pid = backend.status(name).pid
            return out
        # Roll back: the previous profile, restarted, checked healthy again.
        tail = logs.tail(log_path(name), 30, since=offset)
        st.save(old)
        failed = backend.status(name).pid
        try:
            backend.apply(_spec(old))
            restored, why2 = wait_ready(old, timeout, old_pid=failed, tick=tick, backend=backend)
        except MacserveError as e:
            restored, why2 = False, str(e)
        state = (
            "previous settings restored and healthy"
            if restored
            else f"previous settings restored but not healthy: {why2}"
        )
        raise SetFailed(f"new settings for {name} failed: {why}; {state}", tail, restored)


# ---- start / stop / restart / rm --------------------------------------------------------------


def start(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    profile = store().load(name)
    providers.for_profile(profile).check_args(profile)
    backend = get_backend()
    backend.install(_spec(profile))
    before = backend.status(name)
    if before.state == "running":
        return Outcome(name, base_url(profile), ["already running"], before.pid)
    offset = logs.size(log_path(name))
    backend.start(name)
    return _finish(profile, backend, timeout, wait, tick, None, offset)


def restart(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    profile = store().load(name)
    providers.for_profile(profile).check_args(profile)
    backend = get_backend()
    before = backend.status(name)
    offset = logs.size(log_path(name))
    backend.apply(_spec(profile))
    return _finish(profile, backend, timeout, wait, tick, before.pid, offset)


def _finish(profile, backend, timeout, wait, tick, old_pid, offset) -> Outcome:
    out = Outcome(profile.name, base_url(profile))
    if wait:
        ok, why = wait_ready(
            profile, timeout, old_pid=old_pid, tick=tick or (lambda e, s: None), backend=backend
        )
        if not ok:
            raise SetFailed(
                f"{profile.name} is not healthy: {why}",
                logs.tail(log_path(profile.name), 20, since=offset),
                False,
            )
    out.pid = backend.status(profile.name).pid
    return out


def stop(name: str) -> None:
    store().load(name)
    backend = get_backend()
    if not backend.installed(name):
        raise MacserveError(f"service {name} is not installed")
    backend.stop(name)


def remove(name: str) -> None:
    st = store()
    if not st.path(name).exists() and not get_backend().installed(name):
        raise MacserveError(f"no profile {name!r}")
    with st.lock(name):
        get_backend().uninstall(name)
        st.delete(name)


# ---- where a client talks to a profile -----------------------------------------------------------


def endpoint(name: str | None) -> tuple[str, str | None]:
    """(base URL without /v1, the API key the profile's server requires, if any) of profile
    `name`, or of the only profile when `name` is None."""
    st = store()
    if name is None:
        names = st.names()
        if len(names) != 1:
            raise MacserveError(
                "no profiles yet: give a URL, e.g. http://127.0.0.1:8080"
                if not names
                else f"several profiles ({', '.join(names)}): name one, or give a URL"
            )
        name = names[0]
    profile = st.load(name)
    return base_url(profile), _api_key(profile.extra_args)


def _api_key(args) -> str | None:
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--api-key="):
            return a.split("=", 1)[1]
    return None


# ---- ls / status / show -------------------------------------------------------------------------


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
    s: Status = backend.status(name)
    r.update(state=s.state, pid=s.pid, exit_code=s.exit_code, detail=s.detail)
    r.update(_proc_info(s.pid if s.state in ("running", "starting") else None))
    if health:
        r["healthy"] = bool(
            p and s.state == "running" and providers.for_profile(p).ready(p, timeout=2.0)
        )
    return r


def rows(health: bool = False) -> list[dict]:
    backend = get_backend()
    return [row(n, health, backend) for n in store().names()]


def show(name: str) -> dict:
    st = store()
    p = st.load(name)
    prov = providers.for_profile(p)
    try:
        argv = prov.argv(p)
    except MacserveError as e:
        argv = [f"<{e}>"]
    r = row(name)
    r.update(
        file=str(st.path(name)),
        text=st.path(name).read_text(),
        values=dict(p.values),
        argv=argv,
        health_url=prov.health_url(p),
        log=str(log_path(name)),
        backend=get_backend().name,
    )
    return r
