"""The service commands, by name: what the CLI, doctor and the router call. Each lives in the
module that owns it; this module only gathers them so callers need one name.

    health.py     wait_ready (and why a service died), Outcome, SetFailed
    ports.py      port_free, pick_port: a profile's port is free and no other profile's
    create.py     new, new_worker, new_router
    edit.py       set (parse_assignments, Changes, set_values): check, save, restart, roll back
    lifecycle.py  start, stop, restart, remove; endpoint (where a client reaches a profile)
    journal.py    the change journal: changing (a set is at work), recover (a killed one)
    footprint.py  footprint: weights + cache at the profile's CTX and KV
    views.py      the rows behind ls / status / show

Flow: profiles -> providers (argv, flag check) -> supervisors (the backend) -> health wait.
"""

from __future__ import annotations

from ..errors import MacserveError
from .create import default_name, new, new_router, new_worker
from .edit import Changes, parse_assignments, set_values
from .footprint import Footprint, footprint, footprint_of
from .health import Outcome, SetFailed, StoppedDuringWait, base_url, store, wait_ready
from .journal import changing
from .lifecycle import endpoint, has_profile, remove, restart, start, stop
from .ports import DEFAULT_PORT, pick_port, port_free
from .supervisors import get_backend
from .views import row, rows, show

__all__ = [
    "DEFAULT_PORT",
    "Changes",
    "Footprint",
    "MacserveError",
    "Outcome",
    "SetFailed",
    "StoppedDuringWait",
    "base_url",
    "changing",
    "default_name",
    "endpoint",
    "footprint",
    "footprint_of",
    "get_backend",
    "has_profile",
    "new",
    "new_router",
    "new_worker",
    "parse_assignments",
    "pick_port",
    "port_free",
    "remove",
    "restart",
    "row",
    "rows",
    "set_values",
    "show",
    "start",
    "stop",
    "store",
    "wait_ready",
]
