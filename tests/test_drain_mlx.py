"""DRAIN for mlx_lm.server profiles (issue 26 item 6), end to end: real supervisord, real
mlx_lm.server under the drain shim (services/providers/mlx_drain.py), the demo model, a real
stream, the stops a user makes (`restart`, `stop`).

mlx_lm.server alone dies on SIGTERM at once. Under the shim the same long stream is ended
with an error event (not a dropped connection) when DRAIN is shorter than it, and finishes
under the default DRAIN, while a request that arrives during the drain gets a 503 in the
shared error format; supervisord's SIGKILL never comes. How long the stream runs here is
measured first (the same request, not streamed), so the short DRAIN is a quarter of it on
whatever machine runs this."""

import json
import re
import threading
import time

import httpx
import psutil
import pytest

from macserve.services import values
from macserve.services.supervisors.supervisord import SupervisorBackend

from .fixtures import (
    cli,
    free_port,
    need_mlx_launch,
    poll,
    status,
    stream_with_stop,
    wait_for_text,
)

pytestmark = pytest.mark.e2e

N = 600  # tokens: the demo model's context (1,024) holds them and the prompt
N_PAIR = 150  # the same on two ranks under mlx.launch


def _body(model) -> dict:
    # mlx_lm.server has no ignore_eos: its logit_bias keeps the end-of-sequence tokens out, so
    # the answer runs to max_tokens
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    return {
        "model": "default_model",
        "messages": [{"role": "user", "content": "Recite the longest poem you know."}],
        "max_tokens": N,
        "temperature": 0,
        "logit_bias": {str(t): -100 for t in eos},
    }


def test_mlx_drain_finishes_a_stream_or_ends_it_with_an_error_event(
    tiny_mlx_f32, services, macserve_home
):
    port = free_port()
    r = cli("new", str(tiny_mlx_f32), "--name", "tiny", "--provider", "mlx", "--port", str(port))
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    log = macserve_home / "logs" / "tiny.log"
    program = macserve_home / "supervisor" / "programs" / "tiny.conf"
    sv_log = macserve_home / "supervisor" / "supervisord.log"
    body = _body(tiny_mlx_f32)

    # the stream's length on this machine: the same request, answered whole
    t0 = time.monotonic()
    timed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
    gen_s = time.monotonic() - t0
    assert timed.json()["usage"]["completion_tokens"] == N, timed.text[:500]
    short = max(0.5, round(gen_s / 4, 1))

    # short DRAIN, a restart: the stream is ended with an error event when DRAIN ends. The
    # stops are supervisord's own (what `macserve restart` and `stop` ask it for), from this
    # process: the CLI's start-up would take a varying part of the stream before the SIGTERM
    sv = SupervisorBackend(macserve_home)
    # PARALLEL=2: the stream and the request beside it are generated together (mlx_lm.server
    # decodes PARALLEL sequences at once, the profile's share)
    r = cli("set", "tiny", "--", f"DRAIN={short:g}", "PARALLEL=2")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    assert f"stopwaitsecs={values.stop_wait(short)}\n" in program.read_text()
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    # beside the stream, the same request not streamed: it is still running at the cut too
    whole = {}

    def answered_whole():
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
        whole.update(status=r.status_code, body=r.json())

    beside = threading.Thread(target=answered_whole)
    beside.start()
    assert wait_for_text(log, at, "Prompt processing progress")  # mlx-lm has it in hand
    seen = stream_with_stop(port, body, lambda: sv.restart("tiny"), log)
    beside.join(300)
    text = log.read_text()[at:]
    assert seen["chunks"] >= 5 and seen["finish"] is None, seen  # it did not run to its end
    assert seen["dropped"] is None and seen["done"], seen  # it ended, not dropped
    assert seen["error_event"]["type"] == "unavailable_error", seen
    assert f"DRAIN={short:g}s" in seen["error_event"]["message"], seen
    # the completion not yet answered gets a 503 in the shared format, not a bare close
    assert whole["status"] == 503, whole
    assert whole["body"]["error"]["type"] == "unavailable_error", whole
    assert f"DRAIN={short:g}s" in whole["body"]["error"]["message"], whole
    assert "stop: waiting for 2 generation(s) in flight" in text, text[-3000:]
    assert f"stop: 2 generation(s) still running after DRAIN={short:g}s: cut" in text
    assert "stop: ended 2 cut generation(s) with an error" in text
    assert "SIGKILL" not in sv_log.read_text()[sv_at:]
    services.append(status("tiny")["pid"])

    # the default DRAIN (60 s), a stop: the stream finishes, a new request meanwhile
    # gets a 503, and the service exits on its own
    r = cli("set", "tiny", "--", "DRAIN=")
    assert r.returncode == 0, r.stderr
    services.append(status("tiny")["pid"])
    assert f"stopwaitsecs={values.stop_wait(None)}\n" in program.read_text()
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    seen = stream_with_stop(port, body, lambda: sv.stop("tiny"), log, probe=True)
    text = log.read_text()[at:]
    assert seen["finish"] == "length" and seen["done"], seen
    assert seen["dropped"] is None and seen["error_event"] is None, seen
    code, retry_after, answer = seen["probe"]
    assert (code, retry_after) == (503, "1"), seen["probe"]
    assert answer["error"]["type"] == "unavailable_error", answer
    # the drain waited for the stream and the request held open beside it, which was served
    assert (seen["waiting"], seen["held"]) == (2, 200), seen
    m = re.search(r"stop: generations finished after ([0-9.]+)s", text)
    assert m, text[-3000:]
    assert float(m.group(1)) > short, (m.group(1), short)  # longer than the DRAIN that cut it
    assert "still running after" not in text
    said = sv_log.read_text()[sv_at:]
    assert "stopped: macserve-tiny (exit status 0)" in said and "SIGKILL" not in said, said
    assert status("tiny")["state"] == "stopped"


def _rank_pids(pid) -> list[int]:
    """The two mlx-lm server ranks under the supervised mlx.launch (each under the drain shim)."""
    return [
        c.pid
        for c in psutil.Process(pid).children(recursive=True)
        if "macserve.services.providers.mlx_drain" in c.cmdline()
    ]


def test_mlx_drain_on_two_ranks_under_mlx_launch(tiny_mlx_f32, services, macserve_home):
    """The same drain for a multi-host profile: two ranks over loopback under mlx.launch (ring,
    pipeline). Rank 0 drains; rank 1 keeps stepping its generations until rank 0 ends; the
    supervised mlx.launch exits 0 (a clean stop, not a crash to restart)."""
    need_mlx_launch()
    port = free_port()
    r = cli(
        "new", str(tiny_mlx_f32), "--name", "pair", "--provider", "mlx", "--port", str(port),
        "--no-start",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = cli("set", "pair", "--", "HOSTS=127.0.0.1,127.0.0.1", "SHARDING=pipeline")
    assert r.returncode == 0, r.stderr
    r = cli("start", "pair", timeout=300)
    assert r.returncode == 0, r.stderr
    s = status("pair")
    services.append(s["pid"])
    group = _rank_pids(s["pid"])
    assert len(group) == 2, group
    services.extend(group)
    log = macserve_home / "logs" / "pair.log"
    sv_log = macserve_home / "supervisor" / "supervisord.log"
    sv = SupervisorBackend(macserve_home)
    # shorter than one host's: each step crosses the ring, and the stream must end well
    # within the default DRAIN (60 s) on a loaded machine
    body = {**_body(tiny_mlx_f32), "max_tokens": N_PAIR}

    # the stream's length on this machine: the same request, answered whole
    t0 = time.monotonic()
    timed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
    gen_s = time.monotonic() - t0
    assert timed.json()["usage"]["completion_tokens"] == N_PAIR, timed.text[:500]
    short = max(0.5, round(gen_s / 4, 1))

    # the default DRAIN, a restart: the stream finishes on both ranks, a request meanwhile
    # gets a 503, and the group exits 0 and comes back
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    seen = stream_with_stop(port, body, lambda: sv.restart("pair"), log, probe=True)
    text = log.read_text()[at:]
    assert seen["finish"] == "length" and seen["done"], seen
    assert seen["dropped"] is None and seen["error_event"] is None, seen
    code, retry_after, answer = seen["probe"]
    assert (code, retry_after) == (503, "1"), seen["probe"]
    assert answer["error"]["type"] == "unavailable_error", answer
    # the drain waited for the stream and the request held open beside it, which was served
    assert (seen["waiting"], seen["held"]) == (2, 200), seen
    assert re.search(r"stop: generations finished after [0-9.]+s", text), text[-3000:]
    assert "rank 1: stop: following rank 0's drain" in text, text[-3000:]
    assert "macserve: stop: every rank has ended; exiting 0" in text, text[-3000:]
    said = sv_log.read_text()[sv_at:]
    assert "stopped: macserve-pair (exit status 0)" in said and "SIGKILL" not in said, said
    assert "exited: macserve-pair" not in said, said  # not a crash the supervisor restarts
    back = poll(
        lambda: (lambda x: x if x["healthy"] and x["pid"] != s["pid"] else None)(status("pair")),
        "the group to come back healthy",
        timeout=180,
    )
    services.append(back["pid"])
    services.extend(_rank_pids(back["pid"]))

    # a short DRAIN, a stop, an uneven split (mlx-lm's server under the SPLIT shim, under the
    # drain shim): the stream is ended with an error event and [DONE]
    at = len(log.read_text())
    r = cli("set", "pair", "--", f"DRAIN={short:g}", "SPLIT=3,1", timeout=300)
    assert r.returncode == 0, r.stderr
    s = status("pair")
    services.append(s["pid"])
    services.extend(_rank_pids(s["pid"]))
    assert "macserve: pipeline rank 0 of 2: layers 1-3" in log.read_text()[at:]
    at, sv_at = len(log.read_text()), len(sv_log.read_text())
    seen = stream_with_stop(port, body, lambda: sv.stop("pair"), log)
    text = log.read_text()[at:]
    assert seen["chunks"] >= 5 and seen["finish"] is None, seen  # it did not run to its end
    assert seen["dropped"] is None and seen["done"], seen  # it ended, not dropped
    assert seen["error_event"]["type"] == "unavailable_error", seen
    assert f"DRAIN={short:g}s" in seen["error_event"]["message"], seen
    assert f"stop: 1 generation(s) still running after DRAIN={short:g}s: cut" in text
    said = sv_log.read_text()[sv_at:]
    assert "stopped: macserve-pair (exit status 0)" in said and "SIGKILL" not in said, said
    assert status("pair")["state"] == "stopped"
