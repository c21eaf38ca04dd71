"""launchctl, the one place it runs, and what its `print` says read as a `Status`.

Every call runs MACSERVE_LAUNCHCTL or `launchctl` from PATH (tests substitute a recording
stand-in there) with a timeout: a hung launchd is one line, not a traceback. A verb that
changes the `system` domain asks for root first (one line with the sudo command).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

from ... import env
from ...errors import MacserveError
from .base import Status
from .launchd_domains import SYSTEM, need_root

NOT_FOUND = 113  # launchctl print: "could not find service"
EINPROGRESS = 36  # bootout while the job is still exiting
LAUNCHCTL_TIMEOUT = 60.0  # seconds; launchctl normally answers in milliseconds
# launchctl verbs that change a domain: in `system` only root may run them
WRITES = ("bootstrap", "bootout", "enable", "disable", "kill", "kickstart")


def run(*args: str) -> subprocess.CompletedProcess:
    """`launchctl ARGS`, bounded by LAUNCHCTL_TIMEOUT; a write to `system` needs root."""
    exe = env.launchctl() or shutil.which("launchctl")
    if not exe:
        raise MacserveError("launchctl not found (the launchd backend needs macOS)")
    if args[0] in WRITES and any(a == SYSTEM or a.startswith(SYSTEM + "/") for a in args):
        need_root(f"launchctl {args[0]} {args[-1]}")
    try:
        return subprocess.run(
            [exe, *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=LAUNCHCTL_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        raise MacserveError(
            f"launchctl {shlex.join(args)} did not answer within {LAUNCHCTL_TIMEOUT:.0f}s: "
            "launchd is hung or overloaded; nothing was changed after that call, try again"
        ) from None


def failure(r: subprocess.CompletedProcess) -> str:
    """A failed call's last line of output and its exit status, for an error message."""
    out = (r.stderr or r.stdout).strip().splitlines()
    return f"{out[-1] if out else ''} (exit {r.returncode})".strip()


_PRINT_LINE = re.compile(r"^\t([a-z][a-z ]*?) = (.*)$")  # top-level properties: one tab in


def parse_print(text: str) -> dict[str, str]:
    """`launchctl print`'s top-level properties (the text is for humans: read defensively)."""
    props: dict[str, str] = {}
    for line in text.splitlines():
        m = _PRINT_LINE.match(line)
        if m and m.group(1) not in props:
            props[m.group(1)] = m.group(2).strip()
    return props


def pid(p: dict[str, str]) -> int | None:
    """The job's pid in `print`'s properties; None when it is not running."""
    return int(p["pid"]) if p.get("pid", "").isdigit() else None


def status(name: str, p: dict[str, str], installed: bool) -> Status:
    """`launchctl print`'s fields as a Status. `crash-loop`: loaded, not running, its last
    run failed (a non-zero exit code or a terminating signal) and launchd has already
    respawned it at least once (`runs` counts the spawns of this job: every macserve (re)start
    is a fresh bootstrap, at 1), so KeepAlive will spawn it again after ThrottleInterval."""
    running_pid = pid(p)
    m = re.match(r"-?\d+", p.get("last exit code", ""))  # "(never exited)" has none
    exit_code = int(m.group()) if m else None
    sig = p.get("last terminating signal") or None
    runs = int(p["runs"]) if p.get("runs", "").isdigit() else None
    st = p.get("state", "unknown")
    running = st == "running" and running_pid is not None
    died = not running and (exit_code is not None or sig is not None)
    failed = bool(sig) or (exit_code is not None and exit_code != 0)
    if running:
        state = "running"
    elif died and failed and (runs or 0) >= 2:
        state = "crash-loop"
    elif died:  # loaded, not running, its last run ended: launchd may respawn it
        state = "exited"
    elif st in ("spawn scheduled", "waiting"):
        state = "starting"
    elif st == "not running":
        state = "stopped"
    else:
        state = st
    return Status(
        name,
        installed,
        state,
        pid=running_pid,
        exit_code=exit_code,
        runs=runs,
        died=died,
        signal=sig,
        detail=f"launchd state {st}"
        + (f", runs {runs}" if runs else "")
        + (f", last exit code {exit_code}" if exit_code is not None else "")
        + (f", last terminating signal {sig}" if sig else ""),
    )
