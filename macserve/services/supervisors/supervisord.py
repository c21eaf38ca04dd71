"""supervisord backend (Linux servers, CI): a real restart-on-crash supervisor from PyPI
`supervisor`, behind the `Backend` verbs (install, apply, start, stop, restart, uninstall,
status).

The files it reads are supervisord_files.py's (layout, rendering); supervisord itself, started
on demand and driven over XML-RPC, and the servers a killed one left behind, are
supervisord_daemon.py's. Here: what each verb asks of them, and supervisord's process states
read as a `Status`.
"""

from __future__ import annotations

import contextlib
import xmlrpc.client
from pathlib import Path

from ... import env
from ...errors import MacserveError
from .base import ServiceSpec, Status
from .control import RPC_TIMEOUT
from .supervisord_daemon import Daemon
from .supervisord_files import PREFIX, START_SECS, Files

_STATE = {
    "RUNNING": "running",
    "STARTING": "starting",
    "BACKOFF": "starting",
    "STOPPING": "stopping",
    "STOPPED": "stopped",
    "EXITED": "exited",
    "FATAL": "failed",
    "UNKNOWN": "unknown",
}


class SupervisorBackend:
    name = "supervisor"

    def __init__(self, home: Path | None = None):
        self.files = Files(Path(home) if home else env.home())
        self.daemon = Daemon(self.files)

    def installed(self, name: str) -> bool:
        return self.files.installed(name)

    def install(self, spec: ServiceSpec) -> bool:
        return self.files.install(spec)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop supervisord and with it every service (tests' teardown; `macserve` never needs it)."""
        self.daemon.shutdown(timeout)

    def apply(self, spec: ServiceSpec) -> None:
        before = self.files.stop_wait(
            spec.name
        )  # a lower DRAIN: the old process stops with the old
        self.install(spec)
        self.daemon.started_now = False
        self.daemon.ensure_running()
        rpc = self.daemon.rpc(at_least=before)
        added, changed, _ = self.daemon.update(rpc)
        group = PREFIX + spec.name
        if group in added or group in changed or self.daemon.started_now:
            # (re)added with the new config and started; or supervisord itself was just
            # started, with this config, and started the program (autostart=true). A stop
            # now would come within milliseconds of its spawn, where supervisord's forked
            # child, not yet exec'd, takes the SIGTERM with supervisord's own handler and
            # loses it: the program then runs on until stopwaitsecs and a SIGKILL (seen in a
            # loaded test run: 80 s, then `terminated by SIGKILL`).
            return
        self._restart(rpc, spec.name)

    def start(self, name: str) -> None:
        self._need(name)
        rpc = self.daemon.ensure_running()
        self.daemon.update(rpc)
        try:
            rpc.startProcess(PREFIX + name, False)
        except xmlrpc.client.Fault as e:
            if "ALREADY_STARTED" not in e.faultString:
                raise MacserveError(
                    f"supervisord could not start {name}: {e.faultString}"
                ) from None

    def stop(self, name: str) -> None:
        self._need(name)
        if not self.daemon.running():
            return
        rpc = self.daemon.rpc()
        try:
            rpc.stopProcess(PREFIX + name, True)
        except xmlrpc.client.Fault as e:
            if "NOT_RUNNING" not in e.faultString and "BAD_NAME" not in e.faultString:
                raise MacserveError(f"supervisord could not stop {name}: {e.faultString}") from None

    def restart(self, name: str) -> None:
        self._need(name)
        self.daemon.started_now = False
        rpc = self.daemon.ensure_running()
        added, changed, _ = self.daemon.update(rpc)
        if PREFIX + name not in added + changed and not self.daemon.started_now:  # see apply()
            self._restart(rpc, name)

    def _restart(self, rpc, name: str) -> None:
        with contextlib.suppress(xmlrpc.client.Fault):  # NOT_RUNNING is fine
            rpc.stopProcess(PREFIX + name, True)
        try:
            rpc.startProcess(PREFIX + name, False)
        except xmlrpc.client.Fault as e:
            if "ALREADY_STARTED" not in e.faultString:
                raise MacserveError(
                    f"supervisord could not start {name}: {e.faultString}"
                ) from None

    def uninstall(self, name: str) -> None:
        path = self.files.program_path(name)
        if self.daemon.running():
            self.stop(name) if path.exists() else None
            path.unlink(missing_ok=True)
            self.daemon.update(self.daemon.rpc())
        else:
            path.unlink(missing_ok=True)
        if not self.files.names():
            self.shutdown()  # the last service gone: no private supervisord left behind

    def status(self, name: str) -> Status:
        if not self.installed(name):
            return Status(name, False, "not installed")
        if not self.daemon.running():
            orphans = self.daemon.orphans(name)
            if orphans:
                return Status(
                    name,
                    True,
                    "orphaned",
                    pid=orphans[0].pid,
                    detail=(
                        "running without its supervisor (supervisord died): macserve start "
                        f"{name} stops it and starts it supervised"
                    ),
                    extra={"supervisor_down": True},
                )
            return Status(
                name,
                True,
                "stopped",
                detail="supervisord is not running",
                extra={"supervisor_down": True},  # not stopped by anyone: see wait_ready
            )
        try:
            info = self.daemon.rpc(RPC_TIMEOUT).getProcessInfo(PREFIX + name)
        except xmlrpc.client.Fault:
            return Status(name, True, "stopped", detail="not loaded into supervisord")
        state = _STATE.get(info["statename"], info["statename"].lower())
        ended = info["statename"] in ("EXITED", "FATAL", "BACKOFF")
        return Status(
            name,
            True,
            state,
            pid=info["pid"] or None,
            # supervisord records the exit status only of a process that outlived startsecs
            # (EXITED); one that died sooner (BACKOFF, then FATAL) keeps the previous value.
            exit_code=info["exitstatus"] if info["statename"] == "EXITED" else None,
            failed=info["statename"] == "FATAL",
            died=ended,
            detail=(
                f"exited within {START_SECS}s of starting"
                if info["statename"] in ("BACKOFF", "FATAL")
                else info.get("spawnerr") or info.get("description", "")
            ),
        )

    def _need(self, name: str) -> None:
        if not self.installed(name):
            raise MacserveError(f"service {name} is not installed (macserve start installs it)")
