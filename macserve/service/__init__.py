"""Supervised services: one interface, two backends.

A service runs `macserve run NAME` (which execs the profile's provider) under a real process
supervisor that restarts it after a crash but not after a clean stop:

  launchd     macOS: a LaunchAgent plist in ~/Library/LaunchAgents driven by launchctl
              (boot-persistent: RunAtLoad at login).
  supervisor  elsewhere (Linux servers, CI): supervisord from PyPI `supervisor`, started on
              demand under $MACSERVE_HOME/supervisor, driven over XML-RPC on a unix socket.

The backend is picked by platform; MACSERVE_SERVICE_BACKEND=launchd|supervisor overrides it.

Backend interface (both modules implement it):
    apply(spec) -> None        install or update the unit and (re)start it so that it runs the
                               current profile; a changed unit is reloaded, not just restarted
    install(spec) -> bool      write the unit only; True if its content changed
    start(name), stop(name), restart(name)
    uninstall(name)            stop, then remove the unit
    status(name) -> Status
    installed(name) -> bool
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import MacserveError
from ..profiles import Profile, check_name, macserve_home

# Variables copied from the installing shell into the service environment: the service would
# otherwise not find a custom llama-server, Hugging Face cache or offline setting.
PASSTHROUGH_ENV = ("MACSERVE_LLAMA_SERVER", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
                   "HF_ENDPOINT", "LD_PRELOAD", "LD_LIBRARY_PATH")

# launchd hands agents a minimal PATH; spell out the usual places (Homebrew first, like
# Homebrew's own std_service_path_env), plus the directory of the Python running macserve.
SYSTEM_PATH = ("/opt/homebrew/bin", "/opt/homebrew/sbin", "/usr/local/bin", "/usr/bin", "/bin",
               "/usr/sbin", "/sbin")


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    workdir: Path


@dataclass
class Status:
    name: str
    installed: bool
    state: str  # running | starting | stopping | stopped | exited | failed | not installed
    pid: int | None = None
    exit_code: int | None = None
    runs: int | None = None  # launchd only: how many times the job was spawned
    failed: bool = False  # the supervisor gave up (supervisord FATAL)
    detail: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def log_dir() -> Path:
    return Path(os.environ.get("MACSERVE_LOG_DIR") or macserve_home() / "logs")


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
    root = Path(__file__).resolve().parents[2]
    return None if root.name in ("site-packages", "dist-packages") else root


def spec_for(profile: Profile, provider_env: dict[str, str]) -> ServiceSpec:
    env = {"PATH": service_path(), "MACSERVE_HOME": str(macserve_home())}
    root = package_root()
    if root is not None:
        env["PYTHONPATH"] = str(root)
    for k in PASSTHROUGH_ENV:
        if os.environ.get(k):
            env[k] = os.environ[k]
    if os.environ.get("MACSERVE_LOG_DIR"):
        env["MACSERVE_LOG_DIR"] = os.environ["MACSERVE_LOG_DIR"]
    env.update(provider_env)
    return ServiceSpec(profile.name, run_argv(profile.name), env, log_path(profile.name),
                       macserve_home())


def backend_name() -> str:
    name = os.environ.get("MACSERVE_SERVICE_BACKEND") or ("launchd" if sys.platform == "darwin" else "supervisor")
    if name not in ("launchd", "supervisor"):
        raise MacserveError(f"MACSERVE_SERVICE_BACKEND={name}: expected launchd or supervisor")
    return name


def get_backend():
    if backend_name() == "launchd":
        from .launchd import LaunchdBackend

        return LaunchdBackend()
    from .supervisor import SupervisorBackend

    return SupervisorBackend()
