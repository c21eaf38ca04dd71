"""launchd backend (macOS): a per-user LaunchAgent per profile, driven with launchctl 2 verbs.

Files: the plist is built with plistlib (`plist_dict`, no template) into
`~/Library/LaunchAgents/dev.macserve.NAME.plist` (MACSERVE_LAUNCH_AGENTS overrides the folder,
for tests).

Domain, as Homebrew picks it: `gui/<uid>` normally; `user/<uid>` in an SSH session when the
console belongs to someone else or nobody (a headless Mac: the gui domain does not exist and
bootstrap fails with 125). MACSERVE_LAUNCHD_DOMAIN overrides it. The plist's
`LimitLoadToSessionType` matches the domain (Aqua for gui, Background for user): launchd refuses
to load a job into a session its plist does not name (error 5/134). An installed unit is always
addressed in the domain its own plist names, so a unit bootstrapped over SSH is found from a
GUI shell, and the next restart moves it.

Verbs, and why:
  start      enable + bootstrap          (a disabled job refuses to bootstrap; Homebrew does the same)
  restart    graceful stop, bootout, write the plist, enable + bootstrap: always a fresh job, so
             launchd runs the plist as it is now (kickstart never rereads it) and its run
             record ("last exit code", "last terminating signal") belongs to the new process
  graceful   kill SIGTERM, wait up to ExitTimeOut for the process to go, then kill SIGKILL (not
             `kickstart -k`, which SIGKILLs at once and drops in-flight requests)
  stop       graceful stop, bootout, wait until gone, disable (disable keeps it from coming back
             at login)
  uninstall  graceful stop, bootout, remove the plist
  status     print  (113 = not loaded; the text is for humans, so parse it defensively)

Every launchctl call goes through `_launchctl`, which runs MACSERVE_LAUNCHCTL or `launchctl`
from PATH; tests substitute a recording stand-in there.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
import time
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write
from .base import ServiceSpec, Status

LABEL_PREFIX = "dev.macserve."
THROTTLE_INTERVAL = (
    30  # seconds between spawns: a crash loop must not remap a huge model every 10 s
)
EXIT_TIMEOUT = 20  # SIGTERM -> SIGKILL: launchd's on bootout, ours on a graceful stop
NOT_FOUND = 113  # launchctl print: "could not find service"
EINPROGRESS = 36  # bootout while the job is still exiting
CONSOLE = "/dev/console"
# launchd's session type for each per-user domain (launchd.plist(5), LimitLoadToSessionType).
SESSION_TYPES = {"gui": "Aqua", "user": "Background"}
DOMAINS = {v: k for k, v in SESSION_TYPES.items()}


def label(name: str) -> str:
    return LABEL_PREFIX + name


def agents_dir() -> Path:
    return env.launch_agents()


def console_uid() -> int | None:
    """Who owns the console (logged in at the screen); None if it cannot be read."""
    try:
        return os.stat(CONSOLE).st_uid
    except OSError:
        return None


def domain() -> str:
    """The domain new units go to: MACSERVE_LAUNCHD_DOMAIN, else Homebrew's rule (user/<uid>
    over SSH when this user does not own the console, gui/<uid> otherwise)."""
    d = env.launchd_domain()
    if d:
        return d
    uid = os.getuid()
    if env.ssh_session() and console_uid() != uid:
        return f"user/{uid}"
    return f"gui/{uid}"


def session_type(dom: str) -> str:
    kind = dom.split("/", 1)[0]
    if kind not in SESSION_TYPES:
        raise MacserveError(
            f"launchd domain {dom!r}: macserve installs per-user agents, in gui/<uid> or user/<uid>"
        )
    return SESSION_TYPES[kind]


def _launchctl(*args: str) -> subprocess.CompletedProcess:
    """The one place launchctl runs."""
    exe = env.launchctl() or shutil.which("launchctl")
    if not exe:
        raise MacserveError("launchctl not found (the launchd backend needs macOS)")
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60
    )


def plist_dict(spec: ServiceSpec, dom: str) -> dict:
    """The LaunchAgent, key by key (docs/services.md explains each)."""
    log = str(spec.log)
    # launchd never rotates StandardOutPath; `macserve run` does it when told which file.
    variables = dict(sorted({**spec.env, "MACSERVE_ROTATE_LOGS": log}.items()))
    return {
        "Label": label(spec.name),
        # launchd execs this directly, no shell: `python -m macserve run NAME` execs the server
        "ProgramArguments": list(spec.argv),
        "EnvironmentVariables": variables,  # an agent's PATH is minimal: all spelled out
        "WorkingDirectory": str(spec.workdir),
        "LimitLoadToSessionType": session_type(dom),
        "RunAtLoad": True,
        # restart after a crash or a non-zero exit, not after a clean stop
        "KeepAlive": {"SuccessfulExit": False, "Crashed": True},
        "ThrottleInterval": THROTTLE_INTERVAL,
        "ExitTimeOut": EXIT_TIMEOUT,
        "ProcessType": "Interactive",  # unset means CPU and I/O throttling
        "SoftResourceLimits": {"NumberOfFiles": 4096},
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }


def render_plist(spec: ServiceSpec, dom: str | None = None) -> bytes:
    return plistlib.dumps(plist_dict(spec, dom or domain()), sort_keys=False)


_PRINT_LINE = re.compile(r"^\t([a-z][a-z ]*?) = (.*)$")  # top-level properties: one tab in


def parse_print(text: str) -> dict[str, str]:
    props: dict[str, str] = {}
    for line in text.splitlines():
        m = _PRINT_LINE.match(line)
        if m and m.group(1) not in props:
            props[m.group(1)] = m.group(2).strip()
    return props


class LaunchdBackend:
    name = "launchd"
    grace = EXIT_TIMEOUT  # seconds from SIGTERM to SIGKILL on a graceful stop

    def plist_path(self, name: str) -> Path:
        return agents_dir() / f"{label(name)}.plist"

    def installed(self, name: str) -> bool:
        return self.plist_path(name).exists()

    def unit_domain(self, name: str) -> str:
        """The domain the installed unit belongs to (its plist's session type), else where a
        new one would go."""
        try:
            with open(self.plist_path(name), "rb") as f:
                kind = DOMAINS.get(plistlib.load(f).get("LimitLoadToSessionType"))
        except (OSError, plistlib.InvalidFileException, AttributeError):
            kind = None
        here = domain()
        return f"{kind}/{os.getuid()}" if kind and not env.launchd_domain() else here

    def target(self, name: str) -> str:
        return f"{self.unit_domain(name)}/{label(name)}"

    def install(self, spec: ServiceSpec) -> bool:
        """Write the plist; True if it changed (a running job then needs a restart to see it)."""
        path = self.plist_path(spec.name)
        data = render_plist(spec)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            if path.read_bytes() == data:
                return False
        except FileNotFoundError:
            pass
        atomic_write(path, data, 0o644)
        return True

    def _print(self, target: str) -> dict[str, str] | None:
        r = _launchctl("print", target)
        return parse_print(r.stdout) if r.returncode == 0 else None

    def loaded(self, name: str) -> bool:
        return self._print(self.target(name)) is not None

    def _bootstrap(self, name: str) -> None:
        dom = self.unit_domain(name)
        target = f"{dom}/{label(name)}"
        _launchctl("enable", target)
        r = _launchctl("bootstrap", dom, str(self.plist_path(name)))
        if r.returncode != 0 and self._print(target) is None:
            raise MacserveError(f"launchctl bootstrap {dom} {label(name)} failed: {_msg(r)}")

    def _graceful_stop(self, target: str, printed: dict[str, str]) -> None:
        """SIGTERM, up to `grace` seconds for the process to go, then SIGKILL."""
        pid = _pid(printed)
        if pid is None:
            return
        _launchctl("kill", "SIGTERM", target)
        if self._gone(target, pid, self.grace):
            return
        _launchctl("kill", "SIGKILL", target)
        self._gone(target, pid, 5.0)

    def _gone(self, target: str, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            p = self._print(target)
            if p is None or _pid(p) != pid:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def _bootout(self, target: str, timeout: float = EXIT_TIMEOUT + 10) -> None:
        deadline = time.monotonic() + timeout
        r = _launchctl("bootout", target)
        while r.returncode == EINPROGRESS and time.monotonic() < deadline:
            time.sleep(0.2)  # still exiting: Homebrew retries the same way
            r = _launchctl("bootout", target)
        # bootout returns before the job has exited; wait until launchd forgets it
        while self._print(target) is not None:
            if time.monotonic() > deadline:
                raise MacserveError(f"{target} did not unload within {timeout:.0f}s")
            time.sleep(0.2)

    def _unload(self, name: str) -> None:
        """Graceful stop, then bootout, if launchd has the job."""
        target = self.target(name)
        printed = self._print(target)
        if printed is not None:
            self._graceful_stop(target, printed)
            self._bootout(target)

    def apply(self, spec: ServiceSpec) -> None:
        """(Re)start as a fresh job from the current plist: graceful stop and bootout of the
        loaded one (from the domain its old plist names), write, bootstrap."""
        self._unload(spec.name)
        self.install(spec)
        self._bootstrap(spec.name)

    def start(self, name: str) -> None:
        self._need(name)
        if self._print(self.target(name)) is None:
            self._bootstrap(name)
        else:
            r = _launchctl("kickstart", self.target(name))  # no -k: start only if not running
            if r.returncode != 0:
                raise MacserveError(f"launchctl kickstart {label(name)} failed: {_msg(r)}")

    def stop(self, name: str) -> None:
        self._need(name)
        target = self.target(name)
        self._unload(name)
        _launchctl("disable", target)

    def restart(self, name: str) -> None:
        self._need(name)
        self._unload(name)
        self._bootstrap(name)

    def uninstall(self, name: str) -> None:
        self._unload(name)
        self.plist_path(name).unlink(missing_ok=True)

    def status(self, name: str) -> Status:
        if not self.installed(name):
            return Status(name, False, "not installed")
        p = self._print(self.target(name))
        if p is None:
            return Status(name, True, "stopped", detail="not loaded")
        pid = _pid(p)
        m = re.match(r"-?\d+", p.get("last exit code", ""))  # "(never exited)" has none
        exit_code = int(m.group()) if m else None
        sig = p.get("last terminating signal") or None
        runs = int(p["runs"]) if p.get("runs", "").isdigit() else None
        st = p.get("state", "unknown")
        running = st == "running" and pid is not None
        died = not running and (exit_code is not None or sig is not None)
        if running:
            state = "running"
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
            True,
            state,
            pid=pid,
            exit_code=exit_code,
            runs=runs,
            died=died,
            signal=sig,
            detail=f"launchd state {st}",
        )

    def _need(self, name: str) -> None:
        if not self.installed(name):
            raise MacserveError(f"service {name} is not installed")


def _pid(p: dict[str, str]) -> int | None:
    return int(p["pid"]) if p.get("pid", "").isdigit() else None


def _msg(r: subprocess.CompletedProcess) -> str:
    out = (r.stderr or r.stdout).strip().splitlines()
    return f"{out[-1] if out else ''} (exit {r.returncode})".strip()
