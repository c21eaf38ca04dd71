"""The router's `GET /metrics`: Prometheus text format (prometheus_client), behind the API key
like every route but /health.

Events are counted when the pool does them: cold starts (a profile the router started itself)
and their seconds, failed starts, stops by why (`ttl` idle past its TTL, `evicted` for another
profile's room, `over_budget` trimmed at a tick). State is read at scrape time from the pool
(`_PoolState`): each profile's state as one 1-valued series per profile, and its requests in
flight; one source of truth, no second tally to drift.

`GET /metrics/{profile}` passes a profile's own server's /metrics through (llama-server runs
with `--metrics`, macserve's engine always has it); a scrape never starts a stopped profile.

The router's own registry (not prometheus_client's global one): several apps in one process
(tests) never share it. Written for the router (services never imports server/metrics.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STOP_REASONS = ("ttl", "evicted", "over_budget", "other")
STATES = ("stopped", "starting", "running", "stopping")
START_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


class RouterMetrics:
    def __init__(self, pool):
        self.registry = r = CollectorRegistry()
        self.cold_starts = Counter(
            "macserve_router_cold_starts",
            "Profiles the router started for a request",
            ["profile"],
            registry=r,
        )
        self.start_failures = Counter(
            "macserve_router_start_failures",
            "Starts that ended without a ready server",
            ["profile"],
            registry=r,
        )
        self.cold_start_seconds = Histogram(
            "macserve_router_cold_start_seconds",
            "From the router's start call to the server answering its health check",
            ["profile"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.stops = Counter(
            "macserve_router_stops",
            "Profiles the router stopped, by why (ttl, evicted, over_budget)",
            ["profile", "reason"],
            registry=r,
        )
        r.register(_PoolState(pool))

    def started(self, name: str, seconds: float) -> None:
        self.cold_starts.labels(name).inc()
        self.cold_start_seconds.labels(name).observe(seconds)

    def failed(self, name: str) -> None:
        self.start_failures.labels(name).inc()

    def stopped(self, name: str, reason: str) -> None:
        self.stops.labels(name, reason if reason in STOP_REASONS else "other").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolState:
    """Read at scrape time, on the event loop (the pool's models are mutated only there)."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        state = GaugeMetricFamily(
            "macserve_router_profile_state",
            "1 for the state each profile is in (the router's view)",
            labels=["profile", "state"],
        )
        inflight = GaugeMetricFamily(
            "macserve_router_profile_inflight",
            "Requests waiting for or being answered by each profile",
            labels=["profile"],
        )
        for name, m in sorted(self.pool.models.items()):
            now = self.pool.state_of(m)
            for s in STATES:
                state.add_metric([name, s], 1.0 if s == now else 0.0)
            inflight.add_metric([name], float(m.inflight))
        yield state
        yield inflight
