"""Supervision truth on launchd (issue 26 item 4): what `ls` and `status` say of a launchd
service comes from what `launchctl print` says, never from what macserve remembers doing.

Against the recording `launchctl` stand-in (tests/fixtures.py): its state file is launchd's
own record here, so a test changes the world by writing it (a job that crashed, one someone
loaded by hand) and then asks the CLI. The one thing read from our own files is whether a
unit is installed (its plist, launchd's own input) and, as on supervisord, `macserve run`'s
back-off record for a respawn that launchd calls running.
"""

import json
import subprocess

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.services.profiles import Profile, ProfileStore
from macserve.services.supervisors import log_path, spec_for
from macserve.services.supervisors.launchd import LaunchdBackend

from .fixtures import DOMAIN

pytestmark = pytest.mark.e2e  # the launchctl stand-in is a process per call

TARGET = f"{DOMAIN}/dev.macserve.big"
# what llama-server writes when its weights cannot be read, then its callers giving up
LOG = [
    "macserve run big: /opt/llama-server -m /models/big.gguf --port 8080",
    "0.00.012.001 E gguf_init_from_file_impl: invalid magic characters: 'GGUF', expected 'GGUF'",
    "0.00.012.050 E llama_model_load: error loading model: llama_model_loader: failed to load",
    "0.00.012.300 E srv  llama_server: exiting due to model loading error",
]


def _installed(launchctl) -> Profile:
    p = Profile("big", {"PROVIDER": "llama.cpp", "MODEL": "/models/big.gguf", "PORT": "8080"})
    ProfileStore().save(p)
    LaunchdBackend().apply(spec_for(p, {}))
    launchctl()
    return p


def _launchd_records(launchctl, record: dict) -> None:
    """launchd's record of the job is now `record` (the fake's state file is that record)."""
    state = json.loads(launchctl.state.read_text())
    state[TARGET] = record
    launchctl.state.write_text(json.dumps(state))


def _ls() -> tuple[dict, str]:
    r = CliRunner().invoke(main, ["ls", "--json"])
    assert r.exit_code == 0, r.stderr
    return {x["name"]: x for x in json.loads(r.stdout)}["big"], r.stderr


def test_states_are_launchctl_print(launchctl, macserve_home):
    _installed(launchctl)
    log_path("big").parent.mkdir(parents=True, exist_ok=True)
    log_path("big").write_text("\n".join(LOG) + "\n")
    cases = [
        # (launchd's record, what ls says)
        ({"state": "running", "pid": 4300, "runs": 1}, "running"),
        ({"state": "spawn scheduled", "pid": None, "runs": 1}, "starting"),
        ({"state": "not running", "pid": None, "runs": 1, "exit": 1}, "exited"),  # one death
        # a clean exit is not respawned (KeepAlive SuccessfulExit false): not a loop
        ({"state": "not running", "pid": None, "runs": 3, "exit": 0}, "exited"),
        # respawned, failed again, waiting out ThrottleInterval: a crash loop
        ({"state": "spawn scheduled", "pid": None, "runs": 3, "exit": 1}, "crash-loop"),
        ({"state": "spawn scheduled", "pid": None, "runs": 2, "signal": "Killed: 9"}, "crash-loop"),
    ]
    for record, want in cases:
        _launchd_records(launchctl, record)
        row, notes = _ls()
        assert row["state"] == want, (record, row)
        assert row["pid"] == record.get("pid"), (record, row)
        calls = launchctl()
        assert ["print", TARGET] in calls  # asked launchd, every time
        if want == "crash-loop":
            # the server's own first error line, and launchd's figures beside it
            assert row["detail"].startswith("gguf_init_from_file_impl: invalid magic"), row
            assert f"runs {record['runs']}" in row["detail"], row
            assert f"note: big: crash-loop: {row['detail']}" in notes

    # status says the same, from the same print
    r = CliRunner().invoke(main, ["status", "big", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["services"][0]["state"] == "crash-loop"


def test_stopped_by_macserve_but_loaded_by_hand(launchctl, macserve_home, tmp_path):
    """macserve stopped it; someone bootstraps it again with launchctl itself: ls says it
    runs, because launchd says so."""
    _installed(launchctl)
    r = CliRunner().invoke(main, ["stop", "big"])
    assert r.exit_code == 0, r.stderr
    row, _ = _ls()
    assert row["state"] == "stopped"
    plist = tmp_path / "LaunchAgents" / "dev.macserve.big.plist"
    by_hand = [str(tmp_path / "launchctl"), "bootstrap", DOMAIN, str(plist)]
    assert subprocess.run(by_hand).returncode == 5  # stop disabled it, as launchd refuses
    subprocess.run([str(tmp_path / "launchctl"), "enable", TARGET], check=True)
    subprocess.run(by_hand, check=True)
    row, _ = _ls()
    assert (row["state"], row["pid"]) == (
        "running",
        json.loads(launchctl.state.read_text())[TARGET]["pid"],
    )


def test_plist_removed_by_hand_while_loaded(launchctl, macserve_home, tmp_path):
    """The plist deleted while launchd still runs the job: not `not installed` (the server is
    up, holding its port) but what launchd says, with the command that unloads it; that
    command then unloads it."""
    _installed(launchctl)
    (tmp_path / "LaunchAgents" / "dev.macserve.big.plist").unlink()
    row, _ = _ls()
    assert row["state"] == "running" and row["pid"], row
    assert f"loaded in {DOMAIN} although its plist is gone" in row["detail"]
    assert "macserve stop big unloads it" in row["detail"]
    launchctl()
    r = CliRunner().invoke(main, ["stop", "big"])
    assert r.exit_code == 0, r.stderr
    calls = launchctl()
    assert ["kill", "SIGTERM", TARGET] in calls and ["bootout", TARGET] in calls
    assert TARGET not in json.loads(launchctl.state.read_text())
    row, _ = _ls()
    assert row["state"] == "not installed"
    r = CliRunner().invoke(main, ["stop", "big"])  # nothing loaded, no plist: one line
    assert r.exit_code == 2 and "not installed" in r.stderr
