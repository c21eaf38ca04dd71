"""When a profile was last used outside the router: `$MACSERVE_HOME/run/used/NAME`, its mtime.

`macserve chat` to a profile's own port, `start` and `restart` touch it; the router reads it
before it stops a profile as idle, so any use through macserve resets the idle clock, not only
requests through the router. Raw HTTP to a profile's port is seen from the server's own
`/metrics` instead (router/activity.py).
"""

from __future__ import annotations

import contextlib
import os

from .. import env


def _path(name: str):
    return env.home() / "run" / "used" / name


def touch(name: str) -> None:
    p = _path(name)
    with contextlib.suppress(OSError):  # a mark that cannot be written only shortens the idle
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
        os.utime(p)


def last(name: str) -> float | None:
    """time.time() of the last mark, or None."""
    try:
        return _path(name).stat().st_mtime
    except OSError:
        return None
