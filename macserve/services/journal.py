"""The change journal: what `set` records before it writes new settings, so that no signal at
any moment loses the previous ones.

`profiles/.NAME.pending` (JSON, mode 0600: it holds the previous secrets) is written before
the new profile and secrets, updated as the change moves on (`phase`: saving -> restarting ->
restoring) and removed when the change is settled (healthy, rolled back, or saved without a
restart). While it exists and its owner lives, the profile is being changed: the router does
not idle-stop it (`changing`).

A journal whose owner is gone (the `set` was killed) is settled by the next command that
meets it (`recover`: ls, status, doctor, start, stop, restart, set): the new settings are kept
if they are running and healthy, else the previous profile and secrets are written back and,
if the service ran before the change, restarted. A command that cannot settle it (another
holds the profile's lock, the supervisor does not answer) reports it with the command that
does (`pending_note`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field

import psutil

from .. import env
from ..errors import MacserveError
from ..fileio import atomic_write
from . import providers
from .health import spec
from .profiles import ProfileStore, check_name, parse

SAVING, RESTARTING, RESTORING = "saving", "restarting", "restoring"


@dataclass
class Entry:
    name: str
    old_text: str  # the profile file as it was: what a rollback writes back
    old_secrets: dict[str, str]
    was_running: bool  # the service ran before the change: a rollback restarts it
    broken: str | None = None  # it was already failing: a rollback leaves it stopped
    before_pid: int | None = None
    phase: str = SAVING
    owner: int = field(default_factory=os.getpid)
    owner_started: float = field(default_factory=lambda: _started(os.getpid()))
    since: float = field(default_factory=time.time)


def _started(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def path(st: ProfileStore, name: str):
    return st.dir / f".{check_name(name)}.pending"


def begin(st: ProfileStore, entry: Entry) -> None:
    atomic_write(path(st, entry.name), json.dumps(asdict(entry)), 0o600)
    if env.journal_pause() == entry.phase:
        time.sleep(3600)  # tests: SIGKILL lands exactly here


def phase(st: ProfileStore, entry: Entry, value: str) -> None:
    entry.phase = value
    begin(st, entry)


def end(st: ProfileStore, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path(st, name).unlink()


def read(st: ProfileStore, name: str) -> Entry | None:
    try:
        data = json.loads(path(st, name).read_bytes())
        return Entry(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        raise MacserveError(f"{path(st, name)}: unreadable change journal ({e})") from None


def owner_alive(entry: Entry) -> bool:
    # pid and start time: a pid reused by another process is not the owner
    return entry.owner_started > 0 and abs(_started(entry.owner) - entry.owner_started) < 0.01


def changing(name: str, st: ProfileStore | None = None) -> bool:
    """A change to `name` is in progress (its owner lives): the router leaves it alone."""
    try:
        entry = read(st or ProfileStore(), name)
    except MacserveError:
        return True  # unsure: leaving a profile up a while longer costs less than a lost change
    return entry is not None and owner_alive(entry)


def pending_note(name: str) -> str:
    return (
        f"an interrupted change to {name} is not settled yet: macserve restart {name} settles "
        "it (keeps the new settings if healthy, else restores the previous ones)"
    )


@contextlib.contextmanager
def _try_lock(st: ProfileStore, name: str):
    """The profile's edit lock if free now, else None: a live `set` holds it."""
    st.dir.mkdir(parents=True, exist_ok=True)
    with open(st.dir / f".{name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def recover(name: str, backend, st: ProfileStore | None = None, locked: bool = False) -> str | None:
    """Settle a journal whose owner is gone; the line saying what was done, or None (nothing to
    settle, or its owner is still at work). `locked`: the caller holds the profile's lock."""
    st = st or ProfileStore()
    entry = read(st, name)
    if entry is None or owner_alive(entry):
        return None
    if locked:
        return _settle(st, entry, backend)
    with _try_lock(st, name) as got:
        if not got:
            return None
        entry = read(st, name)  # settled by another command meanwhile?
        if entry is None or owner_alive(entry):
            return None
        return _settle(st, entry, backend)


def _settle(st: ProfileStore, entry: Entry, backend) -> str:
    name = entry.name
    if entry.phase == RESTARTING:
        try:
            new = st.load(name)
            s = backend.status(name)
            if (
                s.state == "running"
                and s.pid not in (None, entry.before_pid)
                and providers.for_profile(new).ready(new, timeout=5.0)
            ):
                end(st, name)
                return (
                    f"{name}: an interrupted change was settled: the new settings are running "
                    "and healthy, so they are kept"
                )
        except MacserveError:
            pass  # the new profile does not even load: put the previous one back
    _restore(st, entry)
    done = "restored the previous settings"
    if entry.phase != SAVING:
        # The killed command had restarted the service (or was restoring it): run the previous
        # settings again, or leave it stopped if they were failing before the change.
        old = st.load(name)
        if entry.was_running and not entry.broken:
            backend.apply(spec(old))
            done += f" and restarted them (macserve status {name} shows when healthy)"
        elif backend.installed(name):
            backend.stop(name)
            done += f"; {name} is stopped, as it was failing before the change"
    end(st, name)
    return f"{name}: an interrupted change was settled: {done}"


def _restore(st: ProfileStore, entry: Entry) -> None:
    parse(entry.old_text, entry.name)  # what we write back must read back
    st.save_secrets(entry.name, entry.old_secrets)
    atomic_write(st.path(entry.name), entry.old_text)
