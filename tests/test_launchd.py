"""launchd backend: the plist (built with plistlib, parsed back key by key), the domain choice,
and the exact launchctl command sequences.

launchctl is the one fake in the test suite: a small script that appends its argv as a JSON line
to a file, keeps the loaded jobs in a JSON state file, and answers the way launchctl does:
`print` a tab-indented property block (or exit 113 for an unknown service), `bootstrap` exit 5
when the plist's LimitLoadToSessionType does not name the domain's session type (as launchd
refuses it), `kill` ends the job's process (recording launchd's "last terminating signal").
"""

import json
import os
import plistlib
import shutil
import sys

import pytest

from macserve.errors import MacserveError
from macserve.services import providers, values
from macserve.services.health import wait_ready
from macserve.services.profiles import Profile, ProfileStore
from macserve.services.supervisors import (
    launchd_domains,
    launchd_files,
    log_path,
    spec_for,
    supervisord_files,
)
from macserve.services.supervisors.launchd import LaunchdBackend
from macserve.services.supervisors.launchd_ctl import parse_print
from macserve.services.supervisors.launchd_plist import render_plist

from .conftest import REPO, TINY_MODEL
from .fixtures import DOMAIN, UID

USER_DOMAIN = f"user/{UID}"


def _probe(name="big", uid=UID):
    """`copies`: one print per domain a copy of the unit may be loaded in."""
    return [["print", f"{d}/dev.macserve.{name}"] for d in (f"gui/{uid}", f"user/{uid}", "system")]


def _profile(name="big", provider="llama.cpp", model="/models/big.gguf"):
    return Profile(
        name, {"PROVIDER": provider, "MODEL": model, "PORT": "8080", "EXTRA_ARGS": "-c 8192"}
    )


def _spec(p, env=None):
    return spec_for(p, env or {})


def test_plist_key_by_key(macserve_home, monkeypatch):
    monkeypatch.setenv(
        "MACSERVE_LLAMA_SERVER", "/opt/llama & co/llama-server"
    )  # needs XML escaping
    spec = _spec(_profile())
    d = plistlib.loads(render_plist(spec, DOMAIN))
    assert d["Label"] == "dev.macserve.big"
    assert d["ProgramArguments"] == [sys.executable, "-m", "macserve", "run", "big"]
    assert os.path.isabs(d["ProgramArguments"][0])
    env = d["EnvironmentVariables"]
    path = env["PATH"].split(":")
    for p in (
        "/opt/homebrew/bin",
        "/usr/local/bin",
        "/usr/bin",
        "/bin",
        os.path.dirname(sys.executable),
    ):
        assert p in path
    assert env["MACSERVE_HOME"] == str(macserve_home)
    assert env["MACSERVE_LLAMA_SERVER"] == "/opt/llama & co/llama-server"
    assert env["MACSERVE_ROTATE_LOGS"] == str(log_path("big"))
    assert env["MACSERVE_SUPERVISED"] == "1"
    assert d["LimitLoadToSessionType"] == "Aqua"  # the gui domain's session
    assert plistlib.loads(render_plist(spec, f"user/{UID}"))["LimitLoadToSessionType"] == (
        "Background"
    )
    assert d["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert d["RunAtLoad"] is True
    assert d["ThrottleInterval"] == 30
    # SIGTERM -> SIGKILL: the default DRAIN plus the margin, as supervisord's stopwaitsecs
    assert d["ExitTimeOut"] == values.stop_wait(None) > values.DEFAULT_DRAIN
    assert d["ProcessType"] == "Interactive"
    assert d["StandardOutPath"] == d["StandardErrorPath"] == str(log_path("big"))
    assert os.path.isabs(d["StandardOutPath"])
    assert d["WorkingDirectory"] == str(macserve_home)
    assert d["SoftResourceLimits"] == {"NumberOfFiles": 4096}
    assert set(d) == {
        "Label",
        "ProgramArguments",
        "EnvironmentVariables",
        "WorkingDirectory",
        "LimitLoadToSessionType",
        "RunAtLoad",
        "KeepAlive",
        "ThrottleInterval",
        "ExitTimeOut",
        "ProcessType",
        "SoftResourceLimits",
        "StandardOutPath",
        "StandardErrorPath",
    }


@pytest.mark.e2e
def test_drain_sets_both_supervisors_stop_timeout(launchctl, macserve_home):
    """One figure, from the profile's DRAIN: launchd's ExitTimeOut and supervisord's
    stopwaitsecs agree, and both leave the drain its whole length before any SIGKILL."""
    for drain, secs in (("", values.DEFAULT_DRAIN), ("3", 3), ("90s", 90), ("5m", 300)):
        p = _profile().updated({"DRAIN": drain})
        assert p.drain == (None if not drain else secs)
        spec = _spec(p)
        exit_timeout = plistlib.loads(render_plist(spec, DOMAIN))["ExitTimeOut"]
        conf = supervisord_files.program_conf(spec)
        assert f"stopwaitsecs={exit_timeout}\n" in conf
        assert exit_timeout >= secs + values.STOP_MARGIN
        LaunchdBackend().install(spec)  # our own graceful stop waits what the plist says
        assert LaunchdBackend().grace("big") == exit_timeout
    # the engine drains by itself: DRAIN is its --shutdown-grace, and no longer an EXTRA_ARGS flag
    eng = providers.get("macserve")
    for drain, grace in (("", "60"), ("90s", "90"), ("2.5", "2.5")):
        p = Profile("e", {"PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": "1"})
        argv = eng.argv(p.updated({"DRAIN": drain}))
        assert argv[argv.index("--shutdown-grace") + 1] == grace
    taken = p.updated({"EXTRA_ARGS": "--shutdown-grace 5"})
    try:
        eng.check_args(taken)
    except MacserveError as e:
        assert str(e) == "--shutdown-grace is set by macserve from the profile; use the DRAIN key"
    else:
        raise AssertionError("--shutdown-grace in EXTRA_ARGS accepted")
    for bad in ("soon", "0", "-3", "2h"):
        try:
            _profile().updated({"DRAIN": bad})
        except MacserveError as e:
            assert "DRAIN" in str(e)
        else:
            raise AssertionError(f"DRAIN={bad} accepted")


def test_provider_env_lands_in_the_plist(macserve_home):
    from macserve.services import providers

    p = _profile(provider="mlx", model="mlx-community/Foo-4bit")
    d = plistlib.loads(render_plist(_spec(p, providers.get("mlx").env(p)), DOMAIN))
    assert d["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"


def test_parse_print_takes_top_level_properties():
    text = (
        "gui/501/dev.macserve.big = {\n\tstate = running\n\tpid = 77\n\truns = 3\n"
        "\tlast exit code = 1: Operation not permitted\n\tendpoints = {\n\t\tstate = active\n\t}\n}\n"
    )
    assert parse_print(text) == {
        "state": "running",
        "pid": "77",
        "runs": "3",
        "last exit code": "1: Operation not permitted",
        "endpoints": "{",
    }


@pytest.mark.e2e
def test_command_sequences(launchctl, macserve_home, tmp_path):
    b = LaunchdBackend()
    target = f"{DOMAIN}/dev.macserve.big"
    plist = tmp_path / "LaunchAgents" / "dev.macserve.big.plist"
    p = _profile()
    # a graceful stop: SIGTERM, wait until the process is gone, then bootout and wait until
    # launchd forgets the job (never `kickstart -k`, which is SIGKILL at once)
    graceful = _probe() + [
        ["kill", "SIGTERM", target],
        ["print", target],
        ["bootout", target],
        ["print", target],
    ]
    fresh = [["enable", target], ["bootstrap", DOMAIN, str(plist)]]

    # install: write the plist, enable (a disabled job refuses to bootstrap), bootstrap
    b.apply(_spec(p))
    assert plist.exists() and oct(plist.stat().st_mode & 0o777) == "0o644"
    assert launchctl() == _probe() + fresh
    st = b.status("big")
    assert (st.state, st.pid, st.runs, st.died) == ("running", 4242, 1, False)
    launchctl()

    # restart with the plist unchanged (a profile edit; `macserve run` rereads the profile):
    # still a fresh job, so its run record is the new process's
    b.apply(_spec(p.updated({"EXTRA_ARGS": "-c 4096"})))
    assert launchctl() == graceful + fresh
    assert b.status("big").pid == 4243
    launchctl()

    # the plist changed (mlx adds PYTHONUNBUFFERED): graceful stop, bootout, then bootstrap
    # of the new file (kickstart would keep running the old definition)
    before = plist.read_bytes()
    b.apply(_spec(p.updated({"PROVIDER": "mlx"}), {"PYTHONUNBUFFERED": "1"}))
    assert plist.read_bytes() != before
    assert launchctl() == graceful + fresh
    assert plistlib.loads(plist.read_bytes())["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"

    # stop: graceful, bootout, disable (so it does not come back at login)
    b.stop("big")
    assert launchctl() == graceful + [["disable", target]]
    assert b.status("big").state == "stopped" and plist.exists()
    launchctl()

    # start again: enable + bootstrap
    b.start("big")
    assert launchctl() == _probe() + fresh

    # remove: graceful, bootout, delete the plist
    b.uninstall("big")
    assert launchctl() == graceful
    assert not plist.exists()
    assert b.status("big").state == "not installed"
    # no plist: status still asks launchd in every domain (a job whose plist was removed by
    # hand runs all the same: tests/test_launchd_truth.py)
    assert launchctl() == _probe()


@pytest.mark.e2e
def test_sigterm_ignored_then_sigkill_after_the_grace(launchctl, macserve_home, monkeypatch):
    b = LaunchdBackend()
    monkeypatch.setattr(b, "grace", lambda name: 0.3)
    b.apply(_spec(_profile()))
    launchctl()
    monkeypatch.setenv("FAKE_LAUNCHCTL_IGNORE_TERM", "1")
    b.uninstall("big")
    calls = launchctl()
    target = f"{DOMAIN}/dev.macserve.big"
    kills = [c for c in calls if c[0] == "kill"]
    assert kills == [["kill", "SIGTERM", target], ["kill", "SIGKILL", target]]
    assert calls.index(["kill", "SIGKILL", target]) < calls.index(["bootout", target])


@pytest.mark.e2e
def test_ssh_session_picks_the_user_domain(launchctl, macserve_home, tmp_path, monkeypatch):
    """Over SSH with the console someone else's (or nobody's): user/<uid>, a Background plist;
    the unit is then found there from any shell, and moves when restarted from the GUI."""
    monkeypatch.setattr(launchd_domains, "console_uid", lambda: UID + 1)
    assert launchd_domains.domain() == DOMAIN  # no SSH: gui
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.2 50000 10.0.0.1 22")
    assert launchd_domains.domain() == f"user/{UID}"
    monkeypatch.setattr(launchd_domains, "console_uid", lambda: UID)
    assert launchd_domains.domain() == DOMAIN  # SSH, but this user is logged in at the screen
    monkeypatch.setattr(launchd_domains, "console_uid", lambda: UID + 1)

    b = LaunchdBackend()
    plist = tmp_path / "LaunchAgents" / "dev.macserve.big.plist"
    b.apply(_spec(_profile()))
    user = f"user/{UID}/dev.macserve.big"
    assert launchctl() == _probe() + [
        ["enable", user],
        ["bootstrap", f"user/{UID}", str(plist)],
    ]
    assert plistlib.loads(plist.read_bytes())["LimitLoadToSessionType"] == "Background"

    monkeypatch.delenv("SSH_CONNECTION")  # a GUI shell sees the same job
    st = b.status("big")
    assert (st.state, st.pid) == ("running", 4242)
    launchctl()
    b.apply(_spec(_profile()))  # restarted from the GUI: out of user/, into gui/
    gui = f"{DOMAIN}/dev.macserve.big"
    assert launchctl() == _probe() + [
        ["kill", "SIGTERM", user],
        ["print", user],
        ["bootout", user],
        ["print", user],
        ["enable", gui],
        ["bootstrap", DOMAIN, str(plist)],
    ]
    assert plistlib.loads(plist.read_bytes())["LimitLoadToSessionType"] == "Aqua"


@pytest.mark.e2e
def test_death_by_signal_fails_the_wait_at_once(launchctl, macserve_home):
    """launchd's "last terminating signal" (jetsam's SIGKILL, a Metal abort) is read: the
    health wait stops at the first poll instead of waiting out its timeout."""
    b = LaunchdBackend()
    p = _profile()
    ProfileStore().save(p)
    b.apply(_spec(p))
    state = json.loads(launchctl.state.read_text())
    job = state[f"{DOMAIN}/dev.macserve.big"]
    job.update(state="not running", pid=None, signal="Killed: 9")
    launchctl.state.write_text(json.dumps(state))
    st = b.status("big")
    assert (st.state, st.died, st.signal, st.exit_code) == ("exited", True, "Killed: 9", None)
    ok, why = wait_ready(p, timeout=600, backend=b)
    assert not ok
    assert (
        why == "it was killed by signal Killed: 9: the system may have run out of memory (jetsam)"
    )
    job.update(signal=None, exit=1)
    launchctl.state.write_text(json.dumps(state))
    assert wait_ready(p, timeout=600, backend=b) == (False, "it exited with code 1")


@pytest.mark.e2e
def test_cli_through_launchd(launchctl, macserve_home, tmp_path):
    """rm through the CLI on the launchd backend: bootout before the profile goes."""
    from click.testing import CliRunner

    from macserve.cli import main

    ProfileStore().save(_profile())
    LaunchdBackend().apply(_spec(_profile()))
    launchctl()
    r = CliRunner().invoke(main, ["ls", "--json"])
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)[0]
    assert (row["name"], row["state"], row["pid"]) == ("big", "running", 4242)
    launchctl()
    r = CliRunner().invoke(main, ["rm", "big"])
    assert r.exit_code == 0, r.stderr
    target = f"{DOMAIN}/dev.macserve.big"
    assert launchctl() == _probe() + [
        ["kill", "SIGTERM", target],
        ["print", target],
        ["bootout", target],
        ["print", target],
    ]
    assert not ProfileStore().exists("big")


def _machine(monkeypatch, tmp_path, python):
    """Another machine: its own interpreter, home, log folder and shell variables."""
    monkeypatch.setattr(sys, "executable", python)
    monkeypatch.setenv("MACSERVE_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MACSERVE_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("LD_PRELOAD", "/opt/blas.so")
    monkeypatch.setenv("MACSERVE_LAUNCH_AGENTS", str(tmp_path / "agents"))


def test_checked_in_plists_are_the_codes(monkeypatch, tmp_path):
    """launchd/ holds what macserve installs for the demo profile and the router, rendered by
    render_plist with placeholder paths: the same bytes on any machine, and valid plists."""
    folder = REPO / "launchd"
    assert launchd_files.stale(REPO) == [], "run: macserve dev launchd-plists"
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.plist"))
    assert names == [
        "LaunchDaemons/dev.macserve.router.plist",
        "LaunchDaemons/dev.macserve.tiny-mla.plist",
        "dev.macserve.router.plist",
        "dev.macserve.tiny-mla.plist",
    ]
    for n in names:
        d = plistlib.loads((folder / n).read_bytes())
        assert n.split("/")[-1] == d["Label"] + ".plist"
        assert ("UserName" in d) == n.startswith("LaunchDaemons/")
        assert d["ProgramArguments"][-2:] == ["run", d["Label"].removeprefix("dev.macserve.")]
        assert not any(k in d["EnvironmentVariables"] for k in ("API_KEY", "MACSERVE_API_KEY"))
        assert str(tmp_path) not in (folder / n).read_text()
    want = launchd_files.render(REPO)
    for python in ("/usr/bin/python3", str(tmp_path / "venv" / "bin" / "python")):
        _machine(monkeypatch, tmp_path, python)
        assert launchd_files.render(REPO) == want


def test_placeholders_change_paths_only(macserve_home):
    """The checked-in form differs from the installed one in machine paths alone."""
    p = launchd_files.profiles(REPO)[0]
    spec = spec_for(p, providers.for_profile(p).env(p))
    real = plistlib.loads(render_plist(spec, DOMAIN))
    shown = plistlib.loads(render_plist(launchd_files.placeholder_spec(spec), DOMAIN))
    paths = {"ProgramArguments", "EnvironmentVariables", "WorkingDirectory"}
    paths |= {"StandardOutPath", "StandardErrorPath"}
    assert {k: v for k, v in real.items() if k not in paths} == {
        k: v for k, v in shown.items() if k not in paths
    }
    assert shown["ProgramArguments"][1:] == real["ProgramArguments"][1:]
    assert shown["ProgramArguments"][0] == launchd_files.PYTHON
    # the installing shell's variables (LD_PRELOAD, MACSERVE_LLAMA_SERVER, ...) are left out
    assert set(shown["EnvironmentVariables"]) == (
        set(real["EnvironmentVariables"]) - launchd_files.FROM_SHELL
    )
    path, shown_path = (d["EnvironmentVariables"]["PATH"].split(":") for d in (real, shown))
    assert shown_path[1:] == path[1:] and shown_path[0] != path[0]
    assert shown["StandardOutPath"] == f"{launchd_files.MACSERVE_HOME}/logs/tiny-mla.log"


def test_launchd_plists_command_writes_and_checks(tmp_path):
    """`macserve dev launchd-plists --check` fails on a changed, missing or extra file; without
    --check it rewrites them (into a copy of the repo's launchd/ and profiles/)."""
    from click.testing import CliRunner

    from macserve.cli import main

    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    shutil.copytree(REPO / "launchd", tmp_path / "launchd")

    def run(*args):
        return CliRunner().invoke(main, ["dev", "launchd-plists", "--repo", str(tmp_path), *args])

    assert run("--check").exit_code == 0
    demo = tmp_path / "launchd" / "dev.macserve.tiny-mla.plist"
    demo.write_bytes(demo.read_bytes().replace(b"<integer>30<", b"<integer>10<"))
    (tmp_path / "launchd" / "dev.macserve.router.plist").unlink()
    (tmp_path / "launchd" / "dev.macserve.old.plist").write_bytes(b"")
    r = run("--check")
    assert r.exit_code == 1
    assert [l.split()[0] for l in r.stdout.splitlines()] == [
        "launchd/dev.macserve.old.plist",
        "launchd/dev.macserve.router.plist",
        "launchd/dev.macserve.tiny-mla.plist",
    ]
    assert run().exit_code == 0
    assert run("--check").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "launchd").iterdir()) == [
        "LaunchDaemons",
        "README.md",
        "dev.macserve.router.plist",
        "dev.macserve.tiny-mla.plist",
    ]
