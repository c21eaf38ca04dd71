"""launchd's domains: which one a unit goes to, whose units they are, and root for `system`.

Domain, as Homebrew picks it: `gui/<uid>` normally; `user/<uid>` in an SSH session when the
console belongs to someone else or nobody (a headless Mac: the gui domain does not exist and
bootstrap fails with 125). MACSERVE_LAUNCHD_DOMAIN overrides it. A profile with SYSTEM=1 is a
LaunchDaemon in the `system` domain instead, loaded at boot and run as the owner of
MACSERVE_HOME; that domain needs root, and without it the error is one line with the exact
sudo command.

The plist's `LimitLoadToSessionType` matches the domain (Aqua for gui, Background for user):
launchd refuses to load a job into a session its plist does not name (error 5/134).
`SESSION_TYPES` maps one to the other, both ways.
"""

from __future__ import annotations

import os
import pwd
import shlex
import sys

from ... import env
from ...errors import MacserveError

CONSOLE = "/dev/console"
SYSTEM = "system"  # launchd's domain for LaunchDaemons: loaded at boot, root only
# launchd's session type for each per-user domain (launchd.plist(5), LimitLoadToSessionType).
SESSION_TYPES = {"gui": "Aqua", "user": "Background"}
DOMAINS = {v: k for k, v in SESSION_TYPES.items()}


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
    """One line naming the sudo command, unless this runs as root."""
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
    uid = agent_uid()
    if env.ssh_session() and console_uid() != uid:
        return f"user/{uid}"
    return f"gui/{uid}"


def agent_uid() -> int:
    """The user whose per-user domains hold the agents: under sudo, MACSERVE_HOME's owner."""
    return owner().pw_uid if is_root() else os.getuid()


def all_domains() -> list[str]:
    """Every domain a copy of a unit may be loaded in."""
    return [f"gui/{agent_uid()}", f"user/{agent_uid()}", SYSTEM]


def session_type(dom: str) -> str:
    """The plist's LimitLoadToSessionType for a per-user domain."""
    kind = dom.split("/", 1)[0]
    if kind not in SESSION_TYPES:
        raise MacserveError(
            f"launchd domain {dom!r}: macserve installs per-user agents, in gui/<uid> or user/<uid>"
        )
    return SESSION_TYPES[kind]
