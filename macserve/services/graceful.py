"""`macserve run` as the parent of a server that has no graceful stop of its own (llama-server).

Such a server is not exec'd: it runs as this process's child, and this process takes the
supervisor's SIGTERM (SIGINT, SIGHUP). On a stop it waits, up to the profile's DRAIN, until no
generation is in flight (the provider's `busy`), lets the provider keep what it can
(`before_stop`: llama-server's slots), and only then signals the server, which then exits at
once: a stream running when the stop came finishes, and the client gets its last event. A
stream still running when DRAIN ends is cut (a log line says so, and the client sees the
connection drop: llama-server cannot end it with an error event). The supervisor's SIGKILL
comes later still: its stop timeout is DRAIN + values.STOP_MARGIN (supervisors/base.py).
After a start, once the server is ready, the provider puts back what it kept (`after_start`).

On Linux the child gets its own process group, so supervisord's group SIGTERM reaches only
this process, and PR_SET_PDEATHSIG, so a SIGKILL of this process (the supervisor's, after its
grace) takes the server with it: no server outlives its service. On macOS launchd signals the
job's pid only and kills its process group at the end, so the child stays in ours.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .profiles import Profile
from .providers import Provider
from .values import drain_secs

Log = Callable[[str], None]

EXIT_SECS = 8.0  # after the drain: within values.STOP_MARGIN, with the slots' save
_LINUX = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run(
    name: str, provider: Provider, profile: Profile, argv: list[str], variables: dict[str, str]
) -> int:
    def log(msg: str) -> None:
        print(f"macserve run {name}: {msg}", file=sys.stderr, flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    child = subprocess.Popen(
        argv,
        env=variables,
        start_new_session=_LINUX,
        preexec_fn=_die_with_parent if _LINUX else None,  # noqa: PLW1509 (no threads yet)
    )

    def restore() -> None:
        # Ready first (a large model loads for minutes); never during a stop.
        while child.poll() is None and not stop.is_set():
            if provider.ready(profile, timeout=2.0):
                if not stop.is_set():
                    provider.after_start(profile, argv, log)
                return
            time.sleep(0.5)

    threading.Thread(target=restore, daemon=True).start()
    while child.poll() is None and not stop.wait(0.5):
        pass
    if child.poll() is None:
        _stop(provider, profile, argv, child, log)
    rc = child.wait()
    return 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell reports it


def wait_idle(
    busy: Callable[[], int | None],
    drain: float,
    name: str,
    log: Log,
    alive: Callable[[], bool] = lambda: True,
) -> int | None:
    """Wait, up to `drain` seconds, until `busy()` (generations in flight; None: cannot tell)
    is 0, logging what the wait was and how it ended; the count left (0: none, cut: some).
    The lines are the same for every server that drains (mlx_drain.py too)."""
    t0 = time.monotonic()
    deadline = t0 + drain
    n = busy()
    if n:
        log(f"stop: waiting for {n} generation(s) in flight (up to DRAIN={drain:g}s)")
        while n and time.monotonic() < deadline and alive():
            time.sleep(0.2)
            n = busy()
        log(
            f"stop: {n} generation(s) still running after DRAIN={drain:g}s: cut (a longer "
            f"one needs a larger DRAIN: macserve set {name} -- DRAIN=...)"
            if n
            else f"stop: generations finished after {time.monotonic() - t0:.1f}s"
        )
    elif n is None:
        log("stop: the server cannot say whether it is generating (no /slots): stopping now")
    return n


def _stop(
    provider: Provider, profile: Profile, argv: list[str], child: subprocess.Popen, log: Log
) -> None:
    wait_idle(
        lambda: provider.busy(profile),
        drain_secs(profile.drain),
        profile.name,
        log,
        alive=lambda: child.poll() is None,
    )
    if child.poll() is None:
        try:
            provider.before_stop(profile, argv, log)
        except Exception as e:  # keeping the cache is a bonus: the stop itself must go on
            log(f"stop: could not keep the cache: {e}")
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(EXIT_SECS)
        except subprocess.TimeoutExpired:
            log(f"stop: the server did not exit {EXIT_SECS:.0f}s after SIGTERM: SIGKILL")
            child.kill()
