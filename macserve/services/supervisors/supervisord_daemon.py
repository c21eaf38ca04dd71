"""supervisord itself: started on demand, asked whether it runs (or hangs), told to take up
changed program files, shut down; and the servers a killed one left running (orphans).

It is started daemonized, in its own session, so it outlives the CLI, and driven over XML-RPC
on its unix socket (control.py: every call with a deadline). Programs are added and removed
the way `supervisorctl update` does it: reloadConfig, then add/remove the changed groups.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import subprocess
import sys
import time
import xmlrpc.client

import psutil

from ...errors import MacserveError
from ..values import stop_wait
from .base import service_path
from .control import RPC_STOP_SLACK, RPC_TIMEOUT, Rpc
from .supervisord_files import PREFIX, Files


class Daemon:
    """The one supervisord of a MACSERVE_HOME (its folder: `files`)."""

    def __init__(self, files: Files):
        self.files = files
        self.started_now = False  # ensure_running() started supervisord (apply, restart)

    def rpc(self, deadline: float | None = None, at_least: int = 0) -> Rpc:
        """The control channel; by default with a deadline a stop of any program fits in
        (`at_least`: a stopwaitsecs supervisord still holds that is no longer on file)."""
        if deadline is None:
            waits = [stop_wait(None), at_least, *map(self.files.stop_wait, self.files.names())]
            deadline = max(waits) + RPC_STOP_SLACK
        return Rpc(self.files.sock, deadline, self.hung)

    def hung(self, deadline: float) -> str:
        """What to tell the user when supervisord did not answer within `deadline` seconds."""
        pid = self.files.daemon_pid()
        try:
            stopped = pid is not None and psutil.Process(pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:
            stopped = False
        if stopped:
            return (
                f"supervisord (pid {pid}) is stopped (SIGSTOP or Ctrl-Z): its services cannot be "
                f"controlled until it runs again: kill -CONT {pid}"
            )
        return (
            f"supervisord (pid {pid or '?'}) did not answer on {self.files.sock} within "
            f"{deadline:.0f}s: it is hung; kill {pid or 'it'} and run the command again"
        )

    def running(self) -> bool:
        pid = self.files.daemon_pid()
        if pid and _alive(pid):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    # at once: its socket still accepts connections, and nothing answers them
                    raise MacserveError(self.hung(0))
            except psutil.Error:
                pass
        sock = self.files.sock
        if not sock.exists():
            return False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(2)
            s.connect(str(sock))
        except OSError:
            return False
        finally:
            s.close()
        try:
            return self.rpc(RPC_TIMEOUT).getState()["statename"] == "RUNNING"
        except xmlrpc.client.Error:
            return False

    @contextlib.contextmanager
    def _lock(self):
        self.files.dir.mkdir(parents=True, exist_ok=True)
        with open(self.files.dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def ensure_running(self, timeout: float = 30.0) -> Rpc:
        """supervisord running with the current supervisord.conf (started if need be): its
        control channel."""
        files = self.files
        with self._lock():
            files.write_main_conf()
            if self.running():
                return self.rpc()
            with contextlib.suppress(FileNotFoundError):
                files.sock.unlink()  # stale socket from a killed daemon
            # A killed supervisord leaves its servers running, holding their ports: the new one
            # would start every program again beside them (never binding, crash-looping).
            for name in files.names():
                for proc in self.orphans(name):
                    _stop_group(proc, files.stop_wait(name))
            # supervisord forks into the background and setsid()s; the parent returns at once.
            r = subprocess.run(
                [sys.executable, "-m", "supervisor.supervisord", "-c", str(files.conf)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                cwd=files.home,
                timeout=60,
                env=daemon_env(),
            )
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).strip().splitlines()
                raise MacserveError(
                    f"supervisord did not start: {msg[-1] if msg else r.returncode}"
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.running():
                    self.started_now = True
                    return self.rpc()
                time.sleep(0.1)
            raise MacserveError(f"supervisord did not answer on {files.sock} within {timeout:.0f}s")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop supervisord and with it every service."""
        if not self.running():
            return
        pid = self.files.daemon_pid()
        with contextlib.suppress(OSError, xmlrpc.client.Error, MacserveError):
            self.rpc().shutdown()
        deadline = time.monotonic() + timeout
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def update(self, rpc: Rpc) -> tuple[list[str], list[str], list[str]]:
        """`supervisorctl update`, limited to macserve's groups: (added, changed, removed)."""
        added, changed, removed = rpc.reloadConfig()[0]
        ours = lambda gs: [g for g in gs if g.startswith(PREFIX)]  # noqa: E731
        for g in ours(removed) + ours(changed):
            with contextlib.suppress(xmlrpc.client.Fault):
                rpc.stopProcessGroup(g, True)
            rpc.removeProcessGroup(g)
        for g in ours(changed) + ours(added):
            rpc.addProcessGroup(g)  # autostart=true: starts it
        return ours(added), ours(changed), ours(removed)

    def orphans(self, name: str) -> list[psutil.Process]:
        """Servers of program `name` left running by a supervisord that died: found by the
        MACSERVE_HOME and MACSERVE_SERVICE their environment was given, whose parent is no
        live supervisord."""
        daemon = self.files.daemon_pid()
        want = {"MACSERVE_HOME": str(self.files.home), "MACSERVE_SERVICE": name}
        out = []
        for proc in psutil.process_iter(["pid", "ppid"]):
            try:
                if daemon and proc.info["ppid"] == daemon and _alive(daemon):
                    continue  # supervised
                environ = proc.environ()
            except psutil.Error:
                continue
            if all(environ.get(k) == v for k, v in want.items()):
                out.append(proc)
        return out


# What supervisord itself inherits from the shell that happens to start it: the basics of a
# login, nothing else. Its programs get their environment from their `environment=` line (the
# same set launchd gets), so a key or token in that shell never reaches a service.
_DAEMON_ENV = ("HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ")


def daemon_env() -> dict[str, str]:
    """supervisord's own environment: a login's basics and the services' PATH."""
    out = {k: os.environ[k] for k in _DAEMON_ENV if os.environ.get(k)}
    out["PATH"] = service_path()
    return out


def _stop_group(proc: psutil.Process, grace: int) -> None:
    """SIGTERM the orphan's process group (supervisord gave each program its own), then SIGKILL
    after the same grace supervisord gives."""
    try:
        pgid = os.getpgid(proc.pid)
        os.killpg(pgid, 15)
        proc.wait(grace)
    except psutil.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(pgid, 9)
    except (OSError, psutil.Error):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
