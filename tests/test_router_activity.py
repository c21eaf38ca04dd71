"""Issue 27: the router's idle clock sees clients that talk to a profile's port directly, from
the server's own /metrics (router/activity.py). A real router process, a real
engine profile and a real llama-server profile under supervisord, raw HTTP to their ports."""

import httpx
import pytest

from macserve.router.activity import reading

from .conftest import TINY_MODEL
from .fixtures import cli, free_port, poll, router_process, status


def _idle(url: str) -> dict[str, float | None]:
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m["idle_s"] for m in r.json()["data"]}


def _ask(base: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hail."}], "max_tokens": 2}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.e2e
def test_raw_http_to_a_profile_port_resets_the_idle_clock(
    llama_server, model_gguf, services, macserve_home
):
    ports = {"tiny": free_port(), "gguf": free_port()}
    for args in (
        [str(TINY_MODEL), "--provider", "macserve", "--name", "tiny", "--ctx", "256"],
        [str(model_gguf), "--name", "gguf", "--ctx", "256", "--extra-args", "-t 1 -np 1"],
    ):
        name = args[args.index("--name") + 1]
        r = cli("new", *args, "--port", str(ports[name]), "--no-start")
        assert r.returncode == 0, r.stderr
    rport = free_port()
    # TTL 5 min: nothing is stopped here; the reaper ticks every 5 s and keeps the idle clock
    args = ["router", "--port", str(rport), "--ttl", "5m", "--keep-alive", "0.5"]
    with router_process(macserve_home, args, rport) as router:
        for name in ports:  # started by the router, on a first request through it
            _ask(router.url, name)
            services.append(status(name)["pid"])
        for name, port in ports.items():
            direct = f"http://127.0.0.1:{port}"
            # both servers' own counters are readable, and move with a request to the port
            before = reading(httpx.get(direct + "/metrics", timeout=30).text)
            assert before is not None, name
            poll(lambda n=name: (_idle(router.url)[n] or 0) >= 8, f"{name} idle 8 s")
            _ask(direct, name)  # past the router: it never sees this request
            after = reading(httpx.get(direct + "/metrics", timeout=30).text)
            assert after[0] > before[0], (name, before, after)
            poll(
                lambda n=name: (_idle(router.url)[n] or 99) < 8,
                f"the router to count the raw request to {name} as a use",
                timeout=60,
            )
    for name in ports:
        cli("stop", name)


def test_reading_knows_only_servers_that_count_their_work():
    assert reading("") is None
    assert reading("not prometheus {{{") is None
    assert reading("# TYPE other_total counter\nother_total 5\n") is None
    text = (
        "# TYPE macserve_generation_tokens_total counter\n"
        "macserve_generation_tokens_total 7.0\n"
        "# TYPE macserve_sequences_in_flight gauge\n"
        "macserve_sequences_in_flight 1\n"
    )
    assert reading(text) == (7.0, True)
