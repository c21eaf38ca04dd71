"""Pre-flight for multi-host mlx profiles, against a stand-in for ssh: a real program (set as
MACSERVE_SSH) that runs the remote command locally with `sh -c`, exits 255 for the hosts listed
in FAKE_SSH_DOWN (as ssh does for an unreachable host) and merges FAKE_SSH_OVERRIDE[host] into
the remote command's JSON (to make one host report other versions, no model, less memory).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from macserve.errors import MacserveError
from macserve.services import preflight, providers
from macserve.services.profiles import parse

from .conftest import REPO, TINY_MODEL

STAND_IN = f"""#!{sys.executable}
import json, os, subprocess, sys
args = sys.argv[1:]
while args and args[0] == "-o":
    args = args[2:]
host, cmd = args[0], " ".join(args[1:])
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if host in os.environ.get("FAKE_SSH_DOWN", "").split(","):
    sys.stderr.write(f"ssh: connect to host {{host}} port 22: Operation timed out\\n")
    sys.exit(255)
r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
sys.stderr.write(r.stderr)
out, over = r.stdout, json.loads(os.environ.get("FAKE_SSH_OVERRIDE", "{{}}")).get(host)
if over and r.returncode == 0:
    d = json.loads(out)
    d.update(over)
    out = json.dumps(d) + "\\n"
sys.stdout.write(out)
sys.exit(r.returncode)
"""


@pytest.fixture
def ssh(tmp_path, monkeypatch):
    p = tmp_path / "fake-ssh"
    p.write_text(STAND_IN)
    p.chmod(0o755)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("MACSERVE_SSH", str(p))
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.delenv("FAKE_SSH_DOWN", raising=False)
    monkeypatch.delenv("FAKE_SSH_OVERRIDE", raising=False)
    return log


def profile(hosts="127.0.0.1,10.0.0.2,10.0.0.3", model=TINY_MODEL, extra=""):
    return parse(f"PROVIDER=mlx\nMODEL={model}\nPORT=8080\nHOSTS={hosts}\n{extra}", "x")


def override(monkeypatch, **hosts):
    monkeypatch.setenv(
        "FAKE_SSH_OVERRIDE", json.dumps({h.replace("_", "."): v for h, v in hosts.items()})
    )


def one_line(p) -> str:
    """The one-line refusal of a start: pre-flight as the provider's check_args runs it."""
    with pytest.raises(MacserveError) as e:
        preflight.check(p, providers.for_profile(p).macserve_on_hosts(p))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_all_good(ssh):
    p = profile()
    r = preflight.run(p)
    assert r.ok and r.error() is None
    local, h2, h3 = r.hosts
    assert local.local and local.facts is None
    here = preflight.head_versions()
    for h in (h2, h3):
        assert {k: h.facts[k] for k in ("python", "mlx", "mlx_lm")} == here
        assert h.facts["model"] is True and h.facts["memory_bytes"] > 0
        assert h.need_bytes and h.budget_bytes and h.need_bytes < h.budget_bytes
    # mlx-lm's even pipeline split, in reverse: rank 0 runs the last layers
    n = json.loads((TINY_MODEL / "config.json").read_text())["num_hidden_layers"]
    assert local.layers[1] == n and h3.layers[0] == 0 and h2.layers[1] == local.layers[0]
    # one ssh call per non-local host, with BatchMode and a 5 s connect timeout
    calls = [json.loads(l) for l in ssh.read_text().splitlines()]
    assert sorted(c[4] for c in calls) == ["10.0.0.2", "10.0.0.3"]
    assert all(c[:4] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"] for c in calls)
    preflight.check(p)


def test_only_local_hosts_skip_ssh(ssh):
    preflight.check(profile("127.0.0.1,127.0.0.1"))
    assert not ssh.exists()


def test_unreachable(ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_DOWN", "10.0.0.3")
    msg = one_line(profile())
    assert msg.startswith(
        "pre-flight: host 10.0.0.3: not reachable over ssh (ssh: connect to host 10.0.0.3"
    )
    assert "10.0.0.2" not in msg


def test_version_mismatch(ssh, monkeypatch):
    here = preflight.head_versions()
    override(monkeypatch, **{"10_0_0_2": {"mlx": "0.0.1", "mlx_lm": here["mlx_lm"] + ".9"}})
    msg = one_line(profile())
    assert (
        msg
        == f"pre-flight: host 10.0.0.2: mlx 0.0.1 there, {here['mlx']} here (major.minor must match)"
    )
    override(monkeypatch, **{"10_0_0_3": {"python": "2.7.18", "mlx_lm": None}})
    msg = one_line(profile())
    assert f"host 10.0.0.3: Python 2.7.18 there, {here['python']} here" in msg
    assert f"host 10.0.0.3: mlx-lm not installed there (mlx-lm {here['mlx_lm']} here)" in msg


def test_model_missing(ssh, monkeypatch, tmp_path):
    override(monkeypatch, **{"10_0_0_2": {"model": False}})
    assert one_line(profile()) == (
        f"pre-flight: host 10.0.0.2: model {TINY_MODEL} not found there "
        f"(copy it to the same path, e.g. rsync -a {TINY_MODEL}/ 10.0.0.2:{TINY_MODEL}/)"
    )
    # really absent (on every host, this one included): memory is skipped with a note
    monkeypatch.delenv("FAKE_SSH_OVERRIDE")
    gone = tmp_path / "gone"
    r = preflight.run(profile(model=gone))
    assert [len(h.problems) for h in r.hosts] == [0, 1, 1]
    assert any("memory not checked" in n for n in r.notes)


def test_too_little_memory(ssh, monkeypatch):
    override(monkeypatch, **{"10_0_0_3": {"memory_bytes": 2**20}})
    msg = one_line(profile())
    assert re.fullmatch(
        r"pre-flight: host 10\.0\.0\.3: needs [\d.]+ GB for its share \(layers 0-\d+\) "
        r"but has a 0\.0 GB GPU budget \(0\.0 GB RAM\)",
        msg,
    ), msg
    # tensor sharding: every rank needs the same share
    r = preflight.run(profile(extra="SHARDING=tensor\n"))
    assert len({h.need_bytes for h in r.hosts}) == 1 and not r.hosts[2].ok


def test_hostfile(ssh, tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(
        json.dumps([{"ssh": "127.0.0.1", "ips": []}, {"ssh": "studio2", "ips": ["10.0.0.2"]}])
    )
    p = profile(str(hf))
    assert preflight.hosts_of(p) == ["127.0.0.1", "studio2"]
    assert preflight.run(p).ok


def test_provider_check_args_runs_preflight(ssh, monkeypatch):
    pytest.importorskip("mlx_lm")
    from macserve.services.providers import mlx_lm

    monkeypatch.setenv("FAKE_SSH_DOWN", "10.0.0.2")
    with pytest.raises(MacserveError, match=r"host 10\.0\.0\.2: not reachable over ssh"):
        mlx_lm.PROVIDER.check_args(profile())
    mlx_lm.PROVIDER.check_args(profile("127.0.0.1,127.0.0.1"))  # local only: no ssh
    assert ssh.read_text().count("\n") == 2  # the two remote hosts of the first profile only


@pytest.mark.e2e
def test_cli(ssh, macserve_home, monkeypatch):
    (macserve_home / "profiles").mkdir(exist_ok=True)
    (macserve_home / "profiles" / "g.env").write_text(
        f"PROVIDER=mlx\nMODEL={TINY_MODEL}\nPORT=8080\nHOSTS=127.0.0.1,10.0.0.2,10.0.0.3\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def cli():
        return subprocess.run(
            [sys.executable, "-m", "macserve", "preflight", "g"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = cli()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("rank 0  127.0.0.1") and "local" in lines[0]
    assert (
        lines[1].startswith("rank 1  10.0.0.2")
        and " ok: Python " in lines[1]
        and "model present" in lines[1]
    )
    assert lines[2].startswith("rank 2  10.0.0.3") and " ok: " in lines[2]
    env["FAKE_SSH_DOWN"] = "10.0.0.3"
    r = cli()
    assert r.returncode == 2
    assert "rank 2  10.0.0.3" in r.stdout and "error: not reachable over ssh" in r.stdout
    assert r.stderr.strip() == "error: pre-flight failed on 1 host(s)"


def test_split_sets_the_shares_and_every_host_needs_macserve(ssh, monkeypatch):
    """Every rank of an mlx profile runs mlx-lm's server under macserve's drain shim (and
    SPLIT's shim): the provider says so, and pre-flight refuses a host without macserve."""
    r = preflight.run(profile("127.0.0.1,10.0.0.2", extra="SPLIT=3,1\n"))
    assert r.ok, r.error()
    assert [h.layers for h in r.hosts] == [(1, 4), (0, 1)]  # rank 0 runs the last 3 layers
    assert r.hosts[0].need_bytes > r.hosts[1].need_bytes
    override(monkeypatch, **{"10_0_0_2": {"macserve": None}})
    assert one_line(profile("127.0.0.1,10.0.0.2", extra="SPLIT=3,1\n")) == (
        "pre-flight: host 10.0.0.2: macserve not installed there (every rank runs mlx-lm's "
        "server under macserve's drain shim and its SPLIT shim: pip install macserve there)"
    )
    assert one_line(profile("127.0.0.1,10.0.0.2")) == (
        "pre-flight: host 10.0.0.2: macserve not installed there (every rank runs mlx-lm's "
        "server under macserve's drain shim: pip install macserve there)"
    )
    preflight.check(profile("127.0.0.1,10.0.0.2"), macserve=None)  # asked only when needed
