"""End to end with real processes: the `macserve` CLI in subprocesses, a real supervisord, a
real llama-server (and mlx_lm.server) serving the project's own tiny MLA+MTP model, real HTTP
on loopback. Every wait polls with a deadline; supervisord is shut down in teardown.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from macserve.services.supervisors.supervisord import SupervisorBackend

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "macserve" / "models" / "tiny-mla"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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


def status(name) -> dict:
    r = cli("status", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"][0]


def poll(fn, what, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def n_ctx(port) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/props", timeout=10).json()[
        "default_generation_settings"
    ]["n_ctx"]


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


@pytest.fixture
def model_gguf(request, tmp_path_factory):
    """The project's tiny model as GGUF: the lead's `tiny_gguf` fixture if conftest has one,
    else exported here (a 32 MB deepseek2 GGUF with one MTP layer, in well under a second)."""
    try:
        return Path(request.getfixturevalue("tiny_gguf"))
    except pytest.FixtureLookupError:
        from macserve.dev.gguf_export import export_gguf

        return export_gguf(TINY_MODEL, tmp_path_factory.mktemp("gguf") / "tiny-mla-f32.gguf")


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
    assert f"tiny: healthy at {url}/v1" in r.stdout
    assert "EXTRA_ARGS='-c 1024 --spec-type draft-mtp -t 1 -np 1'" in profile.read_text()
    s = status("tiny")
    assert (s["state"], s["healthy"], s["port"]) == ("running", True, port)
    pid1 = s["pid"]
    services.append(pid1)
    # `macserve run` exec'd the server: the supervised pid *is* llama-server
    assert psutil.Process(pid1).name() == "llama-server"
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

    # set: the service restarts by itself with the new settings
    r = cli("set", "tiny", "--", "EXTRA_ARGS=-c 512 -t 1 -np 1")
    assert r.returncode == 0, r.stderr
    assert "restarted, healthy" in r.stdout
    pid2 = status("tiny")["pid"]
    services.append(pid2)
    assert pid2 != pid1 and not psutil.pid_exists(pid1)
    assert n_ctx(port) == 512

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

    # passes --help, fails at start (the adapter file does not exist): rolled back
    r = cli("set", "tiny", "--", "EXTRA_ARGS=-c 512 -t 1 -np 1 --lora /nonexistent/adapter.gguf")
    assert r.returncode == 2, r.stdout
    err = r.stderr.strip().splitlines()
    assert "failed to load lora adapter '/nonexistent/adapter.gguf'" in r.stderr  # the log tail
    assert err[-1].startswith("error: new settings for tiny failed: the supervisor gave up")
    assert err[-1].endswith("previous settings restored and healthy")
    assert profile.read_bytes() == before
    s = status("tiny")
    assert s["state"] == "running" and s["healthy"] and s["pid"] != pid3
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

    # rm: stops and uninstalls first, then the profile goes
    last = s["pid"]
    r = cli("rm", "tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads(cli("ls", "--json").stdout) == []
    assert not profile.exists()
    assert not (macserve_home / "supervisor" / "programs" / "tiny.conf").exists()
    assert not psutil.pid_exists(last) or psutil.Process(last).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def tiny_mlx_f32(tmp_path):
    """The project model with float32 weights: MLX's CPU backend (Linux CI) has no bf16 GatherMM
    for the MoE layers, so mlx_lm.server's generation thread would die on the bf16 original."""
    mx = pytest.importorskip("mlx.core")
    import shutil

    out = tmp_path / "tiny-mla-f32"
    out.mkdir()
    for f in TINY_MODEL.iterdir():
        if f.suffix == ".safetensors":
            mx.save_safetensors(
                str(out / f.name), {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()}
            )
        elif f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_mlx_service_ready_means_a_completion(tiny_mlx_f32, services, macserve_home):
    port = free_port()
    r = cli("new", str(tiny_mlx_f32), "--name", "tiny-mlx", "--port", str(port), "--timeout", "120")
    assert r.returncode == 0, r.stderr
    assert "mlx has no context-size flag" in r.stderr
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
    assert cli("rm", "tiny-mlx").returncode == 0


def test_engine_service_new_set_chat(services, macserve_home):
    """The README demo's path: the project's model on macserve's own engine, supervised."""
    port = free_port()
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
    )
    assert r.returncode == 0, r.stderr
    profile = (macserve_home / "profiles" / "tiny-engine.env").read_text()
    assert "PROVIDER=macserve" in profile and "--mtp-k 1" in profile
    first = status("tiny-engine")
    assert first["healthy"]
    services.append(first["pid"])
    r = cli("set", "tiny-engine", "--", "EXTRA_ARGS=--ctx 1024 --kv int2 --mtp-k 1", timeout=300)
    assert r.returncode == 0, r.stderr
    second = status("tiny-engine")
    assert second["healthy"] and second["pid"] != first["pid"]
    services.append(second["pid"])
    r = cli("chat", "tiny-engine", "What country, friends, is this?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # the stats line reports MTP drafting done by the INT2-cache engine
    assert "draft acceptance" in r.stderr, r.stderr
    assert cli("rm", "tiny-engine").returncode == 0
