"""The plists checked in under the repository's `launchd/` folder: what macserve installs for
the demo profile (`profiles/tiny-mla.env`) and for the router, so a Mac user can read the unit
before installing one: as LaunchAgents in `launchd/`, and with SYSTEM=1 as LaunchDaemons in
`launchd/LaunchDaemons/`. `macserve dev launchd-plists` writes them; with `--check` it fails when
the files differ from what the code renders (tests/test_launchd.py runs the same check).

They are rendered by the installer's own path, `spec_for` then `launchd_plist.render_plist`, with the
machine's paths swapped for fixed placeholders after `spec_for` (the home, the interpreter, the
checkout), so the files are byte-identical wherever they are generated. Variables copied from
the installing shell (env.PASSTHROUGH, env.SERVICE_SETTINGS) are left out for the same reason.
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import replace
from pathlib import Path

from ... import env
from ...fileio import atomic_write
from .. import providers
from ..profiles import Profile, parse
from ..providers.router import DEFAULT_PORT as ROUTER_PORT
from .base import SYSTEM_PATH, ServiceSpec, spec_for
from .launchd_domains import SYSTEM
from .launchd_plist import label, render_plist

# A user "you" on a Mac, macserve checked out in ~/macserve with a venv inside it.
USER_HOME = "/Users/you"
MACSERVE_HOME = f"{USER_HOME}/.config/macserve"  # env.home()'s default
REPO = f"{USER_HOME}/macserve"
PYTHON = f"{REPO}/.venv/bin/python3"
# The gui domain of the first user on a Mac; only its session type (Aqua) reaches the plist.
DOMAIN = "gui/501"
# A LaunchDaemon's UserName (MACSERVE_HOME's owner), as macOS makes the first user.


def user() -> pwd.struct_passwd:
    """The Mac user the daemon plists run as. Made on each use: a struct_passwd kept in a
    module global until the interpreter exits made CPython 3.11 print "Exception ignored in
    tp_clear ... SystemError: Objects/longobject.c:575" at the exit of every `macserve dev`
    command (which imports this module)."""
    return pwd.struct_passwd(("you", "*", 501, 20, "You", USER_HOME, "/bin/zsh"))


DAEMONS = "LaunchDaemons"  # launchd/'s subfolder for the SYSTEM=1 form
DEMO_PROFILE = "tiny-mla"
ROUTER_PROFILE = "router"
FROM_SHELL = frozenset(env.PASSTHROUGH) | frozenset(env.SERVICE_SETTINGS)


def profiles(repo: Path) -> list[Profile]:
    """The demo profile as checked in, and the router as `macserve router --install` writes it
    (its default name and port, no options)."""
    demo = parse((repo / "profiles" / f"{DEMO_PROFILE}.env").read_text(), DEMO_PROFILE)
    router = Profile(
        ROUTER_PROFILE, {"PROVIDER": "router", "HOST": "127.0.0.1", "PORT": str(ROUTER_PORT)}
    )
    return [demo, router]


def placeholder_spec(spec: ServiceSpec) -> ServiceSpec:
    """`spec` with this machine's paths replaced by the placeholders above."""
    here = os.path.dirname(sys.executable)
    variables = {k: v for k, v in spec.env.items() if k not in FROM_SHELL}
    # spec_for's PATH is the interpreter's folder, then SYSTEM_PATH without that folder
    rest = variables["PATH"].split(":")[1:]
    if here in SYSTEM_PATH:  # e.g. /usr/bin/python3: put it back in its own place
        rest.insert(SYSTEM_PATH.index(here), here)
    variables["PATH"] = ":".join([os.path.dirname(PYTHON), *rest])
    variables["MACSERVE_HOME"] = MACSERVE_HOME
    # spec_for sets PYTHONPATH when macserve runs from a checkout, as a developer's does.
    variables["PYTHONPATH"] = REPO
    argv = [PYTHON if a == sys.executable else a for a in spec.argv]
    log = Path(MACSERVE_HOME) / "logs" / spec.log.name
    return replace(spec, argv=argv, env=variables, log=log, workdir=Path(MACSERVE_HOME))


def render(repo: Path) -> dict[str, bytes]:
    """Path under launchd/ -> the plist macserve would install, with placeholders: the agent,
    and the LaunchDaemon the same profile gets with SYSTEM=1."""
    out = {}
    for p in profiles(repo):
        spec = placeholder_spec(spec_for(p, providers.for_profile(p).env(p)))
        out[f"{label(p.name)}.plist"] = render_plist(spec, DOMAIN)
        daemon = replace(spec, system=True)
        out[f"{DAEMONS}/{label(p.name)}.plist"] = render_plist(daemon, SYSTEM, user())
    return out


def stale(repo: Path) -> list[str]:
    """The files under launchd/ that differ from `render` (changed, missing, or a plist the
    code no longer makes)."""
    want = render(repo)
    folder = repo / "launchd"
    have = {p.relative_to(folder).as_posix() for p in folder.rglob("*.plist")}
    bad = [n for n, data in want.items() if not _same(folder / n, data)]
    return sorted(bad + [n for n in have if n not in want])


def write(repo: Path) -> list[str]:
    """Rewrite launchd/'s plists from `render`; the names of the files that changed."""
    changed = stale(repo)
    folder = repo / "launchd"
    want = render(repo)
    for n in changed:
        if n in want:
            (folder / n).parent.mkdir(exist_ok=True)
            atomic_write(folder / n, want[n], 0o644)
        else:
            (folder / n).unlink()
    return changed


def _same(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False
