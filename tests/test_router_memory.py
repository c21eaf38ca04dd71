"""The router's memory rules with real processes: engine profiles on the demo model, each given
its share by hand (MEMORY=, so the shares are exact), behind a router process under
supervisord.

- a budget that fits exactly two shares: both profiles driven at once (several clients each),
  the sum of their servers' peaks (services/resident.py: the process tree's VmHWM, and the
  engine's own /metrics figures where it has them, as `ls --json` reports them) within the
  budget; a third profile waits for room while both are busy, then is refused (503);
- another program holding memory (a Python child holding a few GB, sized from psutil's
  available memory at test time): a start whose share the machine no longer has free is
  refused with a message naming free memory and that process, after the idle profiles were
  stopped for it.
"""

import json
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from macserve.services.share import share
from macserve.sizing.budget import machine_budget

from .fixtures import TINY_MODEL, cli, free_port, poll, router_process, state

pytestmark = pytest.mark.e2e

SHARE = 512 * 2**20  # each profile's MEMORY=: its whole share
CLIENTS = 3  # per profile, at once
PROMPT = "Who is there? Nay, answer me: stand, and unfold yourself. " * 2


def budget_of_two(share_bytes: int) -> int:
    """RAM whose GPU budget holds two shares but not three."""
    ram = int(2.5 * share_bytes * 1.5)
    b = machine_budget(ram).budget_bytes
    assert 2 * share_bytes <= b < 3 * share_bytes, (share_bytes, b)
    return ram


def chat(url: str, name: str, out: list, max_tokens: int = 48) -> None:
    body = {
        "model": name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    out.append((name, r.status_code, r.text))


def ls_rows() -> dict:
    r = cli("ls", "--json")
    assert r.returncode == 0, r.stderr
    return {x["name"]: x for x in json.loads(r.stdout)}


def test_two_shares_fit_a_third_waits_and_another_programs_memory_refuses_a_start(
    services, macserve_home
):
    for n in ("a", "b", "c"):
        r = cli(
            "new", str(TINY_MODEL), "--provider", "macserve", "--name", n, "--ctx", "256",
            "--port", str(free_port()), "--no-start",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        r = cli("set", n, "--", f"MEMORY={SHARE}B")
        assert r.returncode == 0, r.stderr
    assert {n: share(n).share_bytes for n in "abc"} == dict.fromkeys("abc", SHARE)
    ram = budget_of_two(SHARE)
    budget = machine_budget(ram).budget_bytes
    port = free_port()
    args = ["router", "--port", str(port), "--memory", f"{ram}B", "--start-timeout", "3"]
    with router_process(macserve_home, args, port) as router:
        url = router.url
        # a and b driven at once, CLIENTS each (their cold starts admitted one at a time)
        out: list = []
        threads = [
            threading.Thread(target=chat, args=(url, n, out)) for n in "ab" for _ in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted((n, s) for n, s, _ in out) == sorted(
            [("a", 200)] * CLIENTS + [("b", 200)] * CLIENTS
        ), out
        for n in "ab":
            services.append(json.loads(cli("status", n, "--json").stdout)["services"][0]["pid"])

        # c while a and b each have a request in flight: it waits for room, then 503
        with (
            httpx.stream(
                "POST", url + "/v1/chat/completions", timeout=300,
                json={"model": "a", "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 150, "stream": True},
            ) as sa,
            httpx.stream(
                "POST", url + "/v1/chat/completions", timeout=300,
                json={"model": "b", "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 150, "stream": True},
            ) as sb,
        ):  # fmt: skip
            next(sa.iter_lines()), next(sb.iter_lines())  # both answering now
            r = httpx.post(url + "/v1/chat/completions", json={"model": "c"}, timeout=60)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "no room for model c" in msg and "held by a, b, busy or always on" in msg, msg
        assert state("c") == "not installed"

        # the peaks, as `ls --json` reports them (services/resident.py), within the budget
        rows = ls_rows()
        peaks = {n: rows[n]["peak_bytes"] for n in "ab"}
        for n in "ab":
            assert rows[n]["share_bytes"] == SHARE
            print(
                f"{n}: peak {peaks[n] / 2**20:.1f} MB of its share {SHARE / 2**20:.0f} MB "
                f"({peaks[n] / SHARE:.2f}); {rows[n]['resident']['source']}"
            )
        print(f"sum of peaks {sum(peaks.values()) / 2**20:.1f} MB, budget {budget / 2**20:.1f} MB")
        assert all(peaks.values()) and sum(peaks.values()) <= budget

    # Another program takes memory: c's share is what is free now less a margin, and a child
    # holds more than that margin. The budget is no obstacle (a Mac of 4x this RAM).
    avail = psutil.virtual_memory().available
    margin, hog = 2 * 2**30, 5 * 2**30
    big = avail - margin
    r = cli("set", "c", "--", f"MEMORY={big}B")
    assert r.returncode == 0, r.stderr
    code = f"x = b'\\x01' * {hog}; print('held', flush=True); import time; time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        port = free_port()
        ram = 4 * psutil.virtual_memory().total
        args = ["router", "--port", str(port), "--memory", f"{ram}B", "--start-timeout", "3"]
        with router_process(macserve_home, args, port) as router:
            r = httpx.post(router.url + "/v1/chat/completions", json={"model": "c"}, timeout=120)
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "insufficient_memory", msg
            assert "no room for model c on this machine: it needs its share" in msg, msg
            assert "is free now" in msg and f"(pid {child.pid})" in msg, msg
            assert "another program's memory is not handed to a model" in msg
            # a and b were idle: stopped first (their memory came back), still not enough
            log = router.log.read_text()
            assert "evicted, least recently used: c needs" in log and "free on this" in log
            poll(lambda: state("a") == state("b") == "stopped", "a and b to be stopped")
            assert state("c") == "not installed"
    finally:
        child.kill()
        child.wait(10)
