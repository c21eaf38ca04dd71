"""launchd backend (macOS): a LaunchAgent (or, with SYSTEM=1, a LaunchDaemon) per profile,
driven with launchctl 2 verbs behind the `Backend` verbs.

Which domain a unit goes to and who owns it: launchd_domains.py. The plist, where it goes and
what it says: launchd_plist.py. launchctl itself, and its `print` read as a Status:
launchd_ctl.py. Here: what each verb does with them.

One label, one job: the gui, user and system domains are separate namespaces, so launchd would
happily load the same label in two of them (installed over SSH, started from a GUI shell: two
servers on one port). Every load first looks for a copy in each of them (`copies`) and stops
and boots out every one it finds. An installed unit is always addressed in the domain its own
plist names, so a unit bootstrapped over SSH is found from a GUI shell, and the next restart
moves it.

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
"""

from __future__ import annotations

import os
import plistlib
import time
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write
from ..values import stop_wait
from . import launchd_ctl
from .base import ServiceSpec, Status
from .launchd_ctl import EINPROGRESS
from .launchd_domains import DOMAINS, SYSTEM, agent_uid, all_domains, domain, need_root, owner
from .launchd_plist import agents_dir, daemons_dir, label, render_plist


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
        return f"{kind}/{agent_uid()}" if kind and not env.launchd_domain() else here

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
        r = launchd_ctl.run("print", target)
        return launchd_ctl.parse_print(r.stdout) if r.returncode == 0 else None

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
        launchd_ctl.run("enable", target)
        r = launchd_ctl.run("bootstrap", dom, str(self.plist_path(name)))
        if r.returncode != 0 and self._print(target) is None:
            raise MacserveError(
                f"launchctl bootstrap {dom} {label(name)} failed: {launchd_ctl.failure(r)}"
            )

    def _graceful_stop(self, target: str, printed: dict[str, str], grace: int) -> None:
        """SIGTERM, up to `grace` seconds for the process to go, then SIGKILL."""
        pid = launchd_ctl.pid(printed)
        if pid is None:
            return
        launchd_ctl.run("kill", "SIGTERM", target)
        if self._gone(target, pid, grace):
            return
        launchd_ctl.run("kill", "SIGKILL", target)
        self._gone(target, pid, 5.0)

    def _gone(self, target: str, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            p = self._print(target)
            if p is None or launchd_ctl.pid(p) != pid:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def _bootout(self, target: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        r = launchd_ctl.run("bootout", target)
        while r.returncode == EINPROGRESS and time.monotonic() < deadline:
            time.sleep(0.2)  # still exiting: Homebrew retries the same way
            r = launchd_ctl.run("bootout", target)
        # bootout returns before the job has exited; wait until launchd forgets it
        while self._print(target) is not None:
            if r.returncode not in (0, EINPROGRESS):
                raise MacserveError(f"launchctl bootout {target} failed: {launchd_ctl.failure(r)}")
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
            r = launchd_ctl.run("kickstart", target)  # no -k: start only if not running
            if r.returncode != 0:
                raise MacserveError(
                    f"launchctl kickstart {label(name)} failed: {launchd_ctl.failure(r)}"
                )

    def stop(self, name: str) -> None:
        found = self.copies(name)
        if not found:
            self._need(name)
        self._unload(name, found=found)  # a copy whose plist is gone too (status shows it)
        if self.installed(name):
            launchd_ctl.run("disable", self.target(name))

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
            for target, props in self.copies(name).items():
                st = launchd_ctl.status(name, props, installed=False)
                st.detail = (
                    f"loaded in {target.rsplit('/', 1)[0]} although its plist is gone "
                    f"({st.detail}): macserve stop {name} unloads it"
                )
                return st
            return Status(name, False, "not installed")
        p = self._print(self.target(name))
        if p is None:
            return Status(name, True, "stopped", detail="not loaded")
        return launchd_ctl.status(name, p, installed=True)

    def _need(self, name: str) -> None:
        if not self.installed(name):
            raise MacserveError(f"service {name} is not installed")
