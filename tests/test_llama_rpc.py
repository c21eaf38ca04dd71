"""llama.cpp across Macs: `BACKEND=rpc`, `HOSTS=worker:port` -> llama-server `--rpc`.

End to end on one machine: a real rpc-server on loopback is the worker, the head is the
supervised llama-server service; greedy output through the worker equals the one-host output.
"""

import os
import socket
import subprocess
import time

import httpx
import pytest

from macserve.errors import MacserveError
from macserve.profiles import parse
from macserve.providers.llama_cpp import RPC_PORT, find_rpc_server, rpc_workers

from .test_services_e2e import cli, free_port, model_gguf, poll, services, status  # noqa: F401


def profile(extra=""):
    return parse(f"PROVIDER=llama.cpp\nMODEL=/m.gguf\nPORT=8080\n{extra}", "x")


def test_hosts_become_rpc_workers_with_the_default_port():
    p = profile("HOSTS=studio2,10.0.0.3:50100\nBACKEND=rpc\n")
    assert rpc_workers(p) == [("studio2", RPC_PORT), ("10.0.0.3", 50100)]
    assert rpc_workers(profile("HOSTS=studio2\n")) == [("studio2", RPC_PORT)]  # rpc is the default
    assert rpc_workers(profile()) == []


@pytest.mark.parametrize("extra, message", [
    ("HOSTS=a\nBACKEND=ring\n", "BACKEND=ring does not apply to llama.cpp; use rpc"),
    ("HOSTS=~/hosts.json\nBACKEND=rpc\n", "no hostfile"),
])
def test_what_llama_cpp_cannot_do_is_refused(extra, message):
    with pytest.raises(MacserveError, match=message):
        rpc_workers(profile(extra))


def rpc_server_binary(llama_server, monkeypatch) -> str:
    monkeypatch.setenv("MACSERVE_LLAMA_SERVER", llama_server)
    try:
        return find_rpc_server()
    except MacserveError:
        if os.environ.get("CI"):
            pytest.fail("CI must provide rpc-server beside llama-server (scripts/build-llama-server.sh)")
        pytest.skip("no rpc-server beside llama-server")


def completion(port) -> list[int]:
    r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120, json={
        "prompt": "HAMLET.\nWho's there?\n", "n_predict": 32, "temperature": 0,
        "return_tokens": True, "cache_prompt": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_a_worker_over_rpc_serves_the_same_greedy_output(llama_server, model_gguf, services,
                                                         macserve_home, tmp_path, monkeypatch):
    port, wport, dead = free_port(), free_port(), free_port()
    log = open(tmp_path / "rpc-server.log", "w")
    worker = subprocess.Popen([rpc_server_binary(llama_server, monkeypatch), "-H", "127.0.0.1", "-p", str(wport)],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        poll(lambda: _accepts(wport), "rpc-server to listen", timeout=30)
        r = cli("new", str(model_gguf), "--name", "tiny", "--port", str(port),
                "--extra-args", "-t 1 -np 1")
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
            "-p PORT` there first"]
        assert prof.read_bytes() == before

        r = cli("set", "tiny", "--", f"HOSTS=127.0.0.1:{wport}", "BACKEND=rpc")
        assert r.returncode == 0, r.stderr
        assert "restarted, healthy" in r.stdout
        s = status("tiny")
        services.append(s["pid"])
        assert f"--rpc 127.0.0.1:{wport}" in " ".join(_cmdline(s["pid"]))
        assert completion(port) == one_host
        log.flush()
        assert "accepted client connection" in (tmp_path / "rpc-server.log").read_text().lower()
        assert cli("rm", "tiny").returncode == 0
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        log.close()


def _accepts(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        time.sleep(0.1)
        return False


def _cmdline(pid) -> list[str]:
    import psutil

    return psutil.Process(pid).cmdline()
