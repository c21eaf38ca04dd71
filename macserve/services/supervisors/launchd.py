"""launchd backend (macOS): a LaunchAgent (or, with SYSTEM=1, a LaunchDaemon) per profile,
driven with launchctl 2 verbs.

Files: the plist is built with plistlib (`plist_dict`, no template) into
`~/Library/LaunchAgents/dev.macserve.NAME.plist` (MACSERVE_LAUNCH_AGENTS overrides the folder,
for tests); a profile with SYSTEM=1 gets `/Library/LaunchDaemons/dev.macserve.NAME.plist`
instead (MACSERVE_LAUNCH_DAEMONS), loaded into the `system` domain at boot with `UserName` the
owner of MACSERVE_HOME, so a headless Mac serves before anyone logs in. The system domain needs
root: without it, the error is one line with the exact sudo command.

Domain, as Homebrew picks it: `gui/<uid>` normally; `user/<uid>` in an SSH session when the
console belongs to someone else or nobody (a headless Mac: the gui domain does not exist and
bootstrap fails with 125). MACSERVE_LAUNCHD_DOMAIN overrides it. The plist's
`LimitLoadToSessionType` matches the domain (Aqua for gui, Background for user): launchd refuses
to load a job into a session its plist does not name (error 5/134). An installed unit is always
addressed in the domain its own plist names, so a unit bootstrapped over SSH is found from a
GUI shell, and the next restart moves it.

One label, one job: the gui, user and system domains are separate namespaces, so launchd would
happily load the same label in two of them (installed over SSH, started from a GUI shell: two
servers on one port). Every load first looks for a copy in each of them (`copies`) and stops
and boots out every one it finds.

Verbs, and why:
  start      boot out copies in other domains; enable + bootstrap (a disabled job refuses to
             bootstrap; Homebrew does the same), or kickstart if already loaded where it belongs
  restart    graceful stop, bootout, write the plist, enable + bootstrap: always a fresh job, so
             launchd runs the plist as it is now (kickstart never rereads it) and its run
             record ("last exit code", "last terminating signal") belongs to the new process
  graceful   kill SIGTERM, wait up to the plist's ExitTimeOut for the process to go, then kill
             SIGKILL (not `kickstart -k`, which SIGKILLs at once and drops in-flight requests).
             ExitTimeOut is the profile's DRAIN + values.STOP_MARGIN, as supervisord's
             stopwaitsecs: `macserve run`'s drain always ends before anyone's SIGKILL
  stop       graceful stop, bootout, wait until gone, disable (disable keeps it from coming back
             at login)
  uninstall  graceful stop, bootout, remove the plist
  status     print  (113 = not loaded; the text is for humans, so parse it defensively)

Every launchctl call goes through `_launchctl`, which runs MACSERVE_LAUNCHCTL or `launchctl`
from PATH (tests substitute a recording stand-in there) with a timeout: a hung launchd is one
line, not a traceback.
"""

from __future__ import annotations

import os
import plistlib
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write
from ..values import stop_wait
from .base import ServiceSpec, Status

LABEL_PREFIX = "dev.macserve."
THROTTLE_INTERVAL = (
    30  # seconds between spawns: a crash loop must not remap a huge model every 10 s
)
NOT_FOUND = 113  # launchctl print: "could not find service"
EINPROGRESS = 36  # bootout while the job is still exiting
CONSOLE = "/dev/console"
SYSTEM = "system"  # launchd's domain for LaunchDaemons: loaded at boot, root only
LAUNCHCTL_TIMEOUT = 60.0  # seconds; launchctl normally answers in milliseconds
# launchctl verbs that change a domain: in `system` only root may run them
WRITES = ("bootstrap", "bootout", "enable", "disable", "kill", "kickstart")
# launchd's session type for each per-user domain (launchd.plist(5), LimitLoadToSessionType).
SESSION_TYPES = {"gui": "Aqua", "user": "Background"}
DOMAINS = {v: k for k, v in SESSION_TYPES.items()}


def label(name: str) -> str:
    return LABEL_PREFIX + name


def agents_dir() -> Path:
    return env.launch_agents()


def daemons_dir() -> Path:
    return env.launch_daemons()


def is_root() -> bool:
    return os.geteuid() == 0


def owner() -> pwd.struct_passwd:
    """Whose profiles these are: the owner of MACSERVE_HOME (under sudo, not root)."""
    home = env.home()
    try:
        uid = home.stat().st_uid
    except OSError:
        uid = os.getuid()
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        raise MacserveError(f"{home} belongs to uid {uid}, which has no user name") from None


def sudo_command() -> str:
    """The command being run again as root, MACSERVE_HOME spelled out (sudo may reset HOME)."""
    args = ["sudo", f"MACSERVE_HOME={env.home()}", sys.executable, "-m", "macserve"]
    return shlex.join([*args, *sys.argv[1:]])


def need_root(what: str) -> None:
    if not is_root():
        raise MacserveError(
            f"{what}: launchd's system domain (a LaunchDaemon, SYSTEM=1) needs root; run: "
            + sudo_command()
        )


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
    uid = _uid()
    if env.ssh_session() and console_uid() != uid:
        return f"user/{uid}"
    return f"gui/{uid}"


def _uid() -> int:
    """The user whose per-user domains hold the agents: under sudo, MACSERVE_HOME's owner."""
    return owner().pw_uid if is_root() else os.getuid()


def all_domains() -> list[str]:
    """Every domain a copy of a unit may be loaded in."""
    return [f"gui/{_uid()}", f"user/{_uid()}", SYSTEM]


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


def plist_dict(spec: ServiceSpec, dom: str, user: pwd.struct_passwd | None = None) -> dict:
    """The LaunchAgent (or, in the system domain, the LaunchDaemon run as `user`), key by key
    (docs/services.md explains each)."""
    log = str(spec.log)
    # launchd never rotates StandardOutPath; `macserve run` does it when told which file.
    variables = {**spec.env, "MACSERVE_ROTATE_LOGS": log}
    if dom == SYSTEM:
        user = user or owner()
        if user.pw_uid == 0:
            raise MacserveError(
                f"{env.home()} belongs to root: a LaunchDaemon runs as MACSERVE_HOME's owner, "
                "and macserve will not run a model server as root"
            )
        # a daemon gets no login environment: the Hugging Face cache and ~ are the user's
        variables["HOME"] = user.pw_dir
    d = {
        "Label": label(spec.name),
        # launchd execs this directly, no shell: `python -m macserve run NAME` execs the server
        "ProgramArguments": list(spec.argv),
        "EnvironmentVariables": dict(sorted(variables.items())),  # a job's PATH is minimal
        "WorkingDirectory": str(spec.workdir),
    }
    if dom == SYSTEM:
        d["UserName"] = (user or owner()).pw_name  # launchd starts it as root, then this user
    else:
        d["LimitLoadToSessionType"] = session_type(dom)
    return d | {
        "RunAtLoad": True,
        # restart after a crash or a non-zero exit, not after a clean stop
        "KeepAlive": {"SuccessfulExit": False, "Crashed": True},
        "ThrottleInterval": THROTTLE_INTERVAL,
        # SIGTERM -> SIGKILL: launchd's on bootout, ours on a graceful stop (`grace`)
        "ExitTimeOut": spec.stop_wait,
        "ProcessType": "Interactive",  # unset means CPU and I/O throttling
        "SoftResourceLimits": {"NumberOfFiles": 4096},
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }


def render_plist(
    spec: ServiceSpec, dom: str | None = None, user: pwd.struct_passwd | None = None
) -> bytes:
    dom = dom or (SYSTEM if spec.system else domain())
    return plistlib.dumps(plist_dict(spec, dom, user), sort_keys=False)


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

    def grace(self, name: str) -> int:
        """Seconds from SIGTERM to SIGKILL on a graceful stop: the installed plist's
        ExitTimeOut (what launchd itself gives on a bootout)."""
        try:
            with open(self.plist_path(name), "rb") as f:
                t = plistlib.load(f).get("ExitTimeOut")
        except (OSError, plistlib.InvalidFileException, AttributeError):
            t = None
        return t if isinstance(t, int) and t > 0 else stop_wait(None)

    def agent_path(self, name: str) -> Path:
        return agents_dir() / f"{label(name)}.plist"

    def daemon_path(self, name: str) -> Path:
        return daemons_dir() / f"{label(name)}.plist"

    def plist_path(self, name: str) -> Path:
        """The installed plist: the LaunchDaemon's if there is one, else the agent's."""
        daemon = self.daemon_path(name)
        return daemon if daemon.exists() else self.agent_path(name)

    def installed(self, name: str) -> bool:
        return self.plist_path(name).exists()

    def unit_domain(self, name: str) -> str:
        """The domain the installed unit belongs to (system for a LaunchDaemon, else its
        plist's session type), else where a new agent would go."""
        if self.daemon_path(name).exists():
            return SYSTEM
        try:
            with open(self.agent_path(name), "rb") as f:
                kind = DOMAINS.get(plistlib.load(f).get("LimitLoadToSessionType"))
        except (OSError, plistlib.InvalidFileException, AttributeError):
            kind = None
        here = domain()
        return f"{kind}/{_uid()}" if kind and not env.launchd_domain() else here

    def target(self, name: str) -> str:
        return f"{self.unit_domain(name)}/{label(name)}"

    def install(self, spec: ServiceSpec) -> bool:
        """Write the plist; True if it changed (a running job then needs a restart to see it).
        The other form's plist (agent <-> daemon, SYSTEM changed) is removed."""
        path, other = self.agent_path(spec.name), self.daemon_path(spec.name)
        if spec.system:
            path, other = other, path
            need_root(f"installing {path}")
        elif other.exists():
            need_root(f"removing {other}")
        data = render_plist(spec)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        if spec.system:
            # launchd opens the log as root; the server (its owner) must be able to rotate it
            user = owner()
            spec.log.touch()
            for p in (spec.log.parent, spec.log):
                os.chown(p, user.pw_uid, user.pw_gid)
        other.unlink(missing_ok=True)
        try:
            if path.read_bytes() == data:
                return False
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        # launchd refuses a LaunchDaemon that is not root's (atomic_write as root: it is)
        atomic_write(path, data, 0o644)
        return True

    def _print(self, target: str) -> dict[str, str] | None:
        r = _launchctl("print", target)
        return parse_print(r.stdout) if r.returncode == 0 else None

    def copies(self, name: str) -> dict[str, dict[str, str]]:
        """target -> `print` properties, for every domain that has the label loaded."""
        found = {}
        for dom in all_domains():
            target = f"{dom}/{label(name)}"
            p = self._print(target)
            if p is not None:
                found[target] = p
        return found

    def loaded(self, name: str) -> bool:
        return self._print(self.target(name)) is not None

    def _bootstrap(self, name: str) -> None:
        dom = self.unit_domain(name)
        target = f"{dom}/{label(name)}"
        _launchctl("enable", target)
        r = _launchctl("bootstrap", dom, str(self.plist_path(name)))
        if r.returncode != 0 and self._print(target) is None:
            raise MacserveError(f"launchctl bootstrap {dom} {label(name)} failed: {_msg(r)}")

    def _graceful_stop(self, target: str, printed: dict[str, str], grace: int) -> None:
        """SIGTERM, up to `grace` seconds for the process to go, then SIGKILL."""
        pid = _pid(printed)
        if pid is None:
            return
        _launchctl("kill", "SIGTERM", target)
        if self._gone(target, pid, grace):
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

    def _bootout(self, target: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        r = _launchctl("bootout", target)
        while r.returncode == EINPROGRESS and time.monotonic() < deadline:
            time.sleep(0.2)  # still exiting: Homebrew retries the same way
            r = _launchctl("bootout", target)
        # bootout returns before the job has exited; wait until launchd forgets it
        while self._print(target) is not None:
            if r.returncode not in (0, EINPROGRESS):
                raise MacserveError(f"launchctl bootout {target} failed: {_msg(r)}")
            if time.monotonic() > deadline:
                raise MacserveError(f"{target} did not unload within {timeout:.0f}s")
            time.sleep(0.2)

    def _unload(self, name: str, keep: str | None = None, found: dict | None = None) -> None:
        """Graceful stop, then bootout, of every loaded copy (any domain) but `keep`."""
        grace = self.grace(name)
        for target, printed in (self.copies(name) if found is None else found).items():
            if target != keep:
                self._graceful_stop(target, printed, grace)
                self._bootout(target, grace + 10)

    def apply(self, spec: ServiceSpec) -> None:
        """(Re)start as a fresh job from the current plist: graceful stop and bootout of every
        loaded copy, write, bootstrap."""
        self._unload(spec.name)
        self.install(spec)
        self._bootstrap(spec.name)

    def start(self, name: str) -> None:
        self._need(name)
        target = self.target(name)
        found = self.copies(name)
        self._unload(name, target, found)  # a copy in another domain would be a second server
        if target not in found:
            self._bootstrap(name)
        else:
            r = _launchctl("kickstart", target)  # no -k: start only if not running
            if r.returncode != 0:
                raise MacserveError(f"launchctl kickstart {label(name)} failed: {_msg(r)}")

    def stop(self, name: str) -> None:
        found = self.copies(name)
        if not found:
            self._need(name)
        self._unload(name, found=found)  # a copy whose plist is gone too (status shows it)
        if self.installed(name):
            _launchctl("disable", self.target(name))

    def restart(self, name: str) -> None:
        self._need(name)
        self._unload(name)
        self._bootstrap(name)

    def uninstall(self, name: str) -> None:
        if self.daemon_path(name).exists():
            need_root(f"removing {self.daemon_path(name)}")
        self._unload(name)
        self.daemon_path(name).unlink(missing_ok=True)
        self.agent_path(name).unlink(missing_ok=True)

    def status(self, name: str) -> Status:
        """What `launchctl print` says of the job, nothing of our own: its state, pid, runs,
        last exit code and terminating signal. A job loaded although its plist is gone
        (removed by hand) is reported as launchd runs it, not as `not installed`."""
        if not self.installed(name):
            for target, text in self.copies(name).items():
                st = _from_print(name, text, installed=False)
                st.detail = (
                    f"loaded in {target.rsplit('/', 1)[0]} although its plist is gone "
                    f"({st.detail}): macserve stop {name} unloads it"
                )
                return st
            return Status(name, False, "not installed")
        p = self._print(self.target(name))
        if p is None:
            return Status(name, True, "stopped", detail="not loaded")
        return _from_print(name, p, installed=True)

    def _need(self, name: str) -> None:
        if not self.installed(name):
            raise MacserveError(f"service {name} is not installed")


def _from_print(name: str, p: dict[str, str], installed: bool) -> Status:
    """`launchctl print`'s fields as a Status. `crash-loop`: loaded, not running, its last
    run failed (a non-zero exit code or a terminating signal) and launchd has already
    respawned it at least once (`runs` counts the spawns of this job: every macserve (re)start
    is a fresh bootstrap, at 1), so KeepAlive will spawn it again after ThrottleInterval."""
    pid = _pid(p)
    m = re.match(r"-?\d+", p.get("last exit code", ""))  # "(never exited)" has none
    exit_code = int(m.group()) if m else None
    sig = p.get("last terminating signal") or None
    runs = int(p["runs"]) if p.get("runs", "").isdigit() else None
    st = p.get("state", "unknown")
    running = st == "running" and pid is not None
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
        pid=pid,
        exit_code=exit_code,
        runs=runs,
        died=died,
        signal=sig,
        detail=f"launchd state {st}"
        + (f", runs {runs}" if runs else "")
        + (f", last exit code {exit_code}" if exit_code is not None else "")
        + (f", last terminating signal {sig}" if sig else ""),
    )


def _pid(p: dict[str, str]) -> int | None:
    return int(p["pid"]) if p.get("pid", "").isdigit() else None


def _msg(r: subprocess.CompletedProcess) -> str:
    out = (r.stderr or r.stdout).strip().splitlines()
    return f"{out[-1] if out else ''} (exit {r.returncode})".strip()
