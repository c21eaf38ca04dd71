"""Work a profile's server did past the router, read from the server's own `/metrics`.

A client that talks to a profile's port directly (an IDE plug-in given the port, a script)
leaves no mark in the router, so the idle clock used to stop a server in the middle of such
use. The reaper now reads, on each tick, the counters the server keeps of its own work (tokens
read and generated) and whether it is busy; when they moved since the last tick, or it is
busy now, the profile was used. `macserve serve` and llama-server (run with `--metrics` by
macserve) both count; mlx_lm.server has no `/metrics`, so for it only requests through the
router, `chat` and `start` reset the clock (docs/router.md says so).

Reading is best effort: a server that does not answer within `TIMEOUT` gives no reading that
tick (the clock goes on as before), so a hung server is still stopped after its TTL.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..services import providers

# Counters that move with every request's work, and gauges that are non-zero while one runs.
WORK = (
    "macserve_prompt_tokens",
    "macserve_generation_tokens",
    "llamacpp:prompt_tokens",
    "llamacpp:tokens_predicted",
)
BUSY = (
    "macserve_sequences_in_flight",
    "macserve_queue_depth",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
)
TIMEOUT = 3.0


def reading(text: str) -> tuple[float, bool] | None:
    """(work done so far, busy now) from Prometheus text; None when it has none of our
    counters (not a server we know how to read)."""
    work, busy, known = 0.0, False, False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for fam in families:
        # the parser drops a counter's `_total` suffix from the family name
        if fam.name in WORK:
            known = True
            work += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name in BUSY:
            known = True
            busy = busy or any(s.value > 0 for s in fam.samples)
    return (work, busy) if known else None


class Activity:
    """The last reading per profile; `used(name, url, key)` says whether it moved."""

    def __init__(self):
        self.last: dict[str, float] = {}

    async def moved(self, up: list, models) -> list[bool]:
        """For each running Model in `up`: used past the router since the last tick? Every
        other one is forgotten (a server started again counts from zero)."""
        for m in models:
            if m not in up:
                self.forget(m.name)
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(
                *(self.used(client, m.name, providers.base_url(m.profile), m.api_key) for m in up)
            )

    def forget(self, name: str) -> None:
        """A stopped server starts its counters from zero: the next reading is a baseline."""
        self.last.pop(name, None)

    async def used(self, client: httpx.AsyncClient, name: str, url: str, key: str | None) -> bool:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            r = await client.get(url + "/metrics", headers=headers, timeout=TIMEOUT)
        except httpx.HTTPError:
            return False
        got = reading(r.text) if r.status_code == 200 else None
        if got is None:
            return False
        work, busy = got
        before = self.last.get(name)
        self.last[name] = work
        return busy or (before is not None and work != before)
