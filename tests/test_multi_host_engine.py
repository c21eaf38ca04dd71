"""macserve's own engine across two hosts, end to end on one machine: two ranks over loopback
under `mlx.launch` (ring backend, pipeline) as a supervised service, with the INT2 cache and
MTP drafting on each rank's layers. Its text must equal the one-process engine's, greedy and
sampled with a seed; a stream survives a client leaving and a restart's drain; an uneven SPLIT
moves the calibration's rotations with the layers. (Its own file, apart from
test_multi_host_service.py's mlx_lm.server cases: two workers each take one.)"""

import httpx
import psutil
import pytest

from macserve.services.supervisors.supervisord import SupervisorBackend

from .fixtures import cli, free_port, need_mlx_launch, poll, status, stream_with_stop

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "What country, friends, is this?"}]


@pytest.fixture(autouse=True)
def _mlx_launch():
    """Two ranks need mlx.launch, which comes with mlx: missing, the test fails, not skips."""
    need_mlx_launch()


def completion(port, **body) -> str:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=120,
        json={"prompt": "HAMLET.\nWho's there?\n", "max_tokens": 24, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.e2e
def test_the_engine_on_two_ranks_with_int2_and_mtp(services, macserve_home):  # noqa: F811
    """macserve's own engine under mlx.launch: rank 0 answers HTTP, both ranks generate in
    lockstep (pipeline); the INT2 cache and MTP drafting run on each rank's layers."""
    from .conftest import TINY_MODEL

    single, multi = free_port(), free_port()
    engine = [
        "--provider",
        "macserve",
        "--timeout",
        "120",
        "--extra-args",
        "--ctx 1024 --kv int2 --mtp on --mtp-k 1",  # drafting, not auto's choice by timing
    ]
    r = cli("new", str(TINY_MODEL), "--name", "one", "--port", str(single), *engine)
    assert r.returncode == 0, r.stderr
    services.append(status("one")["pid"])
    # written stopped, then made two ranks and started: a one-process start of it first would
    # only be stopped again (a set on the running group is the SPLIT one below)
    r = cli("new", str(TINY_MODEL), "--name", "two", "--port", str(multi), *engine, "--no-start")
    assert r.returncode == 0, r.stderr
    r = cli("set", "two", "--", "HOSTS=127.0.0.1,127.0.0.1")
    assert r.returncode == 0, r.stderr
    r = cli("start", "two", timeout=300)
    assert r.returncode == 0, r.stderr
    s = status("two")
    assert s["healthy"]
    services.append(s["pid"])
    group = poll(
        lambda: (lambda rs: rs if len(rs) == 2 else None)(
            [
                c
                for c in psutil.Process(s["pid"]).children(recursive=True)
                if c.cmdline()[1:4] == ["-m", "macserve", "serve"]
            ]
        ),
        "two engine ranks",
    )
    services.extend(p.pid for p in group)

    # greedy, and sampled with a seed: the same text as the one-process engine
    assert completion(multi, temperature=0) == completion(single, temperature=0)
    sampled = completion(single, temperature=1.0, seed=5)
    assert completion(multi, temperature=1.0, seed=5) == sampled
    assert sampled.strip() and len(set(sampled)) > 3  # sampling really produced text

    # a client that leaves mid-stream: every rank stops, and the next request is served
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{multi}/v1/completions",
        timeout=60,
        json={"prompt": "HAMLET.\n", "max_tokens": 900, "temperature": 1.0, "stream": True},
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 5:
                break
    assert completion(multi, temperature=1.0, seed=5) == sampled

    r = cli("chat", "two", "Who's there?")
    assert r.returncode == 0, r.stderr
    assert "draft acceptance" in r.stderr, r.stderr
    log = cli("logs", "two", "-n", "400").stdout
    assert "rank 1: loaded; following rank 0" in log

    # a restart during a stream (the default DRAIN): rank 1 keeps stepping it while rank 0
    # drains, the stream ends with a finish_reason, and the group exits 0 and comes back
    log_file = macserve_home / "logs" / "two.log"
    sv_log = macserve_home / "supervisor" / "supervisord.log"
    at, sv_at = len(log_file.read_text()), len(sv_log.read_text())
    body = {"messages": PROMPT, "max_tokens": 300, "temperature": 1.0, "seed": 5}
    sv = SupervisorBackend(macserve_home)
    seen = stream_with_stop(multi, body, lambda: sv.restart("two"), log_file)
    text = log_file.read_text()[at:]
    assert seen["chunks"] > 5 and seen["done"] and seen["finish"] in ("length", "stop"), seen
    assert seen["dropped"] is None and seen["error_event"] is None, seen
    assert "rank 1: stop: following rank 0's drain" in text, text[-3000:]
    assert "rank 1: stop: rank 0 ended" in text, text[-3000:]
    said = sv_log.read_text()[sv_at:]
    assert "stopped: macserve-two (exit status 0)" in said and "SIGKILL" not in said, said
    back = poll(
        lambda: (lambda x: x if x["healthy"] and x["pid"] != s["pid"] else None)(status("two")),
        "the group to come back healthy",
        timeout=180,
    )
    services.append(back["pid"])
    services.extend(
        c.pid
        for c in psutil.Process(back["pid"]).children(recursive=True)
        if c.cmdline()[1:4] == ["-m", "macserve", "serve"]
    )

    # an uneven split on the engine too; the calibration's rotations follow each rank's layers
    r = cli("set", "two", "--", "SPLIT=1,3", timeout=300)
    assert r.returncode == 0, r.stderr
    services.append(status("two")["pid"])
    assert completion(multi, temperature=1.0, seed=5) == sampled
    log = cli("logs", "two", "-n", "400").stdout
    assert "macserve: pipeline rank 0 of 2: layers 3-3" in log
    assert "macserve: pipeline rank 1 of 2: layers 0-2" in log

    assert cli("rm", "two").returncode == 0
    assert cli("rm", "one").returncode == 0
