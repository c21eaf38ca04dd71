"""Serving across several hosts, end to end on one machine: the `mlx` provider with HOSTS runs
mlx_lm.server under `mlx.launch` (ring backend, two ranks over loopback, pipeline sharding) as
a supervised service. Greedy output must equal the single-process service's token for token,
and a rank killed with SIGKILL must bring the whole group back healthy.
"""

import os
import re
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from .conftest import REPO
from .fixtures import cli, free_port, need_mlx_launch, poll, status


@pytest.fixture(autouse=True)
def _mlx_launch():
    """Two ranks need mlx.launch, which comes with mlx: missing, each test fails, not skips."""
    need_mlx_launch()


PROMPT = [{"role": "user", "content": "What country, friends, is this?"}]


def greedy(port) -> list[tuple[int, float]]:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        timeout=120,
        json={
            "messages": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
        },
    )
    assert r.status_code == 200, r.text
    return [(t["id"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]


def ranks(pid) -> list[psutil.Process]:
    """The mlx_lm.server processes under the supervised mlx.launch: each runs mlx-lm's server
    under the drain shim (through the SPLIT shim with a SPLIT), in-process."""
    return [
        c
        for c in psutil.Process(pid).children(recursive=True)
        if "macserve.services.providers.mlx_drain" in c.cmdline()
    ]


@pytest.mark.e2e
def test_two_ranks_pipeline_service(tiny_mlx_f32, services, macserve_home):  # noqa: F811
    single, multi = free_port(), free_port()
    r = cli(
        "new",
        str(tiny_mlx_f32),
        "--provider",
        "mlx",
        "--name",
        "one",
        "--port",
        str(single),
        "--timeout",
        "120",
    )
    assert r.returncode == 0, r.stderr
    services.append(status("one")["pid"])
    want = greedy(single)
    assert len(want) == 16

    r = cli(
        "new",
        str(tiny_mlx_f32),
        "--provider",
        "mlx",
        "--name",
        "two",
        "--port",
        str(multi),
        "--timeout",
        "120",
        "--no-start",  # a one-process start would only be stopped again by the HOSTS set
    )
    assert r.returncode == 0, r.stderr
    # a bad multi-host edit is refused in one line, nothing written
    before = (macserve_home / "profiles" / "two.env").read_bytes()
    r = cli("set", "two", "--", "HOSTS=127.0.0.1:5000,127.0.0.1")
    assert r.returncode != 0 and "mlx takes no port" in r.stderr.strip().splitlines()[-1]
    assert (macserve_home / "profiles" / "two.env").read_bytes() == before
    r = cli("set", "two", "--", "HOSTS=127.0.0.1,127.0.0.1", "BACKEND=ring", "SHARDING=pipeline")
    assert r.returncode == 0, r.stderr
    text = (macserve_home / "profiles" / "two.env").read_text()
    assert "HOSTS=127.0.0.1,127.0.0.1" in text and "SHARDING=pipeline" in text
    r = cli("start", "two", timeout=300)  # a set on the running group: SPLIT, below
    assert r.returncode == 0, r.stderr
    s = status("two")
    assert s["healthy"] and s["port"] == multi
    services.append(s["pid"])
    # the supervised process runs mlx.launch; under it one mlx_lm.server per host, pipelined
    cmd = psutil.Process(s["pid"]).cmdline()
    assert cmd[1:3] == ["-m", "macserve.services.providers.mlx_launch"] and cmd[3].endswith(
        "mlx.launch"
    )
    assert "--pipeline" in cmd
    group = poll(lambda: (lambda rs: rs if len(rs) == 2 else None)(ranks(s["pid"])), "two ranks")
    services.extend(p.pid for p in group)

    got = greedy(multi)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got, want))

    r = cli("chat", "two", "Who's there?")
    assert r.returncode == 0, r.stderr
    assert r.stdout and " tokens, " in r.stderr  # the tiny model's chat reply is newlines

    # kill -9 one rank: mlx.launch takes the group down, the supervisor starts it again
    rank1 = next(
        p for p in group if "MLX_RANK=1" in open(f"/proc/{p.pid}/environ").read().split("\0")
    )
    os.kill(rank1.pid, signal.SIGKILL)
    poll(
        lambda: (
            not psutil.pid_exists(s["pid"])
            or psutil.Process(s["pid"]).status() == psutil.STATUS_ZOMBIE
        ),
        "mlx.launch to exit after a rank died",
        timeout=60,
    )
    back = poll(
        lambda: (lambda x: x if x["healthy"] and x["pid"] != s["pid"] else None)(status("two")),
        "the service to come back healthy",
        timeout=180,
    )
    services.append(back["pid"])
    services.extend(p.pid for p in poll(lambda: ranks(back["pid"]) or None, "new ranks"))
    assert [t for t, _ in greedy(multi)] == [t for t, _ in want]

    # an uneven split (hosts of different memory): 3 layers on rank 0, 1 on rank 1
    r = cli("set", "two", "--", "SPLIT=3,2")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "error: SPLIT 3,2 sums to 5; the model has 4 layers"
    r = cli("set", "two", "--", "SPLIT=3,1", timeout=300)
    assert r.returncode == 0, r.stderr
    uneven = status("two")
    services.append(uneven["pid"])
    group = poll(
        lambda: (lambda rs: rs if len(rs) == 2 else None)(ranks(uneven["pid"])), "two ranks"
    )
    services.extend(p.pid for p in group)
    assert [t for t, _ in greedy(multi)] == [t for t, _ in want]
    log = cli("logs", "two", "-n", "400").stdout
    assert "macserve: pipeline rank 0 of 2: layers 1-3" in log
    assert "macserve: pipeline rank 1 of 2: layers 0-0" in log

    assert cli("rm", "two").returncode == 0
    assert cli("rm", "one").returncode == 0

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def gone():
        return not [p for p in group if alive(p)]

    poll(gone, "the ranks to exit after rm", timeout=30)


# ---- the command line and the one-line errors, without starting anything ----------------------

from macserve.errors import MacserveError  # noqa: E402
from macserve.services.profiles import parse  # noqa: E402
from macserve.services.providers import mlx_lm  # noqa: E402

BASE = "PROVIDER=mlx\nMODEL=/m\nPORT=8080\n"


def test_argv_wraps_mlx_launch():
    argv = mlx_lm.PROVIDER.argv(parse(BASE + "HOSTS=10.0.0.1,10.0.0.2\nBACKEND=jaccl\n", "x"))
    assert argv[1:3] == ["-m", "macserve.services.providers.mlx_launch"] and argv[3].endswith(
        "mlx.launch"
    )
    i = argv.index("--")
    assert argv[4:i] == [
        "--backend",
        "jaccl",
        "--hosts",
        "10.0.0.1,10.0.0.2",
        "--starting-port",
        "8081",
        "--python",
        argv[i - 1],
    ]
    assert argv[i + 1 :] == [
        "-m",
        mlx_lm.DRAIN_SHIM,
        "x",
        "60",
        "--model",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
        "--pipeline",
    ]
    tensor = mlx_lm.PROVIDER.argv(parse(BASE + "HOSTS=/etc/hosts.json\nSHARDING=tensor\n", "x"))
    assert "--pipeline" not in tensor and tensor[4:8] == [
        "--backend",
        "ring",
        "--hostfile",
        "/etc/hosts.json",
    ]
    # SPLIT: mlx-lm's server under the split shim, under the drain shim, same arguments
    split = mlx_lm.PROVIDER.argv(
        parse(BASE + "HOSTS=10.0.0.1,10.0.0.2\nSPLIT=41,20\nDRAIN=5\n", "x")
    )
    i = split.index("--")
    assert split[i + 1 :] == [
        "-m",
        mlx_lm.DRAIN_SHIM,
        "x",
        "5",
        "-m",
        "macserve.engine.pipeline",
        "41,20",
        "--model",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
        "--pipeline",
    ]
    # no HOSTS: the single-process server, under the drain shim (not under mlx.launch)
    assert mlx_lm.PROVIDER.argv(parse(BASE, "x"))[1:5] == ["-m", mlx_lm.DRAIN_SHIM, "x", "60"]


@pytest.mark.parametrize(
    "extra, msg",
    [
        ("SHARDING=rows\n", "unknown SHARDING 'rows' (known: pipeline, tensor)"),
        ("SPLIT=4\n", "bad SPLIT '4': expected layer counts n1,n2,..."),
        ("SPLIT=3,0\n", "bad SPLIT '3,0'"),
        (
            "HOSTS=a/b,c\n",
            None,
        ),  # a hostfile path: accepted by the profile, checked by the provider
    ],
)
def test_profile_keys(extra, msg):
    if msg is None:
        assert parse(BASE + extra, "x").values["HOSTS"] == "a/b,c"
    else:
        with pytest.raises(MacserveError, match=re.escape(msg)):
            parse(BASE + extra, "x")


@pytest.mark.parametrize(
    "extra, msg",
    [
        ("HOSTS=10.0.0.1:5000\n", "HOSTS entry '10.0.0.1:5000': mlx takes no port"),
        ("HOSTS=studio1,studio2\n", "HOSTS entry 'studio1': the ring backend needs IP addresses"),
        ("HOSTS=10.0.0.1\nBACKEND=rpc\n", "BACKEND=rpc does not apply to mlx"),
        ("HOSTS=/nonexistent/hosts.json\n", "HOSTS hostfile /nonexistent/hosts.json not found"),
        ("HOSTS=10.0.0.1,10.0.0.2\nSPLIT=1,2,3\n", "SPLIT has 3 entries for 2 hosts"),
        (
            "HOSTS=10.0.0.1,10.0.0.2\nSPLIT=1,2\nSHARDING=tensor\n",
            "SPLIT applies to SHARDING=pipeline only",
        ),
    ],
)
def test_check_hosts_one_line_errors(extra, msg):
    with pytest.raises(MacserveError, match=re.escape(msg)) as e:
        mlx_lm.check_hosts(parse(BASE + extra, "x"))
    assert "\n" not in str(e.value)


@pytest.mark.e2e
def test_mlx_launch_found_from_a_venv_with_the_system_packages(tmp_path):
    """A venv made with --system-site-packages imports the base interpreter's mlx, but mlx's
    scripts stay in the base interpreter's bin, which a service's PATH does not hold: the
    launcher is found where the installed mlx recorded it. (The fresh-clone sweeps of issue 31
    ran the suite in such venvs: every multi-host service failed with "mlx.launch not found".)"""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    assert not (venv / "bin" / "mlx.launch").exists()
    code = "from macserve.services.providers.mlx_lm import launcher; print(launcher())"
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    found = r.stdout.strip()
    assert os.path.basename(found) == "mlx.launch" and os.access(found, os.X_OK), found
