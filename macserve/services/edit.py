"""`set`: change a profile (values, secrets, single EXTRA_ARGS flags), check the result as a
start would, save it, restart the service and wait for health; on a failure or an interrupt,
put the previous profile and secrets back and restart those. Nothing on disk changes until the
new values have passed validation and the provider's check.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import MacserveError
from . import journal, providers, run, share
from .create import check_ctx, moved_note
from .health import (
    TAIL_LINES,
    Interrupts,
    Outcome,
    SetFailed,
    StoppedDuringWait,
    base_url,
    failing_before,
    spec,
    store,
    wait_ready,
    with_log_line,
)
from .ports import check_port, ports_used
from .profiles import KEYS, ROUTER_KEYS, Profile, ProfileStore
from .providers.flags import edit_flags, flag_groups
from .supervisors import Status, get_backend, log_path, logs
from .values import SECRET_KEYS, check_secret


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
    values: dict[str, str] = {}
    secrets: dict[str, str] = {}
    add: list[str] = []
    drop: list[str] = []
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
    old: Profile  # the file as it was: what a rollback writes back
    new: Profile
    old_secrets: dict[str, str]
    new_secrets: dict[str, str]
    notes: list[str]
    # `old` with CTX and KV lifted out of an old profile's EXTRA_ARGS: what `new` is compared
    # with to decide what changed (the lift alone restarts nothing)
    base: Profile

    @property
    def changed(self) -> bool:
        return self.new.values != self.old.values or self.new_secrets != self.old_secrets

    @property
    def only_lifted(self) -> bool:
        return self.new.values == self.base.values and self.new_secrets == self.old_secrets


def _prepare(st: ProfileStore, name: str, changes: Changes, checked: _Edit | None = None) -> _Edit:
    """The edit `changes` makes to profile `name`, checked like a start would check it: keys,
    secrets the server can take, ports, flags. The provider's check is skipped when the result
    equals `checked` (it is slow for multi-host profiles: it inspects the model, ssh-checks hosts)."""
    raw = st.load(name)
    old, lifted = providers.for_profile(raw).lift(raw)
    old_secrets = st.load_secrets(name)
    values = dict(changes.values)
    notes: list[str] = [lifted] if lifted else []
    prov = providers.get(values.get("PROVIDER") or old.provider)
    if changes.add_args or changes.drop_args:
        args = edit_flags(
            list(old.extra_args), list(changes.add_args), list(changes.drop_args), prov.flags()
        )
        values["EXTRA_ARGS"] = shlex.join(args)
    new = old.updated(values)
    prov = providers.for_profile(new)
    new, lifted = prov.lift(new)  # EXTRA_ARGS+='-c N' sets CTX
    if lifted:
        notes.append(lifted)
    new, moved = prov.move_secrets(new)
    if moved:
        notes.append(moved_note(st, name, prov, moved))
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
        check_port(new.host, new.port, ports_used(st, but=name), new.port != old.port)
    if new.aliases != old.aliases:
        _check_aliases(st, new)
    edit = _Edit(raw, new, old_secrets, secrets, notes, old)
    prov.validate(new)  # no I/O: also when only the router's keys changed
    sized = ("ctx", "kv", "model", "provider", "hosts", "parallel", "memory")
    if checked is None and any(getattr(new, k) != getattr(old, k) for k in sized):
        check_ctx(new)  # beyond the model's limit or the budget: refused before writing
    if _server_values(new) != _server_values(old) and (checked is None or new != checked.new):
        # refuse before anything is written or restarted (a MEMORY too small: with figures)
        prov.check_args(new, share.check(new).limits())
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
    backend = get_backend()
    # A change a killed `set` left half done is settled first: ours starts from settled ground.
    settled = journal.recover(name, backend, st)
    checked = _prepare(st, name, changes)  # bad input fails here, before the lock file exists
    with st.lock(name):
        settled = journal.recover(name, backend, st, locked=True) or settled
        # Again under the lock: the file may have moved on (then the result is checked again).
        edit = _prepare(st, name, changes, checked)
        out = Outcome(name, base_url(edit.new), ([settled] if settled else []) + edit.notes)
        if not edit.changed:
            out.notes.append("no change")
            return out
        if edit.only_lifted or _router_only(edit):
            _journaled_save(st, edit, journal.Entry(name, st.text(name), edit.old_secrets, False))
            out.notes.append(
                "saved; the server runs as before, so nothing was restarted"
                if edit.only_lifted
                else f"saved; {' and '.join(ROUTER_KEYS)} are read by the router, so nothing "
                "was restarted"
            )
            return out
        before = backend.status(name)
        broken = failing_before(before, edit.old)  # now: the restart resets what it is read from
        running = before.state not in ("not installed", "stopped")
        entry = journal.Entry(
            name, st.text(name), edit.old_secrets, running, broken, before.pid, journal.SAVING
        )
        if not restart or not running:
            _journaled_save(st, edit, entry)
            out.notes.append(
                "saved; not restarted (--no-restart)"
                if not restart
                else f"saved; {name} is {before.state}, so nothing was restarted"
            )
            return out
        journal.begin(st, entry)  # the previous settings are safe before anything changes
        _save(st, edit.new, edit.new_secrets)
        with Interrupts() as sig:
            return _restart_or_roll_back(
                st, backend, edit, before, broken, timeout, tick, sig, out, entry
            )


def _journaled_save(st: ProfileStore, edit: _Edit, entry: journal.Entry) -> None:
    """Profile and secrets are two files: a kill between them must not leave half a change."""
    journal.begin(st, entry)
    _save(st, edit.new, edit.new_secrets)
    journal.end(st, edit.new.name)


def _server_values(p: Profile) -> dict[str, str]:
    """What the server's command depends on: every key but the router's."""
    return {k: v for k, v in p.values.items() if k not in ROUTER_KEYS}


def _router_only(edit: _Edit) -> bool:
    keys = set(edit.new.values) | set(edit.base.values)
    changed = {k for k in keys if edit.new.values.get(k) != edit.base.values.get(k)}
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
    st, backend, edit: _Edit, before: Status, broken: str | None, timeout, tick, sig, out, entry
):
    name = edit.new.name
    tick = tick or (lambda e, s: None)
    offset = logs.size(log_path(name))
    interrupted = False
    journal.phase(st, entry, journal.RESTARTING)
    try:
        run.reset_backoff(name)
        backend.apply(spec(edit.new))
        ok, why = wait_ready(edit.new, timeout, old_pid=before.pid, tick=tick, backend=backend)
    except KeyboardInterrupt:
        ok, why, interrupted = False, "", True
    except StoppedDuringWait as e:
        # Someone else's stop is no verdict on the settings: keep them, say so, end at once.
        journal.end(st, name)
        out.notes.append(
            f"{e}: the new settings are kept (saved, not verified); macserve start {name} "
            "runs and checks them"
        )
        return out
    except MacserveError as e:
        ok, why = False, str(e)
    if ok:
        journal.end(st, name)
        out.pid = backend.status(name).pid
        return out
    with sig.hold():
        journal.phase(st, entry, journal.RESTORING)
        tail = [] if interrupted else logs.tail(log_path(name), TAIL_LINES, since=offset)
        head = (
            f"interrupted while the new settings for {name} were starting"
            if interrupted
            else f"new settings for {name} failed: {with_log_line(edit.new, why, tail)}"
        )
        _save(st, edit.old, edit.old_secrets)  # the profile is what it was before this set
        if broken:
            # Putting back settings that were failing is no rollback: leave it stopped.
            backend.stop(name)
            journal.end(st, name)
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
            backend.apply(spec(edit.old))
        except MacserveError as e:
            raise SetFailed(
                f"{head}; previous settings restored but could not be restarted: {e}", tail, False
            ) from None
        journal.end(st, name)  # the previous settings are back and running again
    try:
        restored, why2 = wait_ready(
            edit.old, timeout, old_pid=failed_pid, tick=tick, backend=backend
        )
    except StoppedDuringWait as e:
        raise SetFailed(f"{head}; previous settings restored; then {e}", tail, False) from None
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
