"""What the service commands do: new, set (with health check and rollback), start/stop/restart,
rm, and the rows behind ls/status/show. The CLI only parses and prints.

Flow: profiles -> providers (argv, flag check) -> supervisors (the backend) -> health wait.
Nothing on disk changes until the new values have passed validation and the provider's check.

Reusable by name (the router, services/router/, builds on these): `start(name)`, `stop(name)`,
`restart(name)`, `wait_ready(profile, timeout)`, `footprint(name)`.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import signal
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .. import env
from ..errors import MacserveError
from ..sizing.report import inspect_source
from . import plan as sizing_plan
from . import providers, run
from .profiles import (
    KEYS,
    MODELLESS,
    ROUTER_KEYS,
    SECRET_KEYS,
    Profile,
    ProfileStore,
    check_name,
    check_secret,
)
from .providers.base import edit_flags, flag_groups
from .providers.llama_rpc import DEFAULT_PORT as RPC_DEFAULT_PORT
from .providers.router import DEFAULT_PORT as ROUTER_DEFAULT_PORT
from .router import state as router_state
from .supervisors import Status, get_backend, log_path, logs, spec_for

DEFAULT_PORT = 8080
# Seconds between health polls, growing to POLL_MAX: quick for small models, and a model that
# loads for minutes does not get its log filled with probe requests. The wait is bounded by a
# deadline, never by a fixed sleep.
POLL, POLL_MAX = 0.25, 2.0
TAIL_LINES = 30  # log lines shown with a failure


class SetFailed(MacserveError):
    """New settings did not become healthy; what happened to the previous ones is in the message."""

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


def _death(st: Status) -> str:
    """Why a supervised process is gone, from the supervisor's own record."""
    if st.signal:
        hint = {
            "Killed: 9": ": the system may have run out of memory (jetsam)",
            "Abort trap: 6": ": it aborted (a Metal or assertion failure; see the log)",
        }.get(st.signal, "")
        return f"it was killed by signal {st.signal}{hint}"
    if st.failed:
        return f"the supervisor gave up starting it ({st.detail or st.state})"
    if st.exit_code is not None:
        return f"it exited with code {st.exit_code}"
    if st.detail.startswith("exited"):
        return f"it {st.detail}"
    return f"it exited ({st.detail or st.state})"


def wait_ready(
    profile: Profile,
    timeout: float,
    old_pid: int | None = None,
    tick=lambda elapsed, status: None,
    backend=None,
) -> tuple[bool, str]:
    """Poll until the service runs a new process that passes the provider's readiness probe.

    Gives up at the first sign that the new process will not come up by itself: it died (the
    supervisor's record says so, or a second new pid replaced the first), the supervisor gave
    up, or the provider reports the server up but unable to serve.
    """
    backend = backend or get_backend()
    provider = providers.for_profile(profile)
    start = time.monotonic()
    first_pid = None
    interval = POLL
    while True:
        st = backend.status(profile.name)
        elapsed = time.monotonic() - start
        tick(elapsed, st)
        if st.state == "not installed":
            return False, "the service is not installed"
        if st.died or st.failed:
            return False, _death(st)
        fresh = st.pid is not None and st.pid != old_pid
        if fresh and first_pid is None:
            first_pid = st.pid
        elif fresh and st.pid != first_pid:
            # Died and respawned between two polls: it would only keep doing that.
            return False, f"it exited and was started again (pid {first_pid} -> {st.pid})"
        if fresh and st.state == "running":  # supervisord: it outlived startsecs
            if provider.ready(profile, timeout=min(5.0, max(1.0, timeout - elapsed))):
                return True, ""
            why = provider.failed(profile)
            if why:
                return False, why
        if elapsed > timeout:
            return False, f"not healthy within {timeout:.0f}s (state: {st.state})"
        time.sleep(interval)
        interval = min(POLL_MAX, interval * 1.5)


def _why(profile: Profile, why: str, tail: list[str]) -> str:
    """`why` with the server's own error line in front, when its log has one."""
    line = providers.for_profile(profile).error_line(tail)
    return f"{line} ({why})" if line else why


class _Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP as KeyboardInterrupt while `set` waits, so every way out of
    the wait goes through the rollback; held back (and remembered) while the previous settings
    are being put back. Signal handlers exist only in the main thread; elsewhere a no-op."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.holding = False
        self.held: list[int] = []
        self.saved: dict | None = None

    def _handler(self, signum, frame):
        if self.holding:
            self.held.append(signum)
            return
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.getsignal(s) for s in self.SIGNALS}
            for s in self.SIGNALS:
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        if self.saved:
            for s, h in self.saved.items():
                signal.signal(s, h)
        return False

    @contextlib.contextmanager
    def hold(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False


def _broken(st: Status, profile: Profile) -> str | None:
    """Why the service was already failing before we touched it (given up, exited, in a crash
    loop: respawned quickly twice or more in a row and not answering), or None."""
    if not st.installed:
        return None
    if st.failed or st.died or st.state in ("exited", "failed"):
        return _death(st)
    delay = run.backing_off(st.name)
    if delay >= 2 * run.BACKOFF_FIRST and not providers.for_profile(profile).ready(profile, 2.0):
        return f"it kept exiting and was being restarted with a {delay:.0f}s back-off"
    return None


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
    """Nothing listens on host:port and a server could bind it. SO_REUSEADDR as servers set it
    (so a closed connection in TIME_WAIT does not count), plus a connect, because with it
    macOS lets 127.0.0.1:P bind beside a listener on 0.0.0.0:P."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection((providers.url_host(host).strip("[]"), port), timeout=1.0),
    ):
        return False
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
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
    api_key: str | None = None,
    pull=None,
) -> Outcome:
    """`pull(source, quant) -> local path`, when given, downloads a hub model first (with
    progress) so the service starts from the local copy instead of downloading in its wait."""
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
    model = plan.model
    if pull is not None and plan.remote:
        model = str(pull(source, quant))  # sized first: a model that cannot fit is not downloaded
        notes.append(f"serving the downloaded copy in the Hugging Face cache: {model}")
    values = {
        "PROVIDER": plan.provider,
        "MODEL": model,
        "HOST": host,
        "PORT": None,
        "EXTRA_ARGS": shlex.join(args),
    }
    secrets = {}
    if api_key:
        secrets["API_KEY"] = api_key
    if env.hf_token():
        secrets["HF_TOKEN"] = env.hf_token()
        notes.append(f"HF_TOKEN from this shell kept for the service in {st.secrets_path(name)}")
    comment = f"# macserve new {shlex.quote(source)}" + (f" --quant {quant}" if quant else "")
    return _create(st, name, values, comment, port, start, timeout, tick, notes, secrets)


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
        {},
    )
    out.url = f"{host}:{store().load(name).port}"
    return out


def new_router(
    name: str = "router",
    host: str = "127.0.0.1",
    port: int | None = None,
    args: list[str] | tuple[str, ...] = (),
    api_key: str | None = None,
    start=True,
    timeout: float = 60.0,
    tick=None,
) -> Outcome:
    """`macserve router` as a supervised service: a profile with PROVIDER=router whose
    EXTRA_ARGS are the router's options (--ttl, --memory, ...)."""
    name = check_name(name)
    st = store()
    if st.exists(name):
        raise MacserveError(
            f"profile {name} exists (change it with macserve set {name}, or pick --name)"
        )
    values = {"PROVIDER": "router", "HOST": host, "PORT": None, "EXTRA_ARGS": shlex.join(args)}
    secrets = {"API_KEY": api_key} if api_key else {}
    comment = f"# macserve router --install --name {name}"
    return _create(
        st, name, values, comment, port, start, timeout, tick, [], secrets, ROUTER_DEFAULT_PORT
    )


def _moved_note(st: ProfileStore, name: str, prov, moved: Mapping[str, str]) -> str:
    how = ", ".join(
        f"{k} as {prov.api_key_env if k == 'API_KEY' else 'HF_TOKEN'}" for k in sorted(moved)
    )
    return (
        f"moved {', '.join(sorted(moved))} out of EXTRA_ARGS into {st.secrets_path(name)} "
        f"(mode 0600); the server gets {how} in its environment, never on its command line"
    )


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
    secrets: dict[str, str],
    first_port: int = DEFAULT_PORT,
) -> Outcome:
    """Write a new profile (port picked or checked, flags checked), then install and start it."""
    host = values["HOST"]
    with st.lock():
        if st.exists(name):
            raise MacserveError(f"profile {name} exists")
        used = _ports_used(st)
        if port is None:
            port = pick_port(host, set(used), first_port)
        else:
            _check_port(host, port, used, start)
        profile = Profile(name, {**values, "PORT": str(port)}, (comment,))
        prov = providers.for_profile(profile)
        profile, moved = prov.move_secrets(profile)
        if moved:
            notes.append(_moved_note(st, name, prov, moved))
        secrets = {**secrets, **moved}
        prov.check_secrets(secrets)
        prov.check_args(profile)  # a profile that cannot start is never written
        st.save_secrets(name, secrets)  # first: the profile never exists without its key
        st.save(profile)
    out = Outcome(name, base_url(profile), notes)
    if not start:
        return out
    backend = get_backend()
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    with _Interrupts() as sig:
        try:
            backend.apply(_spec(profile))
            ok, why = wait_ready(
                profile, timeout, tick=tick or (lambda e, s: None), backend=backend
            )
        except KeyboardInterrupt:
            ok, why = False, "interrupted"
        if not ok:
            with sig.hold():
                tail = logs.tail(log_path(name), TAIL_LINES, since=offset)
                why = _why(profile, why, tail)
                backend.stop(name)  # do not leave a crash loop behind
    if not ok:
        raise SetFailed(
            f"{name} did not become healthy: {why}; service stopped, profile kept "
            f"(fix with macserve set {name} ..., then macserve start {name})",
            tail,
            False,
        )
    out.pid = backend.status(name).pid
    return out


def _ports_used(st: ProfileStore, but: str | None = None) -> dict[int, str]:
    """{port: profile} of every other profile."""
    out = {}
    for n in st.names():
        if n == but:
            continue
        with contextlib.suppress(MacserveError):
            out[st.load(n).port] = n
    return out


def _check_port(host: str, port: int, used: Mapping[int, str], bind_check: bool = True) -> None:
    if port in used:
        raise MacserveError(f"port {port} is already used by profile {used[port]}")
    if bind_check and not port_free(host, port):
        raise MacserveError(f"port {port} on {host} is in use by another program")


# ---- set ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Changes:
    """What `set` was asked to do: profile values, secrets, and single-flag edits of
    EXTRA_ARGS (`EXTRA_ARGS+=...` sets or replaces those flags, `EXTRA_ARGS-=...` removes them)."""

    values: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)
    add_args: tuple[str, ...] = ()
    drop_args: tuple[str, ...] = ()


def parse_assignments(items: tuple[str, ...]) -> Changes:
    """`KEY=VALUE ...` or `KEY VALUE`; `EXTRA_ARGS+=FLAGS`, `EXTRA_ARGS-=FLAGS`."""
    if not items:
        raise MacserveError("nothing to set: give KEY=VALUE ... or KEY VALUE")
    if all("=" in i for i in items):
        pairs = [i.split("=", 1) for i in items]
    elif len(items) == 2 and "=" not in items[0]:
        pairs = [list(items)]
    else:
        raise MacserveError("expected KEY=VALUE ... or KEY VALUE")
    values, secrets, add, drop = {}, {}, [], []
    for k, v in pairs:
        k = k.strip()
        op = k[-1] if k[-1:] in ("+", "-") else ""
        k = k.rstrip("+-").strip()
        if not k:
            raise MacserveError("empty key")
        if k.upper() in KEYS or k.upper() in SECRET_KEYS:
            k = k.upper()  # `set NAME port 8081` is fine
        if op:
            if k != "EXTRA_ARGS":
                raise MacserveError(f"{k}{op}= : only EXTRA_ARGS takes += and -=")
            try:
                (add if op == "+" else drop).extend(shlex.split(v))
            except ValueError as e:
                raise MacserveError(f"EXTRA_ARGS{op}= does not parse: {e}") from None
        elif k in SECRET_KEYS:
            if v:
                check_secret(k, v)
            secrets[k] = v
        else:
            values[k] = v
    if "EXTRA_ARGS" in values and (add or drop):
        raise MacserveError("give EXTRA_ARGS= or EXTRA_ARGS+=/-=, not both")
    return Changes(values, secrets, tuple(add), tuple(drop))


@dataclass
class _Edit:
    old: Profile
    new: Profile
    old_secrets: dict[str, str]
    new_secrets: dict[str, str]
    notes: list[str]

    @property
    def changed(self) -> bool:
        return self.new.values != self.old.values or self.new_secrets != self.old_secrets


def _prepare(st: ProfileStore, name: str, changes: Changes, checked: _Edit | None = None) -> _Edit:
    """The edit `changes` makes to profile `name`, checked like a start would check it: keys,
    secrets the server can take, ports, flags. The provider's check is skipped when the result
    equals `checked` (it is slow for multi-host profiles: it inspects the model, ssh-checks hosts)."""
    old = st.load(name)
    old_secrets = st.load_secrets(name)
    values = dict(changes.values)
    notes: list[str] = []
    prov = providers.get(values.get("PROVIDER") or old.provider)
    if changes.add_args or changes.drop_args:
        args = edit_flags(
            list(old.extra_args), list(changes.add_args), list(changes.drop_args), prov.flags()
        )
        values["EXTRA_ARGS"] = shlex.join(args)
    new = old.updated(values)
    prov = providers.for_profile(new)
    new, moved = prov.move_secrets(new)
    if moved:
        notes.append(_moved_note(st, name, prov, moved))
    secrets = {**old_secrets, **moved, **changes.secrets}
    secrets = {k: v for k, v in secrets.items() if v}
    prov.check_secrets(secrets)
    if "EXTRA_ARGS" in changes.values:
        lost = _lost_flags(old, new, prov)
        if lost:
            notes.append(
                f"EXTRA_ARGS no longer has {', '.join(lost)} (EXTRA_ARGS= replaces the whole "
                "value; EXTRA_ARGS+='FLAG VALUE' changes single flags)"
            )
    if (new.port, new.host) != (old.port, old.host):
        _check_port(new.host, new.port, _ports_used(st, but=name), new.port != old.port)
    if new.aliases != old.aliases:
        _check_aliases(st, new)
    edit = _Edit(old, new, old_secrets, secrets, notes)
    prov.validate(new)  # no I/O: also when only the router's keys changed
    if _server_values(new) != _server_values(old) and (checked is None or new != checked.new):
        prov.check_args(new)  # refuse before anything is written or restarted
    return edit


def _lost_flags(old: Profile, new: Profile, prov) -> list[str]:
    try:
        table = prov.flags()
    except MacserveError:
        table = {}
    kept = {c for c, _ in flag_groups(list(new.extra_args), table) if c}
    return [
        shlex.join(g) for c, g in flag_groups(list(old.extra_args), table) if c and c not in kept
    ]


def _as_changes(changes) -> Changes:
    if isinstance(changes, Changes):
        return changes
    values = {k: v for k, v in changes.items() if k not in SECRET_KEYS}
    return Changes(values, {k: v for k, v in changes.items() if k in SECRET_KEYS})


def set_values(
    name: str, changes, restart: bool = True, timeout: float = 300.0, tick=None
) -> Outcome:
    """Check, write, restart, wait; on failure or interrupt put the previous profile (and
    secrets) back. `changes`: a `Changes`, or a {KEY: value} dict."""
    changes = _as_changes(changes)
    st = store()
    checked = _prepare(st, name, changes)  # bad input fails here, before the lock file exists
    with st.lock(name):
        # Again under the lock: the file may have moved on (then the result is checked again).
        edit = _prepare(st, name, changes, checked)
        out = Outcome(name, base_url(edit.new), list(edit.notes))
        if not edit.changed:
            out.notes.append("no change")
            return out
        if _router_only(edit):
            _save(st, edit.new, edit.new_secrets)
            out.notes.append(
                f"saved; {' and '.join(ROUTER_KEYS)} are read by the router, so nothing was "
                "restarted"
            )
            return out
        backend = get_backend()
        before = backend.status(name)
        broken = _broken(before, edit.old)  # now: the restart resets what it is read from
        _save(st, edit.new, edit.new_secrets)
        if not restart:
            out.notes.append("saved; not restarted (--no-restart)")
            return out
        if before.state in ("not installed", "stopped"):
            out.notes.append(f"saved; {name} is {before.state}, so nothing was restarted")
            return out
        with _Interrupts() as sig:
            return _restart_or_roll_back(st, backend, edit, before, broken, timeout, tick, sig, out)


def _server_values(p: Profile) -> dict[str, str]:
    """What the server's command depends on: every key but the router's."""
    return {k: v for k, v in p.values.items() if k not in ROUTER_KEYS}


def _router_only(edit: _Edit) -> bool:
    keys = set(edit.new.values) | set(edit.old.values)
    changed = {k for k in keys if edit.new.values.get(k) != edit.old.values.get(k)}
    return edit.new_secrets == edit.old_secrets and bool(changed) and changed <= set(ROUTER_KEYS)


def _check_aliases(st: ProfileStore, new: Profile) -> None:
    """A name the router resolves must mean one profile: an alias is no other profile's name
    or alias."""
    for other in st.names():
        if other == new.name:
            continue
        if other in new.aliases:
            raise MacserveError(f"ALIASES: {other} is the name of another profile")
        try:
            both = set(st.load(other).aliases) & set(new.aliases)
        except MacserveError:  # a broken profile claims nothing
            continue
        if both:
            raise MacserveError(
                f"ALIASES: {', '.join(sorted(both))} is already an alias of profile {other}"
            )


def _save(st: ProfileStore, profile: Profile, secrets: dict[str, str]) -> None:
    st.save_secrets(profile.name, secrets)
    st.save(profile)


def _restart_or_roll_back(
    st, backend, edit: _Edit, before: Status, broken: str | None, timeout, tick, sig, out
):
    name = edit.new.name
    tick = tick or (lambda e, s: None)
    offset = logs.size(log_path(name))
    interrupted = False
    try:
        run.reset_backoff(name)
        backend.apply(_spec(edit.new))
        ok, why = wait_ready(edit.new, timeout, old_pid=before.pid, tick=tick, backend=backend)
    except KeyboardInterrupt:
        ok, why, interrupted = False, "", True
    except MacserveError as e:
        ok, why = False, str(e)
    if ok:
        out.pid = backend.status(name).pid
        return out
    with sig.hold():
        tail = [] if interrupted else logs.tail(log_path(name), TAIL_LINES, since=offset)
        head = (
            f"interrupted while the new settings for {name} were starting"
            if interrupted
            else f"new settings for {name} failed: {_why(edit.new, why, tail)}"
        )
        _save(st, edit.old, edit.old_secrets)  # the profile is what it was before this set
        if broken:
            # Putting back settings that were failing is no rollback: leave it stopped.
            backend.stop(name)
            raise SetFailed(
                f"{head}; the previous settings were already failing before this change "
                f"({broken}), so they are back in the profile but not restarted: "
                f"{name} is stopped (fix it with macserve set {name} ..., then macserve start "
                f"{name})",
                tail,
                False,
            )
        failed_pid = backend.status(name).pid
        try:
            run.reset_backoff(name)
            backend.apply(_spec(edit.old))
        except MacserveError as e:
            raise SetFailed(
                f"{head}; previous settings restored but could not be restarted: {e}", tail, False
            ) from None
    try:
        restored, why2 = wait_ready(
            edit.old, timeout, old_pid=failed_pid, tick=tick, backend=backend
        )
    except KeyboardInterrupt:
        raise SetFailed(
            f"{head}; previous settings restored and restarting (interrupted again before it "
            f"was healthy: see macserve status {name})",
            tail,
            False,
        ) from None
    state = (
        "previous settings restored and healthy"
        if restored
        else f"previous settings restored but not healthy: {why2}"
    )
    raise SetFailed(f"{head}; {state}", tail, restored)


# ---- start / stop / restart / rm --------------------------------------------------------------


def _checked(name: str) -> Profile:
    """The profile, refused now if its server would refuse it (secrets, flags, model)."""
    st = store()
    profile = st.load(name)
    prov = providers.for_profile(profile)
    prov.check_secrets(st.load_secrets(name))
    prov.check_args(profile)
    return profile


def start(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    """Install the unit if needed and start it; a unit that changed is reloaded first."""
    profile = _checked(name)
    backend = get_backend()
    before = backend.status(name)
    if before.state == "running" and not backend.install(_spec(profile)):
        return Outcome(name, base_url(profile), ["already running"], before.pid)
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    backend.apply(_spec(profile))
    return _finish(profile, backend, timeout, wait, tick, before.pid, offset)


def restart(name: str, timeout: float = 300.0, wait=True, tick=None) -> Outcome:
    profile = _checked(name)
    backend = get_backend()
    before = backend.status(name)
    offset = logs.size(log_path(name))
    run.reset_backoff(name)
    backend.apply(_spec(profile))
    return _finish(profile, backend, timeout, wait, tick, before.pid, offset)


def _finish(profile, backend, timeout, wait, tick, old_pid, offset) -> Outcome:
    out = Outcome(profile.name, base_url(profile))
    if wait:
        ok, why = wait_ready(
            profile, timeout, old_pid=old_pid, tick=tick or (lambda e, s: None), backend=backend
        )
        if not ok:
            tail = logs.tail(log_path(profile.name), TAIL_LINES, since=offset)
            raise SetFailed(
                f"{profile.name} is not healthy: {_why(profile, why, tail)}", tail, False
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
        run.reset_backoff(name)


# ---- where a client talks to a profile -----------------------------------------------------------


def has_profile(name: str) -> bool:
    try:
        return store().exists(name)
    except MacserveError:  # not even a valid name (a prompt with spaces)
        return False


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
    return base_url(profile), st.load_secrets(name).get("API_KEY")


# ---- what a profile needs in memory --------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """A profile's memory as inspect counts it: weights + its cache at its configured context."""

    name: str
    weights_bytes: int | None = None
    cache_bytes: int | None = None
    ctx: int | None = None
    cache_key: str | None = None
    note: str = ""
    error: str | None = None

    @property
    def total_bytes(self) -> int | None:
        if self.weights_bytes is None and self.cache_bytes is None:
            return None
        return (self.weights_bytes or 0) + (self.cache_bytes or 0)


def footprint(name: str) -> Footprint:
    p = store().load(name)
    prov = providers.for_profile(p)
    if p.provider in MODELLESS:
        note = (
            "the router: it holds no model"
            if p.provider == "router"
            else "an RPC worker: the head sends it layers to hold"
        )
        return Footprint(name, note=note)
    key = prov.cache_key(p)
    try:
        rep = inspect_source(p.model)
    except MacserveError as e:
        return Footprint(name, cache_key=key, error=str(e))
    ctx, note = prov.context_of(p), ""
    if ctx is None:
        ctx = rep.shape.max_position_embeddings
        note = "no context set: counted at the model's limit"
        if prov.context_args(1) is None:
            note = f"{prov.label} grows its cache per request: counted up to the model's limit"
    lay = rep.layouts.get(key)
    cache = lay.bytes_at(ctx) if lay is not None and lay.supported and ctx else None
    if p.multi_host:
        note = (note + "; " if note else "") + "the whole model, before it is split over HOSTS"
    return Footprint(name, rep.weights_bytes, cache, ctx, key, note)


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
    r.update(state=s.state, pid=s.pid, exit_code=s.exit_code, signal=s.signal, detail=s.detail)
    r.update(_proc_info(s.pid if s.state in ("running", "starting") else None))
    if health:
        r["healthy"] = bool(
            p and s.state == "running" and providers.for_profile(p).ready(p, timeout=2.0)
        )
    return r


def rows(health: bool = False) -> list[dict]:
    """Every profile's row; `routed` lists the running routers that serve it (the router's
    own state file: its URL, the profile's TTL there, None for always on, its state)."""
    backend = get_backend()
    routers = router_state.live()
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
        argv = prov.argv(p)
    except MacserveError as e:
        argv = [f"<{e}>"]
    secrets = st.load_secrets(name)
    r = row(name)
    r.update(
        file=str(st.path(name)),
        text=st.path(name).read_text(),
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
