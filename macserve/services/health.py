"""Waiting for a service to become healthy, and what a command that waits reports.

`wait_ready` polls the supervisor and the provider's readiness probe until a new process
serves, or gives up at the first sign it never will; `death` and `why` turn the supervisor's
record and the server's log into one line; `Interrupts` routes Ctrl-C/SIGTERM/SIGHUP through a
rollback; `broken` tells a service that was failing before we touched it. `Outcome` and
`SetFailed` are what new, set, start and restart return or raise.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field

from ..errors import MacserveError
from . import providers, run, share
from .profiles import Profile, ProfileStore
from .supervisors import Status, get_backend, spec_for

# Seconds between health polls, growing to POLL_MAX: quick for small models, and a model that
# loads for minutes does not get its log filled with probe requests. The wait is bounded by a
# deadline, never by a fixed sleep.
POLL, POLL_MAX = 0.25, 2.0
TAIL_LINES = 30  # log lines shown with a failure
STOPPED_GRACE = 5.0  # seconds a "stopped" state may be the supervisor not having started it yet


class SetFailed(MacserveError):
    """New settings did not become healthy; what happened to the previous ones is in the message."""

    def __init__(self, msg: str, log_tail: list[str], restored: bool):
        super().__init__(msg)
        self.log_tail = log_tail
        self.restored = restored


class StoppedDuringWait(MacserveError):
    """The service was stopped (macserve stop, a router's idle stop) while we waited for it: not
    a failure of its settings, so nothing is rolled back."""


@dataclass
class Outcome:
    name: str
    url: str | None = None
    notes: list[str] = field(default_factory=list)
    pid: int | None = None


def store() -> ProfileStore:
    return ProfileStore()


def spec(profile: Profile):
    return spec_for(profile, providers.for_profile(profile).env(profile))


def base_url(profile: Profile) -> str:
    return providers.base_url(profile)


def death(st: Status) -> str:
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
    active = False  # seen starting or running since the (re)start
    while True:
        st = backend.status(profile.name)
        elapsed = time.monotonic() - start
        tick(elapsed, st)
        if st.state == "not installed":
            return False, "the service is not installed"
        if st.died or st.failed:
            return False, death(st)
        active = active or st.state in ("starting", "running") or st.pid not in (None, old_pid)
        # Stopped by someone else. Not before it was seen active (or a few seconds passed):
        # supervisord lists a just-added program as STOPPED until its next loop starts it.
        if (
            st.state == "stopped"
            and (active or elapsed > STOPPED_GRACE)
            and not st.extra.get("supervisor_down")
        ):
            raise StoppedDuringWait(
                f"{profile.name} was stopped by another command while it was starting "
                "(macserve stop, or a router's idle stop)"
            )
        fresh = st.pid is not None and st.pid != old_pid
        if fresh and first_pid is None:
            first_pid = st.pid
        elif fresh and st.pid != first_pid:
            # Died and respawned between two polls: it would only keep doing that.
            return False, f"it exited and was started again (pid {first_pid} -> {st.pid})"
        if fresh and st.state == "running":  # supervisord: it outlived startsecs
            if provider.ready(profile, timeout=min(5.0, max(1.0, timeout - elapsed))):
                # the first start of this provider + model here: its process's own bytes
                share.record_baseline(profile, st.pid)
                return True, ""
            why = provider.failed(profile)
            if why:
                return False, why
        if elapsed > timeout:
            return False, f"not healthy within {timeout:.0f}s (state: {st.state})"
        time.sleep(interval)
        interval = min(POLL_MAX, interval * 1.5)


def with_log_line(profile: Profile, why: str, tail: list[str]) -> str:
    """`why` with the server's own error line in front, when its log has one."""
    line = providers.for_profile(profile).error_line(tail)
    return f"{line} ({why})" if line else why


class Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP as KeyboardInterrupt while `set` waits, so every way out of
    the wait goes through the rollback; held back (and remembered) while the previous settings
    are being put back. Signal handlers exist only in the main thread; elsewhere a no-op.
    A signal that is ignored when `set` starts stays ignored: a shell starts a background job
    with SIGINT ignored, and `nohup` ignores SIGHUP, so that a Ctrl-C or a closed terminal
    does not reach the job; rolling back on one would undo a change the user detached."""

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
            self.saved = {
                s: h for s in self.SIGNALS if (h := signal.getsignal(s)) != signal.SIG_IGN
            }
            for s in self.saved:
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


def failing_before(st: Status, profile: Profile) -> str | None:
    """Why the service was already failing before we touched it (given up, exited, in a crash
    loop: respawned quickly twice or more in a row and not answering), or None."""
    if not st.installed:
        return None
    if st.failed or st.died or st.state in ("exited", "failed"):
        return death(st)
    delay = run.backing_off(st.name)
    if delay >= 2 * run.BACKOFF_FIRST and not providers.for_profile(profile).ready(profile, 2.0):
        return f"it kept exiting and was being restarted with a {delay:.0f}s back-off"
    return None
