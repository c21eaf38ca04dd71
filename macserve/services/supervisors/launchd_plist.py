"""The plist of one profile: where it is installed, and what it says, key by key.

Built with plistlib (`plist_dict`, no template) into
`~/Library/LaunchAgents/dev.macserve.NAME.plist` (MACSERVE_LAUNCH_AGENTS overrides the folder,
for tests); a profile with SYSTEM=1 gets `/Library/LaunchDaemons/dev.macserve.NAME.plist`
instead (MACSERVE_LAUNCH_DAEMONS), with `UserName` the owner of MACSERVE_HOME
(launchd_domains.py). docs/services.md explains each key.
"""

from __future__ import annotations

import plistlib
import pwd
from pathlib import Path

from ... import env
from ...errors import MacserveError
from .base import ServiceSpec
from .launchd_domains import SYSTEM, domain, owner, session_type

LABEL_PREFIX = "dev.macserve."
THROTTLE_INTERVAL = (
    30  # seconds between spawns: a crash loop must not remap a huge model every 10 s
)


def label(name: str) -> str:
    return LABEL_PREFIX + name


def agents_dir() -> Path:
    return env.launch_agents()


def daemons_dir() -> Path:
    return env.launch_daemons()


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
    """The plist file's bytes, for the domain the profile's unit goes to (or `dom`)."""
    dom = dom or (SYSTEM if spec.system else domain())
    return plistlib.dumps(plist_dict(spec, dom, user), sort_keys=False)
