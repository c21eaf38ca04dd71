"""DRAIN, the profile's bound on a planned stop's wait for generations in flight (issue 26
item 6), end to end: real supervisord, real llama-server under `macserve run`, a real stream.

The same long stream, restarted the same way, is cut under a DRAIN shorter than it and
finishes under a longer one; in both cases supervisord's own SIGKILL never comes (its
stopwaitsecs is DRAIN + STOP_MARGIN). How long the stream runs on this machine is read from
llama-server's own timing of the same request, so the short DRAIN is a quarter of it here,
whatever the machine's speed."""

import json
import math
import re
import threading

import httpx
import pytest

from macserve.services import values
from macserve.services.supervisors.supervisord import SupervisorBackend

from .fixtures import cli, free_port, status

pytestmark = pytest.mark.e2e

N = 900  # tokens: the tiny model's context (1,024) holds them and the prompt
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Recite the longest poem you know."}],
    "max_tokens": N,
    "temperature": 0,
    "ignore_eos": True,  # llama-server's: the answer runs to max_tokens
}


def _stream_with_restart(port, home) -> dict:
    """Stream BODY; once the first chunks are in, restart the service through supervisord (the
    stop a `set` or `restart` makes) while the stream runs. What the client saw."""
    seen = {"chunks": 0, "finish": None, "error": None}
    restart = threading.Thread(target=lambda: SupervisorBackend(home).restart("tiny"))
    try:
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**BODY, "stream": True},
            timeout=httpx.Timeout(120, connect=10),
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                seen["chunks"] += 1
                if seen["chunks"] == 5:
                    restart.start()
                seen["finish"] = choices[0].get("finish_reason") or seen["finish"]
    except httpx.HTTPError as e:  # the connection dropped under the stream
        seen["error"] = type(e).__name__
    restart.join(300)
    assert not restart.is_alive()
    return seen


def _new_log(path, offset) -> str:
    return path.read_text()[offset:]


def test_drain_bounds_the_wait_for_a_stream_both_ways(
    llama_server, model_gguf, services, macserve_home
):
    port = free_port()
    r = cli(
        "new", str(model_gguf), "--name", "tiny", "--port", str(port), "--extra-args", "-t 1 -np 1"
    )
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    log = macserve_home / "logs" / "tiny.log"
    program = macserve_home / "supervisor" / "programs" / "tiny.conf"
    sv_log = macserve_home / "supervisor" / "supervisord.log"

    # the stream's length on this machine, by the server's own clock
    timed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=300)
    gen_s = timed.json()["timings"]["predicted_ms"] / 1000
    assert timed.json()["usage"]["completion_tokens"] == N
    short = max(0.5, round(gen_s / 4, 1))

    # short: the stream is cut when DRAIN ends, with a line saying so; no supervisor SIGKILL
    r = cli("set", "tiny", "--", f"DRAIN={short:g}")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    wait = math.ceil(short) + values.STOP_MARGIN
    assert f"stopwaitsecs={wait}\n" in program.read_text()
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    seen = _stream_with_restart(port, macserve_home)
    text = _new_log(log, at)
    assert seen["chunks"] >= 5 and seen["finish"] is None, seen  # it did not run to its end
    assert seen["error"], seen  # the client saw the connection go (llama-server has no error event)
    assert "stop: waiting for 1 generation(s) in flight" in text, text[-3000:]
    assert f"stop: 1 generation(s) still running after DRAIN={short:g}s: cut" in text
    assert "terminated by SIGKILL" not in _new_log(sv_log, sv_at)
    services.append(status("tiny")["pid"])

    # long (the default, 60 s): the same stream, the same restart: it finishes
    r = cli("set", "tiny", "--", "DRAIN=")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    assert f"stopwaitsecs={values.stop_wait(None)}\n" in program.read_text()
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    seen = _stream_with_restart(port, macserve_home)
    text = _new_log(log, at)
    assert seen == {"chunks": seen["chunks"], "finish": "length", "error": None}, seen
    m = re.search(r"stop: generations finished after ([0-9.]+)s", text)
    assert m, text[-3000:]
    # the drain outlasted the DRAIN that cut the same stream above
    assert float(m.group(1)) > short, (m.group(1), short)
    assert "still running after" not in text and "SIGKILL" not in text
    assert "stopped: macserve-tiny (exit status 0)" in _new_log(sv_log, sv_at)
    services.append(status("tiny")["pid"])
