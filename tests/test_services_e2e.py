"""End to end with real processes: the `macserve` CLI in subprocesses, a real supervisord, a
real llama-server (and mlx_lm.server) serving the project's own tiny MLA+MTP model, real HTTP
on loopback. Every wait polls with a deadline; supervisord is shut down in teardown.
"""

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from macserve.services.profiles import Profile, ProfileStore
from macserve.services.share import share

from .conftest import REPO, TINY_MODEL
from .fixtures import (
    cli,
    free_port,
    interruptible,
    poll,
    runs_in,
    status,
    supervisord_pid,
)

pytestmark = pytest.mark.e2e


def n_ctx(port) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/props", timeout=10).json()[
        "default_generation_settings"
    ]["n_ctx"]


def set_interrupted(sig, *assignments) -> subprocess.CompletedProcess:
    """`macserve set` in the background, `sig` sent once it is waiting for health."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MACSERVE_SERVICE_BACKEND="supervisor")
    with interruptible():
        p = subprocess.Popen(
            [sys.executable, "-m", "macserve", "set", *assignments],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    first = p.stderr.readline()  # "waiting for NAME to become healthy ..." (not a terminal)
    assert first.startswith("waiting for"), first
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, first + err)


def test_llama_cpp_service_end_to_end(llama_server, model_gguf, services, macserve_home):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    profile = macserve_home / "profiles" / "tiny.env"

    # new: inspect sizes the context (the model's own 1024 limit fits), MTP drafting is added
    # because the model has an MTP layer and this llama-server lists draft-mtp in --help
    r = cli(
        "new", str(model_gguf), "--name", "tiny", "--port", str(port), "--extra-args", "-t 1 -np 1"
    )
    assert r.returncode == 0, r.stderr
    assert f"tiny: started, healthy at {url}/v1" in r.stdout
    # -np is PARALLEL now (1, the default: no key); the share gives llama-server -np itself
    assert "CTX=1024\nEXTRA_ARGS='--spec-type draft-mtp -t 1'" in profile.read_text()
    assert "moved -np 1 out of EXTRA_ARGS" in r.stderr
    s = status("tiny")
    assert (s["state"], s["healthy"], s["port"]) == ("running", True, port)
    pid1 = s["pid"]
    services.append(pid1)
    # `macserve run` stays llama-server's parent (it drains it on a stop: graceful.py)
    assert [c.name() for c in psutil.Process(pid1).children()] == ["llama-server"]
    assert n_ctx(port) == 1024

    # a chat completion answers
    resp = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "Who's there?"}], "max_tokens": 8},
    )
    assert resp.status_code == 200
    body = resp.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1

    rows = json.loads(cli("ls", "--json").stdout)
    assert [(x["name"], x["state"], x["pid"]) for x in rows] == [("tiny", "running", pid1)]
    assert rows[0]["rss_bytes"] > 0 and rows[0]["uptime_s"] is not None

    # set the context and cache type: the service restarts by itself; the flags `new`
    # computed stay
    r = cli("set", "tiny", "--", "CTX=512", "KV=q8_0")
    assert r.returncode == 0, r.stderr
    assert "restarted, healthy" in r.stdout
    text = profile.read_text()
    assert "CTX=512\n" in text and "KV=q8_0\n" in text
    assert "EXTRA_ARGS='--spec-type draft-mtp -t 1'\n" in text
    pid2 = status("tiny")["pid"]
    services.append(pid2)
    assert pid2 != pid1 and not psutil.pid_exists(pid1)
    assert n_ctx(port) == 512
    server2 = psutil.Process(pid2).children()[0]
    assert "-c 512 -ctk q8_0 -ctv q8_0" in " ".join(server2.cmdline())

    # kill -9: supervisord brings it back, nobody asks
    os.kill(pid2, signal.SIGKILL)
    s = poll(
        lambda: (lambda s: s if s["healthy"] and s["pid"] not in (None, pid2) else None)(
            status("tiny")
        ),
        "the service to come back after kill -9",
    )
    pid3 = s["pid"]
    services.append(pid3)
    assert n_ctx(port) == 512

    # a flag the installed llama-server does not have: refused before any restart
    before = profile.read_bytes()
    r = cli("set", "tiny", "--", "EXTRA_ARGS=-c 512 --no-such-flag")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: llama-server does not accept --no-such-flag (checked against its --help)"
    ]
    assert profile.read_bytes() == before
    assert status("tiny")["pid"] == pid3

    # ports: one another profile has, one another program listens on: refused, no restart
    other = free_port()
    r = cli("new", str(model_gguf), "--name", "other", "--port", str(other), "--no-start")
    assert r.returncode == 0, r.stderr
    r = cli("set", "tiny", "--", f"PORT={other}")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        f"error: port {other} is already used by profile other",
    )
    assert cli("rm", "other").returncode == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        r = cli("set", "tiny", "--", f"PORT={taken}")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        f"error: port {taken} on 127.0.0.1 is in use by another program",
    )
    assert profile.read_bytes() == before
    assert status("tiny")["pid"] == pid3

    # passes --help, fails at start (the adapter file does not exist): rolled back, and the
    # one-line error carries llama-server's own first error line from the log
    r = cli("set", "tiny", "--", "EXTRA_ARGS+=--lora /nonexistent/adapter.gguf")
    assert r.returncode == 2, r.stdout
    err = r.stderr.strip().splitlines()
    assert "failed to load lora adapter '/nonexistent/adapter.gguf'" in r.stderr  # the log tail
    assert err[-1].startswith(
        "error: new settings for tiny failed: llama_adapter_lora_init: failed to open "
        "'/nonexistent/adapter.gguf': No such file or directory (it exited"
    ), err[-1]
    assert err[-1].endswith("previous settings restored and healthy")
    assert profile.read_bytes() == before
    s = status("tiny")
    assert s["state"] == "running" and s["healthy"] and s["pid"] != pid3
    services.append(s["pid"])
    assert n_ctx(port) == 512

    # Ctrl-C (and SIGTERM) while set waits for the new settings: the previous ones come back
    for sig in (signal.SIGINT, signal.SIGTERM):
        r = set_interrupted(sig, "tiny", "--", "EXTRA_ARGS+=-c 256")
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            "error: interrupted while the new settings for tiny were starting; "
            "previous settings restored and healthy"
        )
        assert profile.read_bytes() == before
        s = status("tiny")
        assert s["healthy"]
        services.append(s["pid"])
        assert n_ctx(port) == 512

    r = cli("logs", "tiny", "-n", "200")
    assert r.returncode == 0 and "macserve run tiny:" in r.stdout

    # stop / start
    assert cli("stop", "tiny").returncode == 0
    assert status("tiny")["state"] == "stopped"
    r = cli("start", "tiny")
    assert r.returncode == 0, r.stderr
    s = status("tiny")
    assert s["healthy"]
    services.append(s["pid"])
    r = cli("restart", "tiny")
    assert r.returncode == 0, r.stderr
    s2 = status("tiny")
    assert s2["healthy"] and s2["pid"] != s["pid"]
    s = s2
    services.append(s["pid"])

    # rm: stops and uninstalls first, then the profile goes; the last one takes the private
    # supervisord with it
    daemon = supervisord_pid(macserve_home)
    assert daemon and psutil.pid_exists(daemon)
    last = s["pid"]
    r = cli("rm", "tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads(cli("ls", "--json").stdout) == []
    assert not profile.exists()
    assert not (macserve_home / "supervisor" / "programs" / "tiny.conf").exists()
    assert not psutil.pid_exists(last) or psutil.Process(last).status() == psutil.STATUS_ZOMBIE
    poll(lambda: not psutil.pid_exists(daemon), "supervisord to exit after the last rm", 30)


def files_not_0600(root: Path):
    for p in root.rglob("*"):
        if p.is_file() and (p.stat().st_mode & 0o777) != 0o600:
            yield p


def test_api_key_enforced_and_kept_secret(llama_server, model_gguf, services, macserve_home):
    """`set API_KEY=` (and HF_TOKEN=): the key is enforced and reaches the server only through
    its environment: not in argv (ps), show, ls, the logs, or any file that is not 0600."""
    port = free_port()
    # fresh per run: the argv scan below sees every process on the machine, and a suite running
    # beside this one passes its own key to `macserve set` in argv (as this test does)
    key, token = (
        f"sk-macserve-test-{secrets.token_hex(6)}",
        f"hf_macservetest{secrets.token_hex(6)}",
    )
    r = cli("new", str(model_gguf), "--name", "tiny", "--port", str(port), "--extra-args", "-t 1")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    r = cli("set", "tiny", "--", f"API_KEY={key}", f"HF_TOKEN={token}")
    assert r.returncode == 0, r.stderr
    s = status("tiny")
    assert s["healthy"]  # /health stays open for monitors
    services.append(s["pid"])
    models = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(models, timeout=10).status_code == 401
    ok = httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200
    # given to the server in its environment, under the names it reads
    server = psutil.Process(s["pid"]).children()[0]  # `macserve run`'s child (graceful.py)
    environ = open(f"/proc/{server.pid}/environ", "rb").read().split(b"\0")
    assert f"LLAMA_API_KEY={key}".encode() in environ
    assert f"HF_TOKEN={token}".encode() in environ
    secrets_file = macserve_home / "profiles" / "tiny.secrets"
    assert (secrets_file.stat().st_mode & 0o777) == 0o600
    # chat finds the key in the profile's secrets
    r = cli("chat", "tiny", "Who's there?")
    assert r.returncode == 0, r.stderr
    # ...and nowhere else
    shown = cli("show", "tiny").stdout + cli("show", "tiny", "--json").stdout
    shown += cli("ls", "--json").stdout + cli("status", "--json").stdout
    assert "API_KEY set" in shown and key not in shown and token not in shown
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        assert key not in line and token not in line, proc
    leaked = [p for p in files_not_0600(macserve_home) if key.encode() in p.read_bytes()]
    leaked += [p for p in files_not_0600(macserve_home) if token.encode() in p.read_bytes()]
    assert not leaked
    assert list((macserve_home / "logs").glob("tiny.log*"))  # the logs were searched
    # a key typed into EXTRA_ARGS is moved to the secrets file, with a note
    r = cli("set", "tiny", "--", "EXTRA_ARGS+=--api-key sk-other-key-77")
    assert r.returncode == 0, r.stderr
    assert "moved API_KEY out of EXTRA_ARGS" in r.stdout
    assert "sk-other-key-77" not in (macserve_home / "profiles" / "tiny.env").read_text()
    assert "API_KEY=sk-other-key-77" in secrets_file.read_text()
    services.append(status("tiny")["pid"])
    ok = httpx.get(models, headers={"Authorization": "Bearer sk-other-key-77"}, timeout=10)
    assert ok.status_code == 200
    # API_KEY= removes it
    r = cli("set", "tiny", "--", "API_KEY=", "HF_TOKEN=")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    assert httpx.get(models, timeout=10).status_code == 200
    assert not secrets_file.exists()
    assert cli("rm", "tiny").returncode == 0


def test_previous_settings_already_failing(llama_server, model_gguf, services, macserve_home):
    """A set on a service that was crash-looping does not "roll back" into the crash loop:
    it says so, puts the file back and leaves the service stopped."""
    port = free_port()
    profile = macserve_home / "profiles" / "tiny.env"
    r = cli("new", str(model_gguf), "--name", "tiny", "--port", str(port), "--extra-args", "-t 1")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    # broken by hand (the checks are bypassed), restarted without waiting: a crash loop
    profile.write_text(profile.read_text().replace("-t 1", "-t 1 --lora /nonexistent/a.gguf"))
    broken = profile.read_bytes()
    assert cli("restart", "tiny", "--no-wait").returncode == 0
    log = macserve_home / "logs" / "tiny.log"
    poll(lambda: "back-off 2s" in log.read_text(), "two quick respawns in a row")
    r = cli("set", "tiny", "--", "EXTRA_ARGS+=--lora /nonexistent/b.gguf")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: new settings for tiny failed: llama_adapter_lora_init: ")
    assert "the previous settings were already failing before this change" in last
    assert last.endswith(
        "so they are back in the profile but not restarted: tiny is stopped "
        "(fix it with macserve set tiny ..., then macserve start tiny)"
    )
    assert profile.read_bytes() == broken
    assert status("tiny")["state"] == "stopped"
    r = cli("set", "tiny", "--", "EXTRA_ARGS-=--lora")
    assert r.returncode == 0 and "tiny is stopped, so nothing was restarted" in r.stdout
    r = cli("start", "tiny")
    assert r.returncode == 0, r.stderr
    s = status("tiny")
    assert s["healthy"]
    services.append(s["pid"])
    assert cli("rm", "tiny").returncode == 0


def test_slow_failing_server_backs_off(services, macserve_home):
    """The engine refusing --ctx beyond the model's limit exits after its imports (over
    supervisord's startsecs), which supervisord would respawn at once, forever; `macserve run`
    spaces the respawns 1, 2, 4 s ... and the error says what the server said."""
    port = free_port()
    # written by hand: `new` and `set` refuse a CTX beyond the model's limit before writing
    values = {"PROVIDER": "macserve", "MODEL": str(TINY_MODEL), "PORT": str(port), "CTX": "99999"}
    ProfileStore().save(Profile("bad", values))
    assert cli("start", "bad", "--no-wait").returncode == 0
    log = macserve_home / "logs" / "bad.log"
    poll(lambda: "back-off 4s" in log.read_text(), "three respawns", 120)
    text = log.read_text()
    delays = [int(d) for d in re.findall(r"back-off (\d+)s", text)]
    assert delays[:3] == [1, 2, 4]
    assert "error: --ctx 99999 is more than the model's limit 1024" in text
    r = cli("restart", "bad", "--timeout", "120")
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: bad is not healthy: --ctx 99999 is more than the model's limit 1024 (it "
        )
    )
    assert cli("rm", "bad").returncode == 0


def test_launchd_log_rotates_by_size_while_running(llama_server, model_gguf, macserve_home):
    """What the launchd plist runs (MACSERVE_ROTATE_LOGS): the log is copy-truncated whenever
    it passes MACSERVE_LOG_MAX_BYTES, while the same server keeps running and writing."""
    from macserve.services.profiles import Profile, ProfileStore

    port = free_port()
    ProfileStore().save(
        Profile(
            "rot",
            {
                "PROVIDER": "llama.cpp",
                "MODEL": str(model_gguf),
                "PORT": str(port),
                "EXTRA_ARGS": "-t 1",
            },
        )
    )
    log = macserve_home / "rot.log"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        MACSERVE_ROTATE_LOGS=str(log),
        MACSERVE_LOG_MAX_BYTES="1500",
        MACSERVE_LOG_CHECK_SECONDS="0.2",
    )
    run_cmd = [sys.executable, "-m", "macserve", "run", "rot"]

    def ours() -> list:
        # this test's processes only: a suite running beside this one runs the same command
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] == run_cmd and runs_in(p, macserve_home)
        ]

    with open(log, "ab") as f:
        server = subprocess.Popen(run_cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        poll(
            lambda: (
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                if _listening(port)
                else False
            ),
            "llama-server",
            60,
        )
        first = log.with_name("rot.log.1")
        poll(first.exists, "the first rotation")
        for _ in range(40):  # each request logs a few lines: enough for a second rotation
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "a", "max_tokens": 2},
                timeout=30,
            )
            if log.with_name("rot.log.2").exists():
                break
        assert log.with_name("rot.log.2").exists()
        # `macserve run` stays llama-server's parent (graceful.py); the watcher beside them
        assert server.poll() is None
        assert [c.name() for c in psutil.Process(server.pid).children()] == ["llama-server"]
        assert "macserve run rot:" in log.with_name("rot.log.2").read_text()
        assert len(ours()) == 2  # `macserve run` (the server's parent) and the watcher
    finally:
        server.terminate()
        server.wait(30)
    poll(
        lambda: not ours(),
        "the log watcher to exit with its server",
        30,
    )


def _listening(port) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_mlx_service_ready_means_a_completion(tiny_mlx_f32, services, macserve_home):
    port = free_port()
    r = cli("new", str(tiny_mlx_f32), "--name", "tiny-mlx", "--port", str(port), "--timeout", "120")
    assert r.returncode == 0, r.stderr
    assert "mlx has no context-size flag: macserve refuses a prompt past" in r.stderr
    text = (macserve_home / "profiles" / "tiny-mlx.env").read_text()
    assert "PROVIDER=mlx" in text
    s = status("tiny-mlx")
    assert s["healthy"]
    services.append(s["pid"])
    # readiness was a real one-token completion, visible in the server's log
    log = cli("logs", "tiny-mlx", "-n", "500").stdout
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "Who's there?"}], "max_tokens": 4},
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    # CTX and KV on mlx: KV=q8 is --kv-bits 8; mlx_lm.server has no context flag, so CTX is
    # kept by macserve's shim (not on its command line); inspect models no q8 cache of mlx-lm's,
    # so its share is unknown until MEMORY= gives one
    r = cli("set", "tiny-mlx", "--", "CTX=512", "KV=q8", timeout=300)
    assert r.returncode == 0, r.stderr
    s2 = status("tiny-mlx")
    assert s2["healthy"] and s2["pid"] != s["pid"]
    services.append(s2["pid"])
    cmd = psutil.Process(s2["pid"]).cmdline()
    assert cmd[cmd.index("--kv-bits") + 1] == "8" and "512" not in cmd
    d = json.loads(cli("doctor", "--json").stdout)
    row = next(p for p in d["profiles"] if p["name"] == "tiny-mlx")
    assert (row["ctx"], row["cache_key"]) == (512, None)
    assert "has no context flag" in row["note"] and "does not model a q8 cache" in row["error"]
    assert cli("rm", "tiny-mlx").returncode == 0


def test_engine_service_new_set_chat(services, macserve_home):
    """The README demo's path: the project's model on macserve's own engine, supervised, with
    an API key."""
    port = free_port()
    key = "sk-engine-test-91"
    r = cli(
        "new",
        str(TINY_MODEL),
        "--provider",
        "macserve",
        "--name",
        "tiny-engine",
        "--port",
        str(port),
        "--timeout",
        "120",
        "--api-key",
        key,
    )
    assert r.returncode == 0, r.stderr
    profile = (macserve_home / "profiles" / "tiny-engine.env").read_text()
    assert "PROVIDER=macserve" in profile and "--mtp-k 1" in profile and key not in profile
    first = status("tiny-engine")
    assert first["healthy"]
    services.append(first["pid"])
    environ = open(f"/proc/{first['pid']}/environ", "rb").read().split(b"\0")
    assert f"MACSERVE_API_KEY={key}".encode() in environ  # `serve` reads it there
    models = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(models, timeout=10).status_code == 401
    assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=10).is_success
    # serve's own click parser checks the values before any restart (not its --help text)
    r = cli("set", "tiny-engine", "--", "EXTRA_ARGS+=--mtp-k x")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "error: macserve serve: Invalid value for '--mtp-k': 'x' is not a valid integer range.",
    )
    # a cache type the engine does not have: the provider's own names, refused before a restart
    r = cli("set", "tiny-engine", "--", "KV=int3")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "error: KV int3: macserve serve caches bf16 | int2 | auto",
    )
    assert status("tiny-engine")["pid"] == first["pid"]
    r = cli("set", "tiny-engine", "--", "CTX=512", "KV=int2", timeout=300)
    assert r.returncode == 0, r.stderr
    second = status("tiny-engine")
    assert second["healthy"] and second["pid"] != first["pid"]
    services.append(second["pid"])
    cmd = " ".join(psutil.Process(second["pid"]).cmdline())
    s = share("tiny-engine")  # the engine's whole share, one sequence, its prompt cache
    assert cmd.endswith(
        f"--ctx 512 --kv int2 --memory {s.share_bytes}B --max-batch 1 "
        f"--prompt-cache-bytes {s.prompt_cache_bytes}B --mtp-k 1"
    )
    # one profile: `chat "a prompt"` asks it (with the profile's key)
    r = cli("chat", "What country, friends, is this?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # the stats line reports MTP drafting done by the INT2-cache engine
    assert "draft acceptance" in r.stderr, r.stderr
    assert cli("rm", "tiny-engine").returncode == 0
