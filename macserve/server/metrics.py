"""`GET /metrics`: the server's counters in Prometheus' text format (prometheus_client).

Two kinds of figures. Events are counted when they happen: HTTP answers by route and status
(`CountRequests`, outermost, so a 401 or a Host refusal counts too), and per finished
generation its prompt and generated tokens, time to first token and decode speed
(`Metrics.job_done`, from the worker thread; prometheus_client's metrics are thread-safe).
State is read when scraped (`_EngineState`): queue depth, sequences in flight, the batch
size, KV bytes in use, MLX's allocator (active, peak, buffer cache) against the
--memory share and the process's baseline, the prompt cache's hits, misses, tokens reused and bytes per tier
(memory, disk), MTP drafts proposed and accepted. Reading state at scrape time keeps one
source of truth (the worker, the prompt cache) instead of a second tally that could drift.

Each server has its own registry (not prometheus_client's global one), so several apps in one
process (tests) never share or collide.
"""

from __future__ import annotations

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPS_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000)


def route_of(path: str) -> str:
    """The route label: a known path, `/v1/models/{id}`, or `other` (an unknown path must not
    make a series of its own: a scanner would grow the registry without bound)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


class Metrics:
    def __init__(self, worker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "macserve_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "macserve_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.generation_tokens = Counter(
            "macserve_generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "macserve_time_to_first_token_seconds",
            "From a request's arrival (its queue wait included) to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decode_tps = Histogram(
            "macserve_decode_tokens_per_second",
            "Each generation's tokens per second after its first",
            buckets=TPS_BUCKETS,
            registry=r,
        )
        r.register(_EngineState(worker))

    def job_done(self, queued_s: float, stats: dict | None) -> None:
        """A generation ended (served or cut); `stats` as Seq.stats / Step.stats give them."""
        if not stats:
            return
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        n = stats.get("completion_tokens", 0)
        self.generation_tokens.inc(n)
        if n > 0:
            self.ttft.observe(queued_s + stats.get("prompt_seconds", 0.0))
        if n > 1 and stats.get("generation_tps", 0) > 0:
            self.decode_tps.observe(stats["generation_tps"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineState:
    """Read at scrape time from the worker and its prompt cache."""

    def __init__(self, worker):
        self.w = worker

    def collect(self):
        w = self.w
        yield GaugeMetricFamily(
            "macserve_queue_depth", "Requests waiting for the engine", w.queued()
        )
        yield GaugeMetricFamily(
            "macserve_sequences_in_flight", "Requests taken from the queue, not done", w.in_flight()
        )
        yield GaugeMetricFamily("macserve_max_batch", "Sequences decoded together", w.max_batch)
        yield GaugeMetricFamily(
            "macserve_kv_bytes_in_use",
            "Cache bytes held by the sequences in flight (as allocated)",
            w.kv_bytes_in_use(),
        )
        sched = w.scheduler
        yield CounterMetricFamily(
            "macserve_kv_code_rows",
            "Code rows (INT2/INT4: the calibration's formats) finished sequences' caches held, "
            "over their layers; --kv auto in a share that holds the batch in bf16: none",
            sched.code_rows if sched is not None else 0,
        )
        yield from _memory(w)
        st = w.prompt_cache.stats()
        hits = CounterMetricFamily(
            "macserve_prompt_cache_hits", "Requests that reused a cached prefix", labels=["tier"]
        )
        reused = CounterMetricFamily(
            "macserve_prompt_cache_tokens_reused",
            "Prompt tokens read from the prompt cache instead of prefilled",
            labels=["tier"],
        )
        size = GaugeMetricFamily(
            "macserve_prompt_cache_bytes", "Bytes the prompt cache holds", labels=["tier"]
        )
        for tier, t in st["tiers"].items():
            hits.add_metric([tier], t["hits"])
            reused.add_metric([tier], t["cached_tokens"])
            size.add_metric([tier], t["bytes"])
        yield hits
        yield reused
        yield size
        yield CounterMetricFamily(
            "macserve_prompt_cache_misses", "Requests with no usable cached prefix", st["misses"]
        )
        yield CounterMetricFamily(
            "macserve_mtp_draft_tokens", "Tokens drafted by the MTP layer", w.draft_tokens
        )
        yield CounterMetricFamily(
            "macserve_mtp_accepted_tokens", "MTP drafts the model accepted", w.accepted_tokens
        )
        auto = w.mtp_status()
        if auto is not None:
            yield GaugeMetricFamily(
                "macserve_mtp_drafting", "--mtp auto: 1 while drafting is on", int(auto["drafting"])
            )
            if "speedup" in auto:
                yield GaugeMetricFamily(
                    "macserve_mtp_measured_speedup",
                    "--mtp auto: drafting's measured speed over plain decoding",
                    auto["speedup"],
                )


def _memory(w):
    """MLX's allocator (what the process holds beyond its baseline) and the share it is held
    to (0: no --memory)."""
    yield GaugeMetricFamily(
        "macserve_memory_active_bytes", "Bytes MLX's allocator holds now", mx.get_active_memory()
    )
    yield GaugeMetricFamily(
        "macserve_memory_peak_bytes",
        "Most bytes MLX's allocator held since start",
        mx.get_peak_memory(),
    )
    yield GaugeMetricFamily(
        "macserve_memory_cache_bytes",
        "Freed bytes MLX keeps for reuse (its buffer cache)",
        mx.get_cache_memory(),
    )
    yield GaugeMetricFamily(
        "macserve_memory_share_bytes",
        "--memory: every byte this server may hold (0: none given)",
        w.memory_share or 0,
    )
    yield GaugeMetricFamily(
        "macserve_memory_baseline_bytes",
        "The process's resident bytes before the weights",
        w.baseline_bytes,
    )


class CountRequests:
    """ASGI: count every HTTP answer by route and status, when its response has been sent
    (a stream counts at its end)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def counted(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, counted)
        finally:
            if status:
                self.metrics.requests.labels(route_of(scope["path"]), str(status[0])).inc()

    def __getattr__(self, name):
        return getattr(self.app, name)  # the app's attributes (engine) through the wrapper
