"""Issue 26: what a user can trust of the services when things go wrong, with real processes
(real supervisord, real llama-server, the CLI in subprocesses). Each test reproduces one case
the issue measured on the previous main and checks the new behaviour. Waits poll with generous
deadlines: the machine is shared.
"""

# The fixtures imported from test_services_e2e are parameters here (pytest finds them by name).
# ruff: noqa: F811
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from .conftest import REPO
from .fixtures import cli, free_port, poll, runs_in, status, supervisord_pid

pytestmark = pytest.mark.e2e


def one_line_error(r) -> str:
    """The command failed the way bad input must: exit 2, one line, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


def new_tiny(model_gguf, name="tiny", *extra, port=None):
    port = port or free_port()
    r = cli("new", str(model_gguf), "--name", name, "--port", str(port), "--ctx", "512",
            "--extra-args", "-t 1 -np 1", *extra)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return port


# ---- item 5: profiles read as bytes ----------------------------------------------------------


def test_broken_profiles_beside_good_ones(llama_server, model_gguf, services, macserve_home):
    port = new_tiny(model_gguf, "good")
    services.append(status("good")["pid"])
    profiles = macserve_home / "profiles"
    (profiles / "latin.env").write_bytes(
        b"# caf\xe9 au lait\nPROVIDER=llama.cpp\nMODEL=x\nPORT=9\n"
    )
    (profiles / "binary.env").write_bytes(bytes(range(256)) * 4)
    (profiles / "empty.env").write_bytes(b"")
    reasons = {
        "latin": "not UTF-8 text (byte 0xe9 at offset 5",
        "binary": "binary data, not a profile (a NUL byte at offset 0)",
        "empty": "the file is empty",
    }

    # ls / status: one invalid row each, naming the file and the reason; good still works
    for cmd in (("ls", "--json"), ("status", "--json")):
        r = cli(*cmd)
        assert r.returncode == 0, r.stderr
        body = json.loads(r.stdout)
        rows = {x["name"]: x for x in (body if cmd[0] == "ls" else body["services"])}
        assert rows["good"]["state"] == "running" and rows["good"]["error"] is None
        for bad, why in reasons.items():
            assert f"profile {bad} ({profiles / bad}.env): {why}" in rows[bad]["error"]
    r = cli("ls")
    assert r.returncode == 0, r.stderr
    table = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    for bad in reasons:
        assert table[bad].split()[2] == "invalid" and f"{bad}.env" in table[bad]

    # doctor: a row per profile, the broken ones with their reason; good is counted
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    doc = {p["name"]: p for p in json.loads(r.stdout)["profiles"]}
    assert doc["good"]["error"] is None and doc["good"]["share_bytes"] > 0
    for bad, why in reasons.items():
        assert why in doc[bad]["error"]

    # every command on a broken profile: one line, exit 2
    for bad, why in reasons.items():
        for cmd in (
            ("show", bad),
            ("start", bad),
            ("set", bad, "--", "CTX=256"),
            ("chat", bad, "hi"),
        ):
            assert why in one_line_error(cli(*cmd)), cmd

    # the good one: show, set (restart + health) and chat still work
    assert cli("show", "good").returncode == 0
    r = cli("set", "good", "--", "CTX=256")
    assert r.returncode == 0, r.stderr
    services.append(status("good")["pid"])
    r = cli("chat", "good", "Who's there?", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


# ---- item 3: values that cannot work are refused before they are written ----------------------

LONG = "a" * 10_000
NOT_HERE = "192.0.2.7"  # TEST-NET-1 (RFC 5737): never an address of this machine


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_hostile_values_one_line_nothing_written(model_gguf, macserve_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # `pull` must refuse without the network
    port = free_port()
    r = cli("new", str(model_gguf), "--name", "tiny", "--port", str(port), "--no-start")
    assert r.returncode == 0, r.stderr
    before = snapshot(macserve_home)
    g = str(model_gguf)
    cases = [
        ("new", g, "--name", "h1", "--host", "999.1.1.1", "--no-start"),
        ("new", g, "--name", "h2", "--host", NOT_HERE, "--no-start"),
        ("new", g, "--name", "h3", "--host", "no-such-host.invalid", "--no-start"),
        ("new", g, "--name", "../escape", "--no-start"),
        ("new", g, "--name", LONG, "--no-start"),
        ("new", LONG, "--name", "h4", "--no-start"),
        ("new", g, "--name", "h5", "--extra-args", "'", "--no-start"),
        ("new", g, "--name", "h6", "--port", "0", "--no-start"),
        ("new", g, "--name", "h7", "--ctx", "-5", "--no-start"),
        ("new", g, "--name", "h8", "--api-key", "clé", "--no-start"),
        ("new", g, "--name", "h9", "--extra-args", "--api-key-file /etc/hostname", "--no-start"),
        ("worker", "w1", "--host", "999.1.1.1", "--no-start"),
        ("router", "--install", "--name", "r1", "--port", "0", "--no-start"),
    ]
    for kv in (
        "HOST=999.1.1.1",
        f"HOST={NOT_HERE}",
        "HOST=no-such-host.invalid",
        "HOST=a b",
        "PORT=0",
        "PORT=99999",
        "PORT=abc",
        "CTX=-1",
        "CTX=1e9",
        "KV=../x",
        "KV=q7",
        f"MODEL={LONG}",
        "MODEL=/nonexistent/model.gguf",
        "EXTRA_ARGS='",
        "EXTRA_ARGS=--api-key-file /etc/hostname",
        "EXTRA_ARGS+=--no-such-flag",
        "API_KEY=clé",
        "API_KEY=a\tb",
        "TTL=soon",
        "DRAIN=soon",
        "DRAIN=2h",
        "ALIASES=tiny",
        "HOSTS=a:b",
        "SPLIT=x",
        "NOPE=1",
        "=x",
        f"EXTRA_ARGS={LONG}",
    ):
        cases.append(("set", "tiny", "--", kv))
    for name in ("../etc", LONG, "missing", ""):
        for cmd in ("show", "start", "stop", "restart", "rm", "logs", "status", "set", "run"):
            cases.append((cmd, name, "CTX=1") if cmd == "set" else (cmd, name))
    cases += [
        ("doctor", "--memory", "lots"),
        ("pull", "no-such-owner/no-such-repo"),
        ("pull", LONG),
        ("chat", "tiny", "hi", "--api-key", "clé"),
    ]
    bad = []
    for case in cases:
        r = cli(*case, timeout=120)
        lines = r.stderr.strip().splitlines()
        shown = tuple(a[:40] for a in case[:4])
        if r.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
            bad.append((shown, r.returncode, r.stderr.strip()[-300:]))
        if snapshot(macserve_home) != before:
            bad.append((shown, "wrote to MACSERVE_HOME"))
            before = snapshot(macserve_home)
    assert not bad, "\n".join(map(str, bad))

    # item 8: a key written before the checks existed (or by hand) is refused, never a crash
    secrets = macserve_home / "profiles" / "tiny.secrets"
    secrets.write_text("API_KEY=cl\u00e9\n")
    secrets.chmod(0o600)
    for case in (("chat", "tiny", "hi"), ("start", "tiny")):
        assert "printable ASCII" in one_line_error(cli(*case)), case


# ---- items 1 and 2: a stop during `set`; SIGKILL of `set`; the change journal -----------------


def set_bg(*assignments, pause=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), MACSERVE_SERVICE_BACKEND="supervisor")
    if pause:
        env["MACSERVE_JOURNAL_PAUSE"] = pause
    return subprocess.Popen(
        [sys.executable, "-m", "macserve", "set", *assignments],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def journal_phase(home, name):
    try:
        return json.loads((home / "profiles" / f".{name}.pending").read_text())["phase"]
    except FileNotFoundError:
        return None


def cmdline(pid) -> str:
    """The server's command line: the supervised process's own, and (llama.cpp, where
    `macserve run` stays the parent to drain it on a stop) its children's."""
    p = psutil.Process(pid)
    return " ".join(" ".join(x.cmdline()) for x in [p, *p.children(recursive=True)])


def healthy_pid(name, services) -> int:
    s = poll(lambda: (lambda s: s if s["healthy"] else None)(status(name)), f"{name} healthy", 180)
    services.append(s["pid"])
    return s["pid"]


def test_stop_during_set_keeps_the_new_settings(llama_server, model_gguf, services, macserve_home):
    from macserve.services.journal import changing
    from macserve.services.supervisors.supervisord import SupervisorBackend

    port = new_tiny(model_gguf)
    services.append(status("tiny")["pid"])
    p = set_bg("tiny", "--", "CTX=256")
    first = p.stderr.readline()
    assert first.startswith("waiting for"), first
    # the marker the router's pool reads: no idle stop while the change is at work
    assert changing("tiny")
    SupervisorBackend(macserve_home).stop("tiny")  # what `macserve stop` and the router call
    out, err = p.communicate(timeout=120)  # not the 300 s health timeout
    assert p.returncode == 0, err
    assert "was stopped by another command while it was starting" in out
    assert "the new settings are kept" in out and "previous settings restored" not in out + err
    assert "CTX=256\n" in (macserve_home / "profiles" / "tiny.env").read_text()
    assert journal_phase(macserve_home, "tiny") is None and not changing("tiny")
    assert status("tiny")["state"] == "stopped"
    # nothing lost: start runs the new settings
    r = cli("start", "tiny")
    assert r.returncode == 0, r.stderr
    pid = healthy_pid("tiny", services)
    assert "-c 256" in cmdline(pid)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_sigkill_of_set_at_each_point_then_ls(llama_server, model_gguf, services, macserve_home):
    new_tiny(model_gguf)
    assert cli("set", "tiny", "--", "API_KEY=sk-old-1").returncode == 0
    profile = macserve_home / "profiles" / "tiny.env"
    secrets = macserve_home / "profiles" / "tiny.secrets"
    old_text, old_secrets = profile.read_text(), secrets.read_text()
    pid = healthy_pid("tiny", services)

    def kill_at(phase, *assignments):
        p = set_bg("tiny", "--", *assignments, pause=phase)
        poll(lambda: journal_phase(macserve_home, "tiny") == phase, f"set at {phase}", 120)
        time.sleep(0.5)  # past the journal write, into the pause (the kill lands in the sleep)
        p.kill()
        p.wait(timeout=30)
        r = cli("ls")
        assert r.returncode == 0, r.stderr
        assert "an interrupted change was settled" in r.stderr, r.stderr
        assert journal_phase(macserve_home, "tiny") is None
        return r

    # saving: the journal is written, the new files maybe: the old ones come back, no restart
    kill_at("saving", "CTX=256", "API_KEY=sk-new-2")
    assert (profile.read_text(), secrets.read_text()) == (old_text, old_secrets)
    assert status("tiny")["pid"] == pid

    # restarting: the new files are written, the restart about to begin: old back and running
    kill_at("restarting", "CTX=256", "API_KEY=sk-new-2")
    assert (profile.read_text(), secrets.read_text()) == (old_text, old_secrets)
    pid = healthy_pid("tiny", services)
    assert "-c 512" in cmdline(pid)

    # restoring: new settings that fail, killed while the old ones are being put back
    kill_at("restoring", "EXTRA_ARGS+=--lora /nonexistent/adapter.gguf")
    assert (profile.read_text(), secrets.read_text()) == (old_text, old_secrets)
    pid = healthy_pid("tiny", services)
    assert "--lora" not in cmdline(pid)

    # in the health wait (no pause): either settings may win, but the one on disk is the one
    # that runs, the journal is settled and nothing is half applied
    p = set_bg("tiny", "--", "CTX=256")
    assert p.stderr.readline().startswith("waiting for")
    p.kill()
    p.wait(timeout=30)
    r = cli("ls")
    assert r.returncode == 0, r.stderr
    assert journal_phase(macserve_home, "tiny") is None
    text = profile.read_text()
    assert text in (old_text, old_text.replace("CTX=512", "CTX=256"))
    assert secrets.read_text() == old_secrets
    pid = healthy_pid("tiny", services)
    assert ("-c 256" if "CTX=256" in text else "-c 512") in cmdline(pid)


# ---- item 4: supervision truth -----------------------------------------------------------------


def test_supervisord_stopped_then_killed(llama_server, model_gguf, services, macserve_home):

    new_tiny(model_gguf)
    pid = healthy_pid("tiny", services)
    sv = supervisord_pid(macserve_home)
    profile = (macserve_home / "profiles" / "tiny.env").read_bytes()

    # SIGSTOP: every command that asks it is one line naming it (it used to hang for ever)
    os.kill(sv, signal.SIGSTOP)
    try:
        for cmd in (("ls",), ("status", "tiny"), ("set", "tiny", "--", "CTX=256")):
            line = one_line_error(cli(*cmd, timeout=120))
            assert f"supervisord (pid {sv}) is stopped" in line and f"kill -CONT {sv}" in line
    finally:
        os.kill(sv, signal.SIGCONT)
    assert (macserve_home / "profiles" / "tiny.env").read_bytes() == profile
    assert status("tiny")["pid"] == pid

    # SIGKILL: its server runs on unsupervised; ls says so, start replaces it, never beside it
    os.kill(sv, signal.SIGKILL)
    poll(lambda: not psutil.pid_exists(sv), "supervisord to go")
    rows = json.loads(cli("ls", "--json").stdout)
    assert [(x["state"], x["pid"]) for x in rows] == [("orphaned", pid)]
    r = cli("start", "tiny")
    assert r.returncode == 0, r.stderr
    assert "already running" not in r.stdout
    new = healthy_pid("tiny", services)
    assert new != pid
    poll(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
        "orphan gone",
    )
    servers = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server"]
    ours = [p.pid for p in servers if runs_in(p, macserve_home)]
    # one llama-server: the new service's (a child of `macserve run`, which drains it on a stop)
    assert ours == [c.pid for c in psutil.Process(new).children() if c.name() == "llama-server"]
    assert len(ours) == 1


def test_crash_loop_in_ls_then_start_fails(
    llama_server, model_gguf, services, macserve_home, tmp_path
):
    """A service whose server exits at once, under real supervisord: `ls` and `status` say
    `crash-loop` with the server's own last error line (supervisord calls each respawn
    RUNNING while `macserve run` backs off), and `start` fails instead of `already running`."""
    import shutil

    gguf = tmp_path / "weights.gguf"
    shutil.copy(model_gguf, gguf)
    new_tiny(gguf)
    pid = status("tiny")["pid"]
    services.append(pid)
    gguf.write_bytes(b"GGUF" + b"\xff" * 64)  # the weights go bad under the running service
    for p in psutil.Process(pid).children(recursive=True):
        services.append(p.pid)
        p.kill()  # a crash: the supervisor respawns it, and every respawn dies at once

    def looping():
        r = cli("ls", "--json")
        assert r.returncode == 0, r.stderr
        row = {x["name"]: x for x in json.loads(r.stdout)}["tiny"]
        return row if row["state"] == "crash-loop" else None

    row = poll(looping, "ls to say crash-loop", 180)
    log = (macserve_home / "logs" / "tiny.log").read_text(errors="replace")
    assert row["detail"].strip() and row["detail"].strip() in log, row
    assert "macserve run tiny:" not in row["detail"]  # the server's line, not our own
    # and every time after: the respawns' "starting" and "running" alike (supervisord's words)
    for _ in range(8):
        r = cli("ls")
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if x.split()[:1] == ["tiny"])
        assert "crash-loop" in line, r.stdout
        assert "note: tiny: crash-loop: " in r.stderr

    r = cli("start", "tiny", "--timeout", "30")
    assert r.returncode != 0, r.stdout
    assert "already running" not in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_router_leaves_a_profile_being_changed(llama_server, model_gguf, services, macserve_home):
    """The router's reaper does not stop a profile past its TTL while a `set` of it is at
    work (its journal, `profiles/.NAME.pending`, has a live owner), and does once the owner
    is gone: the same TTL, the same router."""
    from .fixtures import router_process, state

    new_tiny(model_gguf)
    pid = status("tiny")["pid"]
    services.append(pid)
    assert cli("set", "tiny", "--", "TTL=1s").returncode == 0  # read by the router: no restart
    p = set_bg("tiny", "--", "CTX=256", pause="saving")  # holds the journal, owner alive
    try:
        poll(lambda: journal_phase(macserve_home, "tiny") == "saving", "set at saving", 120)
        port = free_port()
        with router_process(
            macserve_home, ["router", "--port", str(port), "--ttl", "1s"], port
        ) as router:
            poll(
                lambda: (
                    "tiny: left running: a change to it is in progress" in router.log.read_text()
                ),
                "the router to leave tiny alone",
                60,
            )
            assert state("tiny") == "running" and status("tiny")["pid"] == pid
            assert "tiny: running -> stopping" not in router.log.read_text()
            p.kill()  # the owner is gone: nothing holds tiny any more
            p.wait(30)
            idle_stop = (
                "tiny: running -> stopping: idle"  # the state machine's line (router/state.py)
            )
            poll(lambda: idle_stop in router.log.read_text(), "the idle stop", 60)
            poll(lambda: state("tiny") == "stopped", "tiny stopped", 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
