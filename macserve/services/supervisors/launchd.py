"""launchd backend (macOS): a per-user LaunchAgent per profile, driven with launchctl 2 verbs.

Files: the plist is rendered from the repo's `launchd/macserve.plist.template` into
`~/Library/LaunchAgents/dev.macserve.NAME.plist` (MACSERVE_LAUNCH_AGENTS overrides the folder,
for tests). The domain is `gui/<uid>` (MACSERVE_LAUNCHD_DOMAIN overrides it, e.g. `user/501`
over SSH without a GUI login).

Verbs, and why:
  start      enable + bootstrap          (a disabled job refuses to bootstrap; Homebrew does the same)
  stop       bootout, wait until gone, disable   (disable keeps it from coming back at login)
  restart    kickstart -k                if the plist is unchanged and the job is loaded;
             bootout, wait, bootstrap    if the plist changed: kickstart never re-reads it
  uninstall  bootout, wait, remove the plist
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
from xml.sax.saxutils import escape

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write
from .base import ServiceSpec, Status

LABEL_PREFIX = "dev.macserve."
THROTTLE_INTERVAL = (
    30  # seconds between spawns: a crash loop must not remap a huge model every 10 s
)
EXIT_TIMEOUT = 20  # SIGTERM -> SIGKILL on stop
NOT_FOUND = 113  # launchctl print: "could not find service"
EINPROGRESS = 36  # bootout while the job is still exiting
# The repo's launchd/ template; an installed wheel carries it as package data (a symlink here).
_REPO_TEMPLATE = Path(__file__).resolve().parents[3] / "launchd" / "macserve.plist.template"
TEMPLATE = (
    _REPO_TEMPLATE
    if _REPO_TEMPLATE.exists()
    else env.PACKAGE / "templates" / "macserve.plist.template"
)


def label(name: str) -> str:
    return LABEL_PREFIX + name


def agents_dir() -> Path:
    return env.launch_agents()


def domain() -> str:
    return env.launchd_domain() or f"gui/{os.getuid()}"


def _launchctl(*args: str) -> subprocess.CompletedProcess:
    """The one place launchctl runs."""
    exe = env.launchctl() or shutil.which("launchctl")
    if not exe:
        raise MacserveError("launchctl not found (the launchd backend needs macOS)")
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60
    )


def render_plist(spec: ServiceSpec, template: Path = TEMPLATE) -> str:
    def s(v) -> str:
        return escape(str(v))

    ind = "    "
    args = "\n".join(f"{ind}<string>{s(a)}</string>" for a in spec.argv)
    # launchd never rotates StandardOutPath; `macserve run` does it when told which file.
    envd = dict(spec.env, MACSERVE_ROTATE_LOGS=str(spec.log))
    env = "\n".join(
        f"{ind}<key>{s(k)}</key>\n{ind}<string>{s(v)}</string>" for k, v in sorted(envd.items())
    )
    out = template.read_text()
    for key, val in {
        "@LABEL@": s(label(spec.name)),
        "@PROGRAM_ARGUMENTS@": args,
        "@ENVIRONMENT@": env,
        "@WORKING_DIRECTORY@": s(spec.workdir),
        "@LOG@": s(spec.log),
        "@THROTTLE@": str(THROTTLE_INTERVAL),
        "@EXIT_TIMEOUT@": str(EXIT_TIMEOUT),
    }.items():
        out = out.replace(key, val)
    return out


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

    def plist_path(self, name: str) -> Path:
        return agents_dir() / f"{label(name)}.plist"

    def target(self, name: str) -> str:
        return f"{domain()}/{label(name)}"

    def installed(self, name: str) -> bool:
        return self.plist_path(name).exists()

    def install(self, spec: ServiceSpec) -> bool:
        path = self.plist_path(spec.name)
        text = render_plist(spec)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            if path.read_text() == text:
                return False
        except FileNotFoundError:
            pass
        _lint(text)
        atomic_write(path, text, 0o644)
        return True

    def loaded(self, name: str) -> bool:
        return _launchctl("print", self.target(name)).returncode == 0

    def _bootstrap(self, name: str) -> None:
        _launchctl("enable", self.target(name))
        r = _launchctl("bootstrap", domain(), str(self.plist_path(name)))
        if r.returncode != 0 and not self.loaded(name):
            raise MacserveError(f"launchctl bootstrap {label(name)} failed: {_msg(r)}")

    def _bootout(self, name: str, timeout: float = EXIT_TIMEOUT + 10) -> None:
        deadline = time.monotonic() + timeout
        r = _launchctl("bootout", self.target(name))
        while r.returncode == EINPROGRESS and time.monotonic() < deadline:
            time.sleep(0.2)  # still exiting: Homebrew retries the same way
            r = _launchctl("bootout", self.target(name))
        # bootout returns before the job has exited; wait until launchd forgets it
        while self.loaded(name):
            if time.monotonic() > deadline:
                raise MacserveError(f"{label(name)} did not unload within {timeout:.0f}s")
            time.sleep(0.2)

    def apply(self, spec: ServiceSpec) -> None:
        changed = self.install(spec)
        if not self.loaded(spec.name):
            self._bootstrap(spec.name)
        elif changed:
            self._bootout(spec.name)
            self._bootstrap(spec.name)
        else:
            self._kickstart(spec.name)

    def _kickstart(self, name: str) -> None:
        r = _launchctl("kickstart", "-k", self.target(name))
        if r.returncode != 0:
            raise MacserveError(f"launchctl kickstart {label(name)} failed: {_msg(r)}")

    def start(self, name: str) -> None:
        self._need(name)
        if not self.loaded(name):
            self._bootstrap(name)
        else:
            r = _launchctl("kickstart", self.target(name))  # no -k: start only if not running
            if r.returncode != 0:
                raise MacserveError(f"launchctl kickstart {label(name)} failed: {_msg(r)}")

    def stop(self, name: str) -> None:
        self._need(name)
        if self.loaded(name):
            self._bootout(name)
        _launchctl("disable", self.target(name))

    def restart(self, name: str) -> None:
        self._need(name)
        if self.loaded(name):
            self._kickstart(name)
        else:
            self._bootstrap(name)

    def uninstall(self, name: str) -> None:
        if self.loaded(name):
            self._bootout(name)
        self.plist_path(name).unlink(missing_ok=True)

    def status(self, name: str) -> Status:
        if not self.installed(name):
            return Status(name, False, "not installed")
        r = _launchctl("print", self.target(name))
        if r.returncode != 0:
            return Status(name, True, "stopped", detail="not loaded")
        p = parse_print(r.stdout)
        pid = int(p["pid"]) if p.get("pid", "").isdigit() else None
        code = p.get("last exit code", "")
        m = re.match(r"-?\d+", code)
        exit_code = int(m.group()) if m else None
        runs = int(p["runs"]) if p.get("runs", "").isdigit() else None
        st = p.get("state", "unknown")
        if st == "running" and pid:
            state = "running"
        elif exit_code:  # loaded, not running, last run failed: launchd will respawn it
            state = "exited"
        elif st in ("spawn scheduled", "waiting"):
            state = "starting"
        elif st == "not running":
            state = "stopped"
        else:
            state = st
        return Status(
            name, True, state, pid=pid, exit_code=exit_code, runs=runs, detail=f"launchd state {st}"
        )

    def _need(self, name: str) -> None:
        if not self.installed(name):
            raise MacserveError(f"service {name} is not installed")


def _lint(text: str) -> None:
    """Parse the rendered plist back before installing it: a broken plist never reaches launchd
    (bootstrap would only say "5: Input/output error")."""
    try:
        plistlib.loads(text.encode())
    except Exception as e:  # plistlib raises several types
        raise MacserveError(f"rendered plist is invalid: {e}") from None


def _msg(r: subprocess.CompletedProcess) -> str:
    out = (r.stderr or r.stdout).strip().splitlines()
    return f"{out[-1] if out else ''} (exit {r.returncode})".strip()
