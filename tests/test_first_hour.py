"""Issue 27, the first hour: what a new user meets. Real processes where a server is involved:
`macserve chat` in a pseudo-terminal against a real `macserve serve`, a stopped profile
started by `chat`, the router's cold start shown to the CLI, contexts refused before writing,
the INT2 default for a calibrated folder, Ctrl-C before a restart, profile-name completion."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest

from macserve.services.profiles import Profile, ProfileStore

from .conftest import REPO, TINY_MODEL
from .fixtures import cli, free_port, interruptible, poll, router_process, status
from .serverproc import serve


def environ(**more):
    """The CLI's environment, read when a process starts (MACSERVE_HOME is each test's)."""
    return dict(os.environ, PYTHONPATH=str(REPO), MACSERVE_SERVICE_BACKEND="supervisor", **more)


class Terminal:
    """`macserve ARGS` on a pseudo-terminal: keys in, the screen's bytes out."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the CLI as a user runs it, a terminal's foreground job
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # even when the suite runs with it ignored
            os.environ.update(environ(TERM="xterm", COLUMNS="200"))
            os.execv(sys.executable, [sys.executable, "-m", "macserve", *args])
        self.out = b""

    def read_until(self, pattern: bytes, timeout=120.0) -> bytes:
        """Until `pattern` shows in what arrives from now on."""
        end = time.monotonic() + timeout
        start = len(self.out)
        while not re.search(pattern, self.out[start:]):
            left = end - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.out[-2000:]!r}"
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                assert chunk, f"the terminal closed before {pattern!r}: {self.out[-2000:]!r}"
                self.out += chunk
        return self.out

    def wait_blocked(self, timeout=60.0) -> None:
        """Until the CLI sleeps (blocked reading the terminal). CPython's readline checks for
        signals only when its select() is interrupted (readline_until_enter_or_signal in
        Modules/readline.c): a Ctrl-C that lands between the prompt being drawn and that
        select() is lost, a window of microseconds for a person, long enough for a test on a
        loaded machine that types the moment the prompt shows."""
        import psutil

        proc = psutil.Process(self.pid)
        poll(lambda: proc.status() == psutil.STATUS_SLEEPING, "chat to wait for a key", timeout)

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout=30.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with_fd = select.select([self.fd], [], [], 0.2)[0]
            if with_fd:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:
                    pass
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(st)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"chat did not leave: {self.out[-2000:]!r}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("first-hour"), "--ctx", "1024") as s:
        yield s


PROMPT = rb"\n> $|^> $|\r> $"


@pytest.mark.e2e
def test_interactive_chat_in_a_terminal(server, macserve_home):
    """Line editing and history (Up recalls a line, kept in the config home), the Ctrl-C
    hint at the prompt, /bye, and the default max tokens."""
    t = Terminal("chat", server.url, "--temperature", "0")
    t.read_until(rb"/help for commands(.|\n)*> ")
    t.send(b"Good morrow\r")
    t.read_until(PROMPT)
    t.send(b"/clear\r")  # the second answer in a fresh context
    t.read_until(rb"\(conversation cleared\)\r?\n> ")
    mark = len(t.out)
    t.send(b"\x1b[A\x1b[A")  # Up, Up: the line typed before /clear, not ^[[A
    t.read_until(rb"Good morrow")
    t.send(b"\r")
    t.read_until(rb"\n> $")  # the second answer, then the prompt
    assert b"^[[A" not in t.out
    t.wait_blocked()  # readline is waiting for a key, not between the prompt and its select()
    t.send(b"\x03")  # Ctrl-C at the prompt: a hint, not an exit
    t.read_until(rb"\(Ctrl-D or /bye to leave\)\r?\n> ", timeout=20)
    t.send(b"/stats\r")
    t.read_until(rb"session: 2 answers, \d+ tokens")
    n = int(re.search(rb"last: (\d+) tokens", t.out[mark:]).group(1))
    assert 0 < n <= 512  # the default --max-tokens, not the server's whole context
    t.send(b"/bye\r")
    assert t.wait() == 0
    hist = (macserve_home / "chat_history").read_text()
    assert "Good morrow" in hist and "/bye" in hist


@pytest.mark.e2e
def test_chat_streams_the_routers_progress_and_max_tokens_default(server):
    """One-shot: 512 tokens at most unless asked (the server's own default is its context)."""
    r = cli("chat", server.url, "Speak.", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    n = int(r.stderr.split(" tokens", 1)[0])
    assert n <= 512


@pytest.mark.e2e
def test_chat_starts_a_stopped_profile_and_one_shape(services, macserve_home):
    port = free_port()
    r = cli(
        "new",
        str(TINY_MODEL),
        "--provider",
        "macserve",
        "--name",
        "tiny",
        "--ctx",
        "256",
        "--port",
        str(port),
        "--no-start",
    )
    assert r.returncode == 0, r.stderr
    r = cli("chat", "tiny", "Hail.", "--max-tokens", "4", timeout=300)
    assert r.returncode == 0, r.stderr
    url = f"http://127.0.0.1:{port}/v1"
    assert "tiny is not running: starting it" in r.stderr
    pid = status("tiny")["pid"]
    services.append(pid)
    assert f"tiny: started, healthy at {url} (pid {pid})" in r.stderr
    assert r.stdout.strip()
    assert (macserve_home / "run" / "used" / "tiny").exists()  # the router's idle clock
    # start / restart / stop: one shape
    r = cli("start", "tiny")
    assert r.stdout.strip() == f"tiny: already running, healthy at {url} (pid {pid})"
    r = cli("restart", "tiny", timeout=300)
    pid2 = status("tiny")["pid"]
    services.append(pid2)
    assert r.stdout.strip() == f"tiny: restarted, healthy at {url} (pid {pid2})", r.stderr
    r = cli("stop", "tiny")
    assert r.stdout.strip() == f"tiny: stopped, was at {url} (pid {pid2})"
    r = cli("start", "tiny", timeout=300)
    pid3 = status("tiny")["pid"]
    services.append(pid3)
    assert r.stdout.strip() == f"tiny: started, healthy at {url} (pid {pid3})"
    assert cli("rm", "tiny").returncode == 0


@pytest.mark.e2e
def test_router_cold_start_progress_and_model_name(services, macserve_home):
    port, rport = free_port(), free_port()
    r = cli(
        "new",
        str(TINY_MODEL),
        "--provider",
        "macserve",
        "--name",
        "tiny",
        "--ctx",
        "256",
        "--port",
        str(port),
        "--no-start",
    )
    assert r.returncode == 0, r.stderr
    # A keep-alive far longer than the start: the router's own comments never come, the
    # progress is chat's reading of the router's listing, from the first second.
    args = ["router", "--port", str(rport), "--ttl", "5m", "--keep-alive", "300"]
    with router_process(macserve_home, args, rport) as router:
        poll(lambda: "tiny" in (cli("ls").stdout), "ls")
        # `chat NAME` to a stopped profile a router serves: through the router, with progress
        r = cli("chat", "tiny", "Hail.", "--max-tokens", "4", timeout=300)
        assert r.returncode == 0, r.stderr
        assert f"asking the router at {router.url}" in r.stderr
        assert re.search(r"router: starting tiny \(\d+s\) \.\.\.", r.stderr), r.stderr
        services.append(status("tiny")["pid"])
        # answers carry the name asked for, not the upstream's
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        j = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert j["model"] == "tiny"
        with httpx.stream(
            "POST", router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            models = {m for m in re.findall(r'"model":\s*"([^"]*)"', s.read().decode())}
        assert models == {"tiny"}
    cli("stop", "tiny")


@pytest.mark.e2e
def test_context_beyond_the_model_refused_before_writing(macserve_home):
    r = cli("new", str(TINY_MODEL), "--name", "big", "--ctx", "99999", "--no-start")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --ctx 99,999: beyond the model's limit of 1,024")
    assert "largest context that fits is 1,024" in r.stderr and "nothing written" in r.stderr
    assert not (macserve_home / "profiles" / "big.env").exists()
    # also when it comes in --extra-args (llama.cpp's -c), and for set's CTX
    r = cli(
        "new",
        str(TINY_MODEL),
        "--provider",
        "macserve",
        "--name",
        "big",
        "--extra-args",
        "--ctx 5000",
        "--no-start",
    )
    assert r.returncode == 2 and "error: CTX 5,000: beyond the model's limit" in r.stderr
    assert not (macserve_home / "profiles" / "big.env").exists()
    r = cli(
        "new", str(TINY_MODEL), "--name", "m", "--provider", "mlx", "--ctx", "512", "--no-start"
    )
    assert r.returncode == 0, r.stderr
    before = (macserve_home / "profiles" / "m.env").read_text()
    r = cli("set", "m", "--", "CTX=2048")
    assert r.returncode == 2 and "CTX 2,048: beyond the model's limit of 1,024" in r.stderr
    assert (macserve_home / "profiles" / "m.env").read_text() == before


def test_context_beyond_the_budget_refused(macserve_home):
    """A GGUF with a huge limit on a small budget: the largest context that fits is named."""
    from macserve.services.create import refuse_ctx

    with pytest.raises(Exception, match=r"does not fit the 1.0 GB budget; the largest context"):
        refuse_ctx("--ctx", 200_000, 262_144, 50_000, 2**30, "llama.cpp/f16")
    refuse_ctx("--ctx", 40_000, 262_144, 50_000, 2**30, "llama.cpp/f16")  # fits: nothing said


@pytest.mark.e2e
def test_calibrated_folder_defaults_to_auto(macserve_home):
    r = cli("new", str(TINY_MODEL), "--provider", "macserve", "--name", "t", "--no-start")
    assert r.returncode == 0, r.stderr
    text = (macserve_home / "profiles" / "t.env").read_text()
    assert "PROVIDER=macserve" in text and "KV=auto" in text
    assert "note: the folder ships its calibration (latent-rotation.safetensors)" in r.stderr
    r = cli(
        "new",
        str(TINY_MODEL),
        "--name",
        "p",
        "--kv",
        "bf16",
        "--provider",
        "macserve",
        "--no-start",
    )
    assert "KV=bf16" in (macserve_home / "profiles" / "p.env").read_text()


@pytest.mark.e2e
def test_ctrl_c_before_a_restart_changes_nothing(tmp_path, macserve_home):
    slow = tmp_path / "llama-server"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    ProfileStore().save(
        Profile("g", {"PROVIDER": "llama.cpp", "MODEL": str(gguf), "PORT": str(free_port())})
    )
    before = (macserve_home / "profiles" / "g.env").read_text()
    with interruptible():
        p = subprocess.Popen(
            [sys.executable, "-m", "macserve", "set", "g", "--", "EXTRA_ARGS+=-t 2"],
            env=environ(MACSERVE_LLAMA_SERVER=str(slow)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    poll(
        lambda: any("sleep" in " ".join(c) for c in _children_cmdlines(p.pid)),
        "the server's flag check to run",
        timeout=60,
    )
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert err.strip() == "error: interrupted: nothing changed (g is as it was)"
    assert "Aborted" not in err
    assert (macserve_home / "profiles" / "g.env").read_text() == before


def test_a_detached_set_keeps_ignoring_what_its_shell_ignored():
    """`nohup macserve set ...` ignores SIGHUP, a background job SIGINT: the hangup or Ctrl-C
    meant for the terminal must not roll back the change; what is not ignored still is."""
    from macserve.services.health import Interrupts

    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Interrupts():
            signal.raise_signal(signal.SIGHUP)  # ignored: nothing happens
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, saved)


def _children_cmdlines(pid):
    import psutil

    try:
        return [c.cmdline() for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


@pytest.mark.e2e
def test_profile_names_complete(macserve_home):
    for n in ("tiny", "tiny-gguf", "other"):
        ProfileStore().save(Profile(n, {"PROVIDER": "mlx", "MODEL": "x", "PORT": str(8080)}))

    def complete(line):
        words = line.split(" ")
        env = environ(
            _MACSERVE_COMPLETE="bash_complete", COMP_WORDS=line, COMP_CWORD=str(len(words) - 1)
        )
        # as the installed `macserve` script runs it (its name is what the shell completes)
        script = "import sys; sys.argv[0] = 'macserve'; from macserve.cli import main; main()"
        r = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        return sorted(l.split(",", 1)[1] for l in r.stdout.splitlines() if "," in l)

    assert complete("macserve start ti") == ["tiny", "tiny-gguf"]
    assert complete("macserve chat o") == ["other"]
    assert complete("macserve set ") == ["other", "tiny", "tiny-gguf"]
