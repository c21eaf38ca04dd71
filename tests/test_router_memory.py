"""The router's memory rules with real processes: engine profiles on the demo model, each given
its share by hand (MEMORY=, so the shares are exact; the engine is started with --memory of it),
under supervisord, behind a router process.

- a budget that fits exactly two shares: a and b (TTL=never: never stopped to make room)
  driven at once through the router (several clients each), the sum of their servers' peaks
  (services/resident.py: the process tree's VmHWM, and the engine's own /metrics figures, the
  larger, as `ls --json` reports them) within the budget; a third profile waits for room,
  then is refused (503);
- another program holding memory (a Python child holding 5 GB) and a fourth profile whose
  share is the free memory measured before it, less 2 GB: its start is refused at once with a
  message naming free memory, the shares the router's profiles hold, and that child's pid.
"""

import json
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from macserve.services.profiles import Profile, ProfileStore
from macserve.services.share import share
from macserve.sizing.budget import machine_budget

from .fixtures import TINY_MODEL, cli, free_port, router_process, state

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


def start_both(names) -> None:
    """`macserve start` of each at once (the router adopts what runs)."""
    out: list = []
    ts = [threading.Thread(target=lambda n=n: out.append(cli("start", n))) for n in names]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(r.returncode == 0 for r in out), [r.stderr for r in out]


def test_two_shares_fit_a_third_waits_and_another_programs_memory_refuses_a_start(
    services, macserve_home
):
    for n in ("a", "b", "c", "d"):
        # what `new` writes for the demo model, with the share by hand; a and b always on:
        # never stopped to make room, so a third must wait for them
        values = {
            "PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": str(free_port()),
            "CTX": "256", "KV": "int2", "EXTRA_ARGS": "--mtp-k 1", "MEMORY": f"{SHARE}B",
            # given: derived from MEMORY it passes the engine's --max-batch cap of 256
            "PARALLEL": "4",
        }  # fmt: skip
        if n in "ab":
            values["TTL"] = "never"
        ProfileStore().save(Profile(n, values))
    assert {n: share(n).share_bytes for n in "abc"} == dict.fromkeys("abc", SHARE)
    ram = budget_of_two(SHARE)
    budget = machine_budget(ram).budget_bytes
    start_both("ab")  # started beside the router: its short --start-timeout is for c's wait
    services.extend(ls_rows()[n]["pid"] for n in "ab")
    port = free_port()
    args = ["router", "--port", str(port), "--memory", f"{ram}B", "--start-timeout", "2"]
    with router_process(macserve_home, args, port) as router:
        url = router.url
        # a and b driven at once through the router, CLIENTS each
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

        # c does not fit beside them and neither may be stopped: it waits, then 503
        r = httpx.post(url + "/v1/chat/completions", json={"model": "c"}, timeout=60)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "no room for model c" in msg and "held by a, b, busy or always on" in msg, msg
        assert "c waits for room: a, b busy" in router.log.read_text()
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

    # Another program takes memory: d's share is what is free now less a margin, and a child
    # holds more than that margin. The budget is no obstacle (a Mac of 4x this RAM).
    avail = psutil.virtual_memory().available
    margin, hog = 2 * 2**30, 5 * 2**30
    r = cli("set", "d", "--", f"MEMORY={avail - margin}B", "PARALLEL=4")
    assert r.returncode == 0, r.stderr
    code = f"x = b'\\x01' * {hog}; print('held', flush=True); import time; time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        port = free_port()
        ram = 4 * psutil.virtual_memory().total
        args = ["router", "--port", str(port), "--memory", f"{ram}B"]
        with router_process(macserve_home, args, port) as router:
            r = httpx.post(router.url + "/v1/chat/completions", json={"model": "d"}, timeout=120)
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            print(msg)
            assert r.json()["error"]["code"] == "insufficient_memory", msg
            assert "no room for model d on this machine: it needs its share" in msg, msg
            assert "is free now" in msg and f"(pid {child.pid})" in msg, msg
            assert f"shares of a {SHARE / 2**20:.1f} MB, b" in msg, msg
            assert "another program's memory is not handed to a model" in msg
            assert state("d") == "not installed"
    finally:
        child.kill()
        child.wait(10)
