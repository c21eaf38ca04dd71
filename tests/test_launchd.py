"""launchd backend: the rendered plist, key by key, and the exact launchctl command sequences.

launchctl is the one fake in the test suite: a small script that appends its argv as a JSON line
to a file, keeps which labels are loaded in a JSON state file, and answers `print` the way
launchctl does (a tab-indented property block, or exit 113 for an unknown service).
"""

import json
import os
import plistlib
import sys
import textwrap

import pytest

from macserve.services.profiles import Profile, ProfileStore
from macserve.services.supervisors import log_path, spec_for
from macserve.services.supervisors.launchd import LaunchdBackend, parse_print, render_plist

UID = os.getuid()
DOMAIN = f"gui/{UID}"

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, plistlib, sys
    log, state_file = os.environ["FAKE_LAUNCHCTL_LOG"], os.environ["FAKE_LAUNCHCTL_STATE"]
    args = sys.argv[1:]
    with open(log, "a") as f:
        f.write(json.dumps(args) + "\\n")
    try:
        state = json.load(open(state_file))
    except FileNotFoundError:
        state = {{}}
    def save():
        json.dump(state, open(state_file, "w"))
    verb = args[0]
    if verb == "bootstrap":
        label = plistlib.load(open(args[2], "rb"))["Label"]
        if label in state:
            print("Bootstrap failed: 5: Input/output error", file=sys.stderr); sys.exit(5)
        state[label] = {{"pid": 4242, "runs": 1}}; save()
    elif verb == "bootout":
        label = args[1].rsplit("/", 1)[1]
        if label not in state:
            print("Boot-out failed: 3: No such process", file=sys.stderr); sys.exit(3)
        del state[label]; save()
    elif verb == "kickstart":
        label = args[-1].rsplit("/", 1)[1]
        if label not in state:
            print("Could not find service", file=sys.stderr); sys.exit(113)
        if "-k" in args:
            state[label]["pid"] += 1; state[label]["runs"] += 1; save()
    elif verb == "print":
        label = args[1].rsplit("/", 1)[1]
        if label not in state:
            print(f"Could not find service \\"{{label}}\\" in domain for user gui: {uid}", file=sys.stderr)
            sys.exit(113)
        s = state[label]
        print(f"{{args[1]}} = {{{{\\n\\tactive count = 1\\n\\tpath = /x.plist\\n\\ttype = LaunchAgent\\n"
              f"\\tstate = running\\n\\n\\tprogram = /usr/bin/python3\\n\\targuments = {{{{\\n\\t\\tpython3\\n\\t}}}}\\n\\n"
              f"\\truns = {{s['runs']}}\\n\\tpid = {{s['pid']}}\\n\\tlast exit code = (never exited)\\n\\n"
              f"\\tspawn type = interactive (4)\\n\\tendpoints = {{{{\\n\\t\\tstate = active\\n\\t}}}}\\n}}}}")
    elif verb in ("enable", "disable"):
        pass
    else:
        sys.exit(64)
""")


@pytest.fixture
def launchctl(tmp_path, monkeypatch):
    exe = tmp_path / "launchctl"
    exe.write_text(STAND_IN.format(python=sys.executable, uid=UID))
    exe.chmod(0o755)
    calls = tmp_path / "launchctl.calls"
    monkeypatch.setenv("MACSERVE_LAUNCHCTL", str(exe))
    monkeypatch.setenv("FAKE_LAUNCHCTL_LOG", str(calls))
    monkeypatch.setenv("FAKE_LAUNCHCTL_STATE", str(tmp_path / "launchctl.state"))
    monkeypatch.setenv("MACSERVE_LAUNCH_AGENTS", str(tmp_path / "LaunchAgents"))
    monkeypatch.setenv("MACSERVE_SERVICE_BACKEND", "launchd")
    monkeypatch.delenv("MACSERVE_LAUNCHD_DOMAIN", raising=False)

    def take():
        """The calls made since the last take()."""
        if not calls.exists():
            return []
        out = [json.loads(l) for l in calls.read_text().splitlines()]
        calls.unlink()
        return out

    return take


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
    d = plistlib.loads(render_plist(spec).encode())
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
    assert d["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert d["RunAtLoad"] is True
    assert d["ThrottleInterval"] == 30
    assert d["ExitTimeOut"] == 20
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
        "RunAtLoad",
        "KeepAlive",
        "ThrottleInterval",
        "ExitTimeOut",
        "ProcessType",
        "SoftResourceLimits",
        "StandardOutPath",
        "StandardErrorPath",
    }


def test_provider_env_lands_in_the_plist(macserve_home):
    from macserve.services import providers

    p = _profile(provider="mlx", model="mlx-community/Foo-4bit")
    d = plistlib.loads(render_plist(_spec(p, providers.get("mlx").env(p))).encode())
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


def test_command_sequences(launchctl, macserve_home, tmp_path):
    b = LaunchdBackend()
    target = f"{DOMAIN}/dev.macserve.big"
    plist = tmp_path / "LaunchAgents" / "dev.macserve.big.plist"
    p = _profile()

    # install: write the plist, enable (a disabled job refuses to bootstrap), bootstrap
    b.apply(_spec(p))
    assert plist.exists() and oct(plist.stat().st_mode & 0o777) == "0o644"
    assert launchctl() == [["print", target], ["enable", target], ["bootstrap", DOMAIN, str(plist)]]
    st = b.status("big")
    assert (st.state, st.pid, st.runs) == ("running", 4242, 1)
    launchctl()

    # set, plist unchanged (only the profile changed; `macserve run` rereads it): kickstart -k
    b.apply(_spec(p.updated({"EXTRA_ARGS": "-c 4096"})))
    assert launchctl() == [["print", target], ["kickstart", "-k", target]]
    assert b.status("big").pid == 4243
    launchctl()

    # set with a plist change (mlx adds PYTHONUNBUFFERED): kickstart would not reread the
    # plist, so bootout, wait until launchd no longer knows it, then bootstrap the new file
    before = plist.read_bytes()
    b.apply(_spec(p.updated({"PROVIDER": "mlx"}), {"PYTHONUNBUFFERED": "1"}))
    assert plist.read_bytes() != before
    assert launchctl() == [
        ["print", target],
        ["bootout", target],
        ["print", target],
        ["enable", target],
        ["bootstrap", DOMAIN, str(plist)],
    ]

    # stop: bootout, wait, disable (so it does not come back at login)
    b.stop("big")
    assert launchctl() == [
        ["print", target],
        ["bootout", target],
        ["print", target],
        ["disable", target],
    ]
    assert b.status("big").state == "stopped" and plist.exists()
    launchctl()

    # start again: enable + bootstrap
    b.start("big")
    assert launchctl() == [["print", target], ["enable", target], ["bootstrap", DOMAIN, str(plist)]]

    # remove: bootout, wait, delete the plist
    b.uninstall("big")
    assert launchctl() == [["print", target], ["bootout", target], ["print", target]]
    assert not plist.exists()
    assert b.status("big").state == "not installed"
    assert launchctl() == []  # no plist: status does not even ask launchctl


def test_cli_through_launchd(launchctl, macserve_home, tmp_path):
    """rm through the CLI on the launchd backend: bootout before the profile goes."""
    from click.testing import CliRunner

    from macserve.cli import main

    ProfileStore().save(_profile())
    LaunchdBackend().install(_spec(_profile()))
    LaunchdBackend()._bootstrap("big")
    launchctl()
    r = CliRunner().invoke(main, ["ls", "--json"])
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)[0]
    assert (row["name"], row["state"], row["pid"]) == ("big", "running", 4242)
    launchctl()
    r = CliRunner().invoke(main, ["rm", "big"])
    assert r.exit_code == 0, r.stderr
    target = f"{DOMAIN}/dev.macserve.big"
    assert launchctl() == [["print", target], ["bootout", target], ["print", target]]
    assert not ProfileStore().exists("big")
