"""What both backends share: the service spec, its status, the `Backend` interface, paths.

Supervised services: one interface, two backends.

A service runs `macserve run NAME` (which execs the profile's provider) under a real process
supervisor that restarts it after a crash but not after a clean stop:

  launchd     macOS (launchd.py): a LaunchAgent plist in ~/Library/LaunchAgents driven by
              launchctl (boot-persistent: RunAtLoad at login).
  supervisor  elsewhere (supervisord.py; Linux servers, CI): supervisord from PyPI
              `supervisor`, started on demand under $MACSERVE_HOME/supervisor, driven over
              XML-RPC on a unix socket.

The backend is picked by platform; MACSERVE_SERVICE_BACKEND=launchd|supervisor overrides it.
Both implement `Backend`, below.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from ... import env
from ..profiles import Profile, check_name
from ..values import stop_wait

# launchd hands agents a minimal PATH; spell out the usual places (Homebrew first, like
# Homebrew's own std_service_path_env), plus the directory of the Python running macserve.
SYSTEM_PATH = (
    "/opt/homebrew/bin",
    "/opt/homebrew/sbin",
    "/usr/local/bin",
    "/usr/bin",
    "/bin",
    "/usr/sbin",
    "/sbin",
)


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    workdir: Path
    system: bool = False  # the profile's SYSTEM=1: launchd installs a LaunchDaemon
    # SIGTERM -> SIGKILL, seconds: supervisord's stopwaitsecs, launchd's ExitTimeOut, both
    # from the profile's DRAIN (values.stop_wait)
    stop_wait: int = field(default_factory=lambda: stop_wait(None))


@dataclass
class Status:
    name: str
    installed: bool
    state: str  # running | starting | stopping | stopped | exited | failed | not installed
    pid: int | None = None
    exit_code: int | None = None
    runs: int | None = None  # launchd only: how many times the job was spawned
    failed: bool = False  # the supervisor gave up (supervisord FATAL)
    # The process of the current run is gone (exited, or killed: supervisord BACKOFF/EXITED/
    # FATAL; launchd: loaded, not running, with a last exit code or terminating signal). Every
    # (re)start begins a fresh run, so after one this means the new process died.
    died: bool = False
    signal: str | None = None  # launchd's "last terminating signal", e.g. "Killed: 9"
    detail: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    name: str

    def apply(self, spec: ServiceSpec) -> None:
        """Install or update the unit and (re)start it so that it runs the current profile;
        a changed unit is reloaded, not just restarted."""

    def install(self, spec: ServiceSpec) -> bool:
        """Write the unit only; True if its content changed."""

    def start(self, name: str) -> None: ...
    def stop(self, name: str) -> None: ...
    def restart(self, name: str) -> None: ...

    def uninstall(self, name: str) -> None:
        """Stop, then remove the unit."""

    def status(self, name: str) -> Status: ...
    def installed(self, name: str) -> bool: ...


def log_dir() -> Path:
    return env.log_dir()


def log_path(name: str) -> Path:
    return log_dir() / f"{check_name(name)}.log"


def service_path() -> str:
    dirs = [os.path.dirname(sys.executable)] + list(SYSTEM_PATH)
    return ":".join(dict.fromkeys(dirs))


def run_argv(name: str) -> list[str]:
    # The absolute interpreter, not a console-script shim (pyenv shims need a shell environment).
    return [sys.executable, "-m", "macserve", "run", name]


def package_root() -> Path | None:
    """The directory macserve is imported from, when that is a source checkout (editable or
    PYTHONPATH) rather than site-packages: the service must run the same code as the CLI that
    installed it, not whatever another checkout's editable install points at."""
    root = Path(__file__).resolve().parents[3]
    return None if root.name in ("site-packages", "dist-packages") else root


def spec_for(profile: Profile, provider_env: dict[str, str]) -> ServiceSpec:
    # MACSERVE_SUPERVISED: `macserve run` backs off between quick respawns only under a supervisor.
    variables = {
        "PATH": service_path(),
        "MACSERVE_HOME": str(env.home()),
        "MACSERVE_SUPERVISED": "1",
    }
    root = package_root()
    if root is not None:
        variables["PYTHONPATH"] = str(root)
    # Copied from the installing shell: the service would otherwise not find a custom
    # llama-server, Hugging Face cache or offline setting.
    variables.update(env.passthrough())
    variables.update(provider_env)
    return ServiceSpec(
        profile.name,
        run_argv(profile.name),
        variables,
        log_path(profile.name),
        env.home(),
        profile.system,
        stop_wait(profile.drain),
    )
