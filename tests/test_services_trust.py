"""Issue 26: what a user can trust of the services when things go wrong, with real processes
(real supervisord, real llama-server, the CLI in subprocesses). Each test reproduces one case
the issue measured on the previous main and checks the new behaviour. Waits poll with generous
deadlines: the machine is shared.
"""

# The fixtures imported from test_services_e2e are parameters here (pytest finds them by name).
# ruff: noqa: F811

import json

import httpx

from .serverproc import free_port
from .test_services_e2e import REPO, cli, model_gguf, poll, services, status  # noqa: F401


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
    assert doc["good"]["error"] is None and doc["good"]["total_bytes"] > 0
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
