"""Planned stops keep their work, end to end with real processes under a real supervisord:
a llama.cpp service restarted during a stream finishes the stream and exits within the grace
(issue 26 item 6); an engine service's prompt cache survives `restart`, `set` and a router's
TTL stop through its disk tier (issue 25 item 2); a llama.cpp slot survives `set` (issue 25
item 3). Every figure is
read from the servers' own counters (usage, timings, /health), never from timing."""

import os
import threading

import httpx
import openai
import psutil
import pytest

from .conftest import REPO, TINY_MODEL
from .fixtures import cli, free_port, poll, router_process, status

pytestmark = pytest.mark.e2e

TURN1 = [
    {
        "role": "system",
        "content": "You are the prompter of a company of players; you give the next words.",
    },
    {"role": "user", "content": "Line, sir! What comes after 'to be or not to be'?"},
]
FOLLOW = "And the next line after that?"
# The engine's turn 1: about 700 tokens, past the INT2 cache's bf16 rows (sink 64 + recent
# 512 + slack 16), so the state the disk tier keeps across a stop holds codes.
ENGINE_TURN1 = [
    {
        "role": "system",
        "content": TURN1[0]["content"]
        + " Speak the speech, I pray you, as I pronounced it to you, trippingly on the tongue."
        * 24,
    },
    TURN1[1],
]


def _client(port):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300
    )


def _ask(port, messages, n=12, model="m"):
    return _client(port).chat.completions.create(
        model=model, messages=messages, max_tokens=n, temperature=0
    )


def _turn2(r1, turn1=TURN1):
    return turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": FOLLOW},
    ]


def _supervisord_log(home) -> str:
    return (home / "supervisor" / "supervisord.log").read_text()


def _llama(name, gguf, port, services):
    r = cli("new", str(gguf), "--name", name, "--port", str(port), "--extra-args", "-t 1 -np 1")
    assert r.returncode == 0, r.stderr
    s = status(name)
    services.append(s["pid"])
    return s["pid"]


def _restart_while_generating(run_pid: int, port: int, restarter: threading.Thread) -> None:
    """Start the restart so that its stop finds the generation still running, whatever the
    machine's load. The 900 tokens take a second or two; the restart is a new process (its
    start took longer than the whole stream once, under load), so llama-server is paused
    (SIGSTOP) until the drain's first `GET /slots` is on its way: `macserve run` holds a
    connection to the server's port. Then it runs on, mid-generation, and the drain sees it."""
    server = next(c for c in psutil.Process(run_pid).children() if "llama-server" in c.name())

    def drain_asks() -> bool:
        return any(
            c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            for c in psutil.Process(run_pid).net_connections(kind="tcp")
        )

    assert not drain_asks()  # while it serves, `macserve run` holds no connection to it
    server.suspend()
    try:
        restarter.start()
        poll(drain_asks, "the drain's first look at the slots", timeout=300)
    finally:
        server.resume()


def test_llama_restart_during_a_stream_finishes_it(
    llama_server, model_gguf, services, macserve_home
):
    port = free_port()
    pid1 = _llama("tiny", model_gguf, port, services)
    log = macserve_home / "logs" / "tiny.log"
    chunks, finish, restarted = [], [], []
    stream = _client(port).chat.completions.create(
        model="m",
        messages=TURN1,
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # llama-server's: the stream runs to max_tokens
    )
    restarter = threading.Thread(target=lambda: restarted.append(cli("restart", "tiny")))
    for chunk in stream:  # a dropped connection raises here: the test fails
        chunks.append(chunk)
        if len(chunks) == 5:
            _restart_while_generating(pid1, port, restarter)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    restarter.join(600)
    assert finish == ["length"]  # the whole answer, ended by the server as a normal stream
    assert restarted[0].returncode == 0, restarted[0].stderr
    text = log.read_text()
    # the stop really came during the stream, and was held until it finished
    assert "stop: waiting for 1 generation(s) in flight" in text, text[-3000:]
    assert "stop: generations finished after" in text
    assert "SIGKILL" not in text
    # supervisord saw a clean exit within its stopwaitsecs, not its own SIGKILL
    assert "stopped: macserve-tiny (exit status 0)" in _supervisord_log(macserve_home)
    assert "terminated by SIGKILL" not in _supervisord_log(macserve_home)
    pid2 = status("tiny")["pid"]
    services.append(pid2)
    assert pid2 != pid1
    assert _ask(port, TURN1).choices[0].finish_reason in ("stop", "length")


def test_llama_slot_survives_set(llama_server, model_gguf, services, macserve_home):
    port = free_port()
    _llama("tiny", model_gguf, port, services)
    r1 = _ask(port, TURN1)
    turn1_prompt = r1.usage.prompt_tokens
    cold = _ask(port, _turn2(r1))  # reference answer; then the slot holds turn 2's prompt
    r = cli("set", "tiny", "--", "CTX=1000")  # a restart with new settings, same model and cache
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    text = (macserve_home / "logs" / "tiny.log").read_text()
    assert "saved slot 0:" in text, text[-3000:]
    poll(
        lambda: "restored slot 0:" in (macserve_home / "logs" / "tiny.log").read_text(),
        "the slot to be restored",
        timeout=120,
    )
    r2 = _client(port).chat.completions.with_raw_response.create(
        model="m", messages=_turn2(r1), max_tokens=12, temperature=0
    )
    body = r2.http_response.json()
    assert body["timings"]["cache_n"] >= turn1_prompt  # llama-server's own count of reused tokens
    assert body["choices"][0]["message"]["content"] == cold.choices[0].message.content


def _health(port) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()


def test_engine_prompt_cache_survives_restart_and_set(services, macserve_home):
    port = free_port()
    r = cli(
        "new", str(TINY_MODEL), "--provider", "macserve", "--name", "eng",
        "--port", str(port), "--timeout", "300",
        # the plain path's counts: --mtp auto's choice (timed) would move them by a token
        "--extra-args", "--mtp off",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    services.append(status("eng")["pid"])
    cache_dir = macserve_home / "state" / "eng" / "prompt-cache"
    assert _health(port)["prompt_cache"]["tiers"]["disk"]["dir"].startswith(str(cache_dir))
    r1 = _ask(port, ENGINE_TURN1)
    r = cli("restart", "eng")  # SIGTERM: drain, then the disk tier's flush
    assert r.returncode == 0, r.stderr
    services.append(status("eng")["pid"])
    r2 = _ask(port, _turn2(r1, ENGINE_TURN1))
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert _health(port)["prompt_cache"]["tiers"]["disk"]["hits"] == 1
    # cold: the disk tier off (a `set`, so a restart) and nothing in memory after it
    r = cli("set", "eng", "--", "PROMPT_CACHE_DISK=0")
    assert r.returncode == 0, r.stderr
    services.append(status("eng")["pid"])
    cold = _ask(port, _turn2(r1, ENGINE_TURN1))
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == cold.choices[0].message.content
    # warm: the two turns on one process that never stopped (memory emptied by a restart).
    # The restart in between kept all of it: as many cached tokens as without a stop
    r = cli("restart", "eng")
    assert r.returncode == 0, r.stderr
    services.append(status("eng")["pid"])
    _ask(port, ENGINE_TURN1)
    warm = _ask(port, _turn2(r1, ENGINE_TURN1)).usage.prompt_tokens_details.cached_tokens
    assert cached == warm > 0
    # and the bad value is one line, nothing written
    before = (macserve_home / "profiles" / "eng.env").read_bytes()
    r = cli("set", "eng", "--", "PROMPT_CACHE_DISK=lots")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (macserve_home / "profiles" / "eng.env").read_bytes() == before


def test_engine_prompt_cache_survives_a_router_ttl_stop(services, macserve_home):
    """Two turns through the router with the profile stopped by its TTL between them: the
    second turn gets at least the whole first prompt from the disk tier (the server's own
    usage and /metrics) and answers what a cold server answers."""
    port = free_port()
    r = cli(
        "new", str(TINY_MODEL), "--provider", "macserve", "--name", "eng",
        "--port", str(port), "--timeout", "300", "--no-start",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert cli("set", "eng", "--", "TTL=3s").returncode == 0
    rport = free_port()
    variables = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        MACSERVE_SERVICE_BACKEND="supervisor",
    )
    args = ["router", "--port", str(rport), "--ttl", "60s"]
    with router_process(macserve_home, args, rport, variables) as router:

        def stops():
            text = httpx.get(router.url + "/metrics", timeout=30).text
            line = 'macserve_router_stops_total{profile="eng",reason="ttl"}'
            return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0)

        r1 = _ask(rport, ENGINE_TURN1, model="eng")  # a cold start
        services.append(status("eng")["pid"])
        poll(lambda: stops() == 1 and status("eng")["state"] != "running", "the TTL stop", 120)
        r2 = _ask(
            rport, _turn2(r1, ENGINE_TURN1), model="eng"
        )  # a second cold start, the disk tier warm
        services.append(status("eng")["pid"])
        engine = httpx.get(router.url + "/metrics/eng", timeout=30).text  # starts nothing
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The demo profile drafts (MTP): its end-of-prompt snapshot is kept, less the last shared
    # token, whose hidden state the MTP layer needs again (prompt_cache.py).
    assert r2.model_extra["timings"]["draft_n"] > 0
    assert cached >= r1.usage.prompt_tokens - 1 > 0
    disk = [x for x in engine.splitlines() if x.startswith("macserve_prompt_cache_tokens_reused")]
    assert any('tier="disk"' in x and float(x.split()[-1]) == cached for x in disk), disk
    # cold: the disk tier off and nothing in memory (a `set` restarts a running service)
    assert cli("set", "eng", "--", "PROMPT_CACHE_DISK=0", "TTL=never").returncode == 0
    if status("eng")["state"] != "running":
        assert cli("start", "eng").returncode == 0
    services.append(status("eng")["pid"])
    cold = _ask(port, _turn2(r1, ENGINE_TURN1))
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == cold.choices[0].message.content
