"""launchd across domains: one label is one job (a copy in another domain is booted out before
a load), the LaunchDaemon a SYSTEM=1 profile gets (root only, with the exact sudo command
otherwise), a hung launchctl as one line, and every key macserve writes checked against
launchd.plist(5).

Against the recording `launchctl` stand-in (tests/fixtures.py), which refuses what launchd
refuses: a second bootstrap of a label into the same domain, a bootout of a label that is not
loaded, a session type that does not match the domain, a change to the system domain by
anyone but root.
"""

import os
import plistlib
import pwd
import subprocess
import sys

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.errors import MacserveError
from macserve.services import providers
from macserve.services.profiles import Profile, ProfileStore
from macserve.services.supervisors import launchd_ctl, launchd_domains, launchd_files, spec_for
from macserve.services.supervisors.launchd import LaunchdBackend
from macserve.services.supervisors.launchd_plist import render_plist

from .conftest import REPO
from .fixtures import DOMAIN, TINY_MODEL, UID

LABEL = "dev.macserve.big"

# launchd.plist(5), the keys and their types as the man page gives them (macOS 14/15). A key
# two types may take (KeepAlive: boolean or dictionary) lists both.
PLIST5 = {
    "Label": str,
    "Disabled": bool,
    "UserName": str,
    "GroupName": str,
    "inetdCompatibility": dict,
    "LimitLoadToHosts": list,
    "LimitLoadFromHosts": list,
    "LimitLoadToSessionType": (str, list),
    "LimitLoadToHardware": dict,
    "LimitLoadFromHardware": dict,
    "Program": str,
    "ProgramArguments": list,
    "EnableGlobbing": bool,
    "EnableTransactions": bool,
    "EnablePressuredExit": bool,
    "OnDemand": bool,
    "ServiceIPC": bool,
    "KeepAlive": (bool, dict),
    "RunAtLoad": bool,
    "RootDirectory": str,
    "WorkingDirectory": str,
    "EnvironmentVariables": dict,
    "Umask": int,
    "TimeOut": int,
    "ExitTimeOut": int,
    "ThrottleInterval": int,
    "InitGroups": bool,
    "WatchPaths": list,
    "QueueDirectories": list,
    "StartOnMount": bool,
    "StartInterval": int,
    "StartCalendarInterval": (dict, list),
    "StandardInPath": str,
    "StandardOutPath": str,
    "StandardErrorPath": str,
    "Debug": bool,
    "WaitForDebugger": bool,
    "SoftResourceLimits": dict,
    "HardResourceLimits": dict,
    "Nice": int,
    "ProcessType": str,
    "AbandonProcessGroup": bool,
    "LowPriorityIO": bool,
    "LowPriorityBackgroundIO": bool,
    "MaterializeDatalessFiles": bool,
    "LaunchOnlyOnce": bool,
    "MachServices": dict,
    "Sockets": dict,
    "LaunchEvents": dict,
    "SessionCreate": bool,
    "LegacyTimers": bool,
    "AssociatedBundleIdentifiers": (str, list),
}
KEEPALIVE = {
    "SuccessfulExit": bool,
    "NetworkState": bool,
    "PathState": dict,
    "OtherJobEnabled": dict,
    "AfterInitialDemand": dict,
    "Crashed": bool,
}
RESOURCE_LIMITS = (
    "Core",
    "CPU",
    "Data",
    "FileSize",
    "MemoryLock",
    "NumberOfFiles",
    "NumberOfProcesses",
    "ResidentSetSize",
    "Stack",
)
PROCESS_TYPES = ("Background", "Standard", "Adaptive", "Interactive")
SESSION_TYPES = ("Aqua", "Background", "LoginWindow", "StandardIO", "System")


def _bad_keys(d: dict) -> list[str]:
    """What in `d` launchd.plist(5) does not document, or documents with another type."""
    bad = [k for k, v in d.items() if k not in PLIST5 or not isinstance(v, PLIST5[k])]
    # bool is an int in Python: an integer key holding True would pass isinstance
    bad += [k for k, v in d.items() if PLIST5.get(k) is int and isinstance(v, bool)]
    ka = d.get("KeepAlive", {})
    if isinstance(ka, dict):
        bad += [f"KeepAlive.{k}" for k, v in ka.items() if not isinstance(v, KEEPALIVE.get(k, ()))]
    for key in ("SoftResourceLimits", "HardResourceLimits"):
        for k, v in d.get(key, {}).items():
            if k not in RESOURCE_LIMITS or type(v) is not int:
                bad.append(f"{key}.{k}")
    if not all(type(a) is str for a in d.get("ProgramArguments", [])):
        bad.append("ProgramArguments")
    if not all(type(v) is str for v in d.get("EnvironmentVariables", {}).values()):
        bad.append("EnvironmentVariables")
    if d.get("ProcessType", "Standard") not in PROCESS_TYPES:
        bad.append("ProcessType")
    if d.get("LimitLoadToSessionType", "Aqua") not in SESSION_TYPES:
        bad.append("LimitLoadToSessionType")
    return bad


def _profile(**extra):
    values = {"PROVIDER": "llama.cpp", "MODEL": "/models/big.gguf", "PORT": "8080", **extra}
    return Profile("big", values)


def _demo(**extra):
    """The demo model on macserve's engine: a profile `start` accepts (its model exists)."""
    return _profile(PROVIDER="macserve", MODEL=str(TINY_MODEL), **extra)


def _spec(p):
    return spec_for(p, providers.for_profile(p).env(p))


def _probe(uid=UID):
    return [["print", f"{d}/{LABEL}"] for d in (f"gui/{uid}", f"user/{uid}", "system")]


def _loaded(launchctl) -> list[str]:
    import json

    return sorted(k for k in json.loads(launchctl.state.read_text()) if not k.startswith("_"))


def test_every_key_is_a_launchd_plist5_key(macserve_home):
    """The checked-in plists (agents and daemons) and the ones rendered here, for each domain."""
    assert _bad_keys({"RunAtLoad": 1, "KeepAlive": {"Crashed": "yes"}, "Nicety": 3}) == [
        "RunAtLoad",
        "Nicety",
        "KeepAlive.Crashed",
    ]
    files = sorted((REPO / "launchd").rglob("*.plist"))
    assert len(files) == len(launchd_files.render(REPO)) == 4
    plists = [plistlib.loads(f.read_bytes()) for f in files]
    spec = _spec(_profile())
    for dom in (DOMAIN, f"user/{UID}"):
        plists.append(plistlib.loads(render_plist(spec, dom)))
    plists.append(plistlib.loads(render_plist(spec, launchd_domains.SYSTEM, launchd_files.user())))
    for d in plists:
        assert _bad_keys(d) == [], d["Label"]
    assert {"UserName", "LimitLoadToSessionType"} <= {k for d in plists for k in d}


@pytest.mark.e2e
def test_stand_in_refuses_what_launchd_refuses(launchctl, macserve_home, tmp_path):
    """A second load into one domain and a bootout of an unloaded label fail; the same label
    in another domain loads (that is how a unit ends up running twice)."""
    gui, user = tmp_path / "gui.plist", tmp_path / "user.plist"
    gui.write_bytes(render_plist(_spec(_profile()), DOMAIN))
    user.write_bytes(render_plist(_spec(_profile()), f"user/{UID}"))

    def run(*args):
        return subprocess.run([os.environ["MACSERVE_LAUNCHCTL"], *args], capture_output=True)

    assert run("bootout", f"{DOMAIN}/{LABEL}").returncode != 0
    assert run("bootstrap", DOMAIN, str(gui)).returncode == 0
    assert run("bootstrap", DOMAIN, str(gui)).returncode != 0
    assert run("bootstrap", f"user/{UID}", str(gui)).returncode != 0  # Aqua in user/
    assert run("bootstrap", f"user/{UID}", str(user)).returncode == 0
    assert _loaded(launchctl) == [f"{DOMAIN}/{LABEL}", f"user/{UID}/{LABEL}"]


@pytest.mark.e2e
def test_start_boots_out_a_copy_in_another_domain(launchctl, macserve_home, tmp_path):
    """Loaded over SSH (user/), then started from a GUI shell whose plist says Aqua: the
    user/ copy is stopped and booted out before the gui/ one loads, so one server runs."""
    b = LaunchdBackend()
    spec = _spec(_profile())
    b.install(spec)
    over_ssh = tmp_path / "ssh.plist"
    over_ssh.write_bytes(render_plist(spec, f"user/{UID}"))
    launchd_ctl.run("bootstrap", f"user/{UID}", str(over_ssh))
    launchctl()
    b.start("big")
    user, gui = f"user/{UID}/{LABEL}", f"{DOMAIN}/{LABEL}"
    assert launchctl() == _probe() + [
        ["kill", "SIGTERM", user],
        ["print", user],
        ["bootout", user],
        ["print", user],
        ["enable", gui],
        ["bootstrap", DOMAIN, str(b.agent_path("big"))],
    ]
    assert _loaded(launchctl) == [gui]
    b.start("big")  # loaded where it belongs: kickstart, nothing booted out
    assert launchctl() == _probe() + [["kickstart", gui]]
    assert _loaded(launchctl) == [gui]


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="installs a LaunchDaemon: root only")
def test_system_profile_is_a_launchdaemon(launchctl, macserve_home, tmp_path, monkeypatch):
    """SYSTEM=1: the agent goes, a LaunchDaemon in the system domain comes, run as
    MACSERVE_HOME's owner (launchd loads it at boot: no login needed); SYSTEM=0 moves it back."""
    nobody = pwd.getpwnam("nobody")
    os.chown(macserve_home, nobody.pw_uid, nobody.pw_gid)
    daemons = tmp_path / "LaunchDaemons"
    monkeypatch.setenv("MACSERVE_LAUNCH_DAEMONS", str(daemons))
    b = LaunchdBackend()
    b.apply(_spec(_profile()))  # as an agent of nobody's
    gui = f"gui/{nobody.pw_uid}/{LABEL}"
    assert _loaded(launchctl) == [gui]
    launchctl()

    b.apply(_spec(_profile(SYSTEM="1")))
    daemon = daemons / f"{LABEL}.plist"
    system = f"system/{LABEL}"
    assert launchctl() == _probe(nobody.pw_uid) + [
        ["kill", "SIGTERM", gui],
        ["print", gui],
        ["bootout", gui],
        ["print", gui],
        ["enable", system],
        ["bootstrap", "system", str(daemon)],
    ]
    assert _loaded(launchctl) == [system]
    assert not b.agent_path("big").exists()
    assert oct(daemon.stat().st_mode & 0o777) == "0o644" and daemon.stat().st_uid == 0
    d = plistlib.loads(daemon.read_bytes())
    assert d["UserName"] == "nobody" and "LimitLoadToSessionType" not in d
    assert d["EnvironmentVariables"]["HOME"] == nobody.pw_dir
    log = d["StandardOutPath"]
    assert os.stat(log).st_uid == os.stat(os.path.dirname(log)).st_uid == nobody.pw_uid
    st = b.status("big")
    assert (st.state, st.pid) == ("running", 4243)
    launchctl()

    b.apply(_spec(_profile()))  # SYSTEM removed: back to an agent
    assert _loaded(launchctl) == [gui] and not daemon.exists()
    b.uninstall("big")
    assert _loaded(launchctl) == [] and not b.installed("big")


@pytest.mark.e2e
def test_system_profile_without_root_is_one_line(launchctl, macserve_home, monkeypatch):
    """Not root: one line naming the exact sudo command; nothing written, nothing loaded."""
    monkeypatch.setattr(launchd_domains, "is_root", lambda: False)
    monkeypatch.setattr(sys, "argv", ["macserve", "start", "big"])
    ProfileStore().save(_demo(SYSTEM="1"))
    r = CliRunner().invoke(main, ["start", "big", "--no-wait"])
    assert r.exit_code == 2
    want = f"sudo MACSERVE_HOME={macserve_home} {sys.executable} -m macserve start big"
    assert r.stderr.strip().endswith(want), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "needs root" in r.stderr
    assert not LaunchdBackend().installed("big")
    assert not launchctl.state.exists()
    with pytest.raises(MacserveError, match="SYSTEM"):
        Profile("big", {"PROVIDER": "llama.cpp", "MODEL": "/m.gguf", "PORT": "1", "SYSTEM": "y"})


@pytest.mark.e2e
def test_hung_launchctl_is_one_line(launchctl, macserve_home, monkeypatch):
    ProfileStore().save(_demo())
    monkeypatch.setattr(launchd_ctl, "LAUNCHCTL_TIMEOUT", 1.0)
    monkeypatch.setenv("FAKE_LAUNCHCTL_HANG", "1")
    r = CliRunner().invoke(main, ["start", "big", "--no-wait"])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"error: launchctl print {DOMAIN}/{LABEL} did not answer within 1s: launchd is hung "
        "or overloaded; nothing was changed after that call, try again"
    ]
    assert "Traceback" not in r.output
