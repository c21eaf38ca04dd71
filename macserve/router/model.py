"""What the router knows of one profile (`Model`: its state, requests in flight, last use, start
or stop under way, memory share) and the router's own settings. Mutated on the event loop only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..services import providers
from ..services.profiles import Profile
from ..services.share import Share
from .state import Machine

DEFAULT_TTL = 300.0  # seconds idle before a stop, like Ollama's keep_alive default (5 min)
DEFAULT_START_TIMEOUT = 300.0


def size(b: int | None) -> str:
    if b is None:
        return "unknown"
    return f"{b / 2**30:,.1f} GB" if b >= 2**30 else f"{b / 2**20:,.1f} MB"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    ttl: float | None = DEFAULT_TTL  # None: never (--ttl never)
    memory_bytes: int | None = None  # plan for a Mac with this much RAM (tests); None: this one
    keep_alive: float = 10.0  # hold a streaming request this long, then keep-alives this often
    # Chat completions' keep-alives carry a visible "loading NAME, 12 s" (keepalive.py).
    loading_note: bool = True
    start_timeout: float = DEFAULT_START_TIMEOUT
    api_key: str | None = None
    # Bound to loopback: the Host names answered besides the loopback ones (DNS rebinding).
    allowed_hosts: tuple[str, ...] = ()
    # No api_key: forward to profiles with their own key anyway (anyone reaching it uses it).
    allow_unauthenticated: bool = False


class Model(Machine):
    """One profile in the router: its state (state.py: `state`, `transition`) and what the
    supervisor cannot tell (mutated on the event loop only)."""

    def __init__(self, profile: Profile, api_key: str | None, stamp: tuple):
        super().__init__(profile.name)
        self.inflight = 0  # requests waiting for it or being answered by it
        self.last_used = 0.0  # ops.clock() at the end of its last request; 0: never
        self.start_task: asyncio.Task | None = None
        self.stop_task: asyncio.Task | None = None
        self.ready_pid: int | None = None  # the process last seen ready
        self.admitted = False  # counted in the budget, its start under way
        self.seen = "stopped"  # the supervisor's state (Status.state), as last read
        self.error: str | None = None  # why the last start failed
        self.share: Share | None = None
        self.update(profile, api_key, stamp)

    def update(self, profile: Profile, api_key: str | None, stamp: tuple) -> None:
        self.profile, self.api_key, self.stamp = profile, api_key, stamp
        self.share = None  # the context, model or MEMORY may have changed

    @property
    def provider(self):
        return providers.for_profile(self.profile)

    def ttl(self, default: float | None) -> float | None:
        """Seconds of idleness before a stop; None: never (TTL=never)."""
        if self.profile.always_on:
            return None
        return self.profile.ttl if self.profile.ttl is not None else default

    def idle(self, now: float) -> float | None:
        return None if not self.last_used or self.inflight else now - self.last_used


def mtime(p) -> int | None:
    try:
        return p.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def clear_task(m: Model, attr: str, task: asyncio.Task) -> None:
    if getattr(m, attr) is task:
        setattr(m, attr, None)
    if not task.cancelled():
        task.exception()  # retrieved: every waiter got it; no "never retrieved" warning
