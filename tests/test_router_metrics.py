"""The router's Prometheus /metrics with real processes: a router (its own process) in front of
the demo model on macserve's engine under supervisord. The text parses with prometheus_client's
parser; the key is required as on every route but /health; cold starts, their seconds and a
TTL stop move the counters; /metrics/{profile} passes the engine's own /metrics through and
never starts a stopped profile."""

import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import REPO
from .fixtures import TINY_MODEL, cli, free_port, poll, router_process

pytestmark = pytest.mark.e2e

KEY = "sk-router-metrics-3"
AUTH = {"authorization": f"Bearer {KEY}"}


def scrape(url: str, path="/metrics") -> dict:
    """(sample name, sorted labels) -> value, from the text format as Prometheus parses it."""
    r = httpx.get(url + path, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hail."}], "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text


def test_router_metrics_move_with_cold_starts_and_ttl_stops(services, macserve_home):
    r = cli(
        "new", str(TINY_MODEL), "--provider", "macserve", "--name", "tiny", "--ctx", "256",
        "--port", str(free_port()), "--no-start",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert cli("set", "tiny", "--", "TTL=2s").returncode == 0
    port = free_port()
    variables = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        MACSERVE_SERVICE_BACKEND="supervisor",
        MACSERVE_API_KEY=KEY,
    )
    args = ["router", "--port", str(port), "--ttl", "60s"]
    with router_process(macserve_home, args, port, variables) as router:
        url = router.url
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401
        assert httpx.get(url + "/metrics/tiny", timeout=30).status_code == 401
        before = scrape(url)
        assert value(before, "macserve_router_profile_state", profile="tiny", state="stopped") == 1
        assert value(before, "macserve_router_cold_starts_total", profile="tiny") == 0
        # a scrape of a stopped profile does not start it
        r = httpx.get(url + "/metrics/tiny", headers=AUTH, timeout=30)
        assert r.status_code == 503, r.text
        assert value(scrape(url), "macserve_router_cold_starts_total", profile="tiny") == 0

        chat(url)  # cold start
        s = scrape(url)
        assert value(s, "macserve_router_cold_starts_total", profile="tiny") == 1
        assert value(s, "macserve_router_cold_start_seconds_count", profile="tiny") == 1
        assert value(s, "macserve_router_cold_start_seconds_sum", profile="tiny") > 0
        assert value(s, "macserve_router_profile_state", profile="tiny", state="running") == 1

        # the engine's own counters, passed through: its request counter moves with ours
        engine = scrape(url, "/metrics/tiny")
        answered = sum(
            v for (n, lab), v in engine.items() if n == "macserve_requests_total"
            and dict(lab).get("route") == "/v1/chat/completions"
        )  # fmt: skip
        assert answered == 1

        chat(url)  # warm: no second cold start
        assert value(scrape(url), "macserve_router_cold_starts_total", profile="tiny") == 1

        def ttl_stopped():
            s = scrape(url)
            return value(s, "macserve_router_stops_total", profile="tiny", reason="ttl") == 1 and (
                value(s, "macserve_router_profile_state", profile="tiny", state="stopped") == 1
            )

        poll(ttl_stopped, "the TTL stop to be counted", timeout=120)
        chat(url)  # a second cold start after the TTL stop
        s = scrape(url)
        assert value(s, "macserve_router_cold_starts_total", profile="tiny") == 2
        assert value(s, "macserve_router_stops_total", profile="tiny", reason="evicted") == 0
