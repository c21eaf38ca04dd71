"""What the pool asks of the world, as one injected value (`PoolOps`): the profiles, the
supervisor's view and its stop, the services' start (checks, unit, health wait), the
footprints inspect counts, the marks of use past the router, and the clocks.

`PoolOps.real()` builds them from the services wing, in this one place; the pool's unit tests
(tests/test_pool.py) pass fakes, so admission, eviction, TTL and crash handling run in
milliseconds without a process (as ollama's scheduler takes its collaborators as fields).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from ..services import health, journal, lifecycle, share, usage
from ..services.health import Outcome
from ..services.profiles import Profile, ProfileStore
from ..services.share import Share
from ..services.supervisors import Status, get_backend
from .activity import Activity


@dataclass(frozen=True)
class PoolOps:
    profiles: Callable[[], ProfileStore]  # the profile files (read on every refresh)
    status: Callable[[str], Status]  # the supervisor's view of one profile: the truth of what runs
    # The services' start and restart (name, timeout=...): the same checks, unit and health
    # wait as `macserve start`; MacserveError with the server's own line when it fails.
    start: Callable[..., Outcome]
    restart: Callable[..., Outcome]
    # The supervisor's stop (no drain: the router stops only idle servers, or on request).
    stop: Callable[[str], None]
    # (profile, timeout) -> (ready, why not): a server its supervisor runs, waited for.
    wait_ready: Callable[[Profile, float], tuple[bool, str]]
    footprint: Callable[[str], Share]  # its memory share (services/share.py)
    changing: Callable[[str], bool]  # a `macserve set` is at work on it: leave it be
    last_use: Callable[[str], float | None]  # wall time of a use past the router (chat, start)
    # (running models, all models) -> for each running one: clients used its port directly?
    moved: Callable[[list, Iterable], Awaitable[list[bool]]]
    clock: Callable[[], float] = time.monotonic  # last use, idle time, the start deadline
    wall: Callable[[], float] = time.time  # to compare with last_use and publish to `ls`

    @classmethod
    def real(cls) -> PoolOps:
        backend = get_backend()
        return cls(
            profiles=health.store,
            status=backend.status,
            start=lifecycle.start,
            restart=lifecycle.restart,
            stop=backend.stop,
            wait_ready=health.wait_ready,
            footprint=share.share,
            changing=journal.changing,
            last_use=usage.last,
            moved=Activity().moved,
        )
