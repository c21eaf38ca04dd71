"""The profile values that need more than a type: provider names, durations (TTL, the router's
--ttl) and secrets (API_KEY, HF_TOKEN), each checked once where it enters."""

from __future__ import annotations

import math
import re

from ..errors import MacserveError

# The PROVIDER values a profile may name, and those of servers of no model (a profile of one
# has no MODEL). A profile is parsed before any provider is loaded, and the providers read
# profiles, so the two facts a profile's parsing needs are here, below both; everything else
# about a provider is its own (services/providers). The registry there checks, on import, that
# it and these two agree (a provider added to one and not the other fails at once).
PROVIDER_NAMES = ("llama.cpp", "mlx", "macserve", "llama.cpp-rpc", "router")
MODELLESS = ("llama.cpp-rpc", "router")

SECRET_KEYS = ("API_KEY", "HF_TOKEN")
# DRAIN: how long a planned stop waits for the generations in flight (`macserve run`'s drain
# of llama-server, graceful.py). A minute: most answers finish within it on a Mac, and a
# `set` or `restart` of a busy service is not held for longer than that.
DEFAULT_DRAIN = 60.0
MAX_DRAIN = 3600.0
# After the drain: saving llama-server's slots and its exit (graceful.EXIT_SECS, 8 s), or the
# engine's disk-tier flush (up to 5 s after its own 10 s grace). The supervisor's SIGKILL
# comes only after drain + this (supervisord's stopwaitsecs, launchd's ExitTimeOut).
STOP_MARGIN = 20


def drain_secs(drain: float | None) -> float:
    return DEFAULT_DRAIN if drain is None else drain


def stop_wait(drain: float | None) -> int:
    """Seconds from the supervisor's SIGTERM to its SIGKILL for a profile with this DRAIN:
    one figure for both supervisors, so neither kills before `macserve run`'s drain ends."""
    return math.ceil(drain_secs(drain)) + STOP_MARGIN


_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(s|m|h)?")


def parse_duration(text: str, what: str = "duration") -> float:
    """'90', '90s', '10m', '1h' -> seconds (> 0)."""
    m = _DURATION_RE.fullmatch(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise MacserveError(
            f"bad {what} {text!r}: expected seconds or a duration like 90s, 10m, 1h"
            + (" (or never)" if what == "TTL" else "")
        )
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def check_secret(key: str, value: str) -> None:
    if key not in SECRET_KEYS:
        raise MacserveError(f"unknown secret {key} (known: {', '.join(SECRET_KEYS)})")
    at = next((i for i, c in enumerate(value) if not "!" <= c <= "~"), None)
    if not value:
        raise MacserveError(f"{key}: empty")
    if at is not None:
        # An HTTP header carries ASCII only: a key with any other character could never be
        # sent by a client, so the server would be locked for everyone. (The character itself
        # is not shown: a secret is never echoed, not even in part.)
        raise MacserveError(
            f"{key}: expected printable ASCII without spaces (character {at + 1} is not)"
        )
