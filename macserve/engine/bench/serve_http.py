"""The parts every `bench serve` scenario uses: a real server process on loopback,
warmed up; a streamed chat request timed to its first token; concurrent clients.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
from prometheus_client.parser import text_string_to_metric_families

from ...errors import MacserveError

REPO = Path(__file__).resolve().parents[3]  # the tree this macserve runs from
MODEL_NAME = "default_model"  # mlx_lm.server's name for its --model (macserve ignores it)


class _Unavailable(Exception):
    pass


@dataclass(frozen=True)
class Target:
    name: str
    argv: tuple[str, ...]  # without host and port
    kind: str  # "macserve" | "mlx_lm"


@dataclass(frozen=True)
class Plan:
    model: Path
    lines: tuple[str, ...]  # user messages, each used once per run
    turns: int = 10
    rounds: int = 5  # each: one chat, one client, `clients` clients, per server
    answer_tokens: int = 32  # per chat turn
    clients: int = 8
    requests: int = 3  # per client
    load_tokens: int = 64  # per load request
    ready_timeout: float = 300.0
    log_dir: Path | None = None
    restart_rounds: int = 3  # 0: no restart scenario
    restart_prompt: int = 880  # tokens of the restart scenario's first turn
    capacity_clients: int = 32  # 0: no capacity scenario
    capacity_batches: tuple[int, ...] = (
        8,
        16,
        32,
    )  # the fixed --max-batch settings beside the default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def float32_copy(model: Path, out: Path) -> Path:
    """The model with float32 weights: MLX's CPU backend has no bf16 GatherMM for MoE
    layers, so mlx_lm.server's generation thread would die on a bf16 original."""
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            w = {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()}
            mx.save_safetensors(str(out / f.name), w)
        elif f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@contextlib.contextmanager
def running(target: Target, plan: Plan, log_dir: Path):
    """The server up and warmed (one chat request answered); its URL."""
    port = _free_port()
    log = log_dir / f"{target.name.replace(' ', '-')}-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*target.argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group, ended whole below
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + plan.ready_timeout
        while True:
            if proc.poll() is not None:
                raise MacserveError(f"{target.name} exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise MacserveError(f"{target.name} not up within {plan.ready_timeout:.0f} s")
            time.sleep(0.1)
        with httpx.Client(timeout=plan.ready_timeout) as c:
            while True:  # a model still loading answers 503 (macserve) until it is in
                try:
                    chat(c, url, [{"role": "user", "content": plan.lines[0]}], 8)
                    break
                except _Unavailable:
                    if time.monotonic() > deadline:
                        raise MacserveError(f"{target.name} not ready within the timeout") from None
                    time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def metric(url: str, name: str, tier: str) -> float:
    """The server's Prometheus sample `name` for one prompt-cache `tier` (0 if it has none)."""
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for x in fam.samples:
            if x.name == name and x.labels.get("tier") == tier:
                return x.value
    return 0.0


def cached_tokens(r: dict) -> int:
    """The prompt tokens a chat answer (`chat`'s result) says came from the prompt cache."""
    return ((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0


def chat(client: httpx.Client, url: str, messages: list, max_tokens: int) -> dict:
    """One streamed greedy chat request: time to the first token, the text, the usage."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code == 503:
            raise _Unavailable
        if r.status_code != 200:
            raise MacserveError(f"{url}: HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            for ch in obj.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
            if obj.get("usage"):
                usage = obj["usage"]
    total = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else total, "text": "".join(parts), "usage": usage}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def load(url: str, plan: Plan, clients: int, lines: list[str]) -> dict:
    """`clients` clients at once, each with `plan.requests` requests in turn."""
    work = [[lines.pop() for _ in range(plan.requests)] for _ in range(clients)]
    lat: list[float] = []
    tokens, refused, errors = [0], [0], []
    lock = threading.Lock()

    def client(prompts: list[str]):
        with httpx.Client(timeout=plan.ready_timeout) as c:
            for p in prompts:
                body = {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] {p}"}],
                    "max_tokens": plan.load_tokens,
                    "temperature": 0,
                }
                t0 = time.perf_counter()
                try:
                    r = c.post(url + "/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(repr(e))
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code != 200:
                        refused[0] += 1
                        continue
                    lat.append(dt)
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(w,)) for w in work]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise MacserveError(f"{url}: {len(errors)} requests failed: {errors[0]}")
    return {
        "clients": clients,
        "requests": clients * plan.requests,
        "refused": refused[0],
        "completion_tokens": tokens[0],
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens[0] / wall, 2),
        "latency_p50_s": round(_percentile(lat, 0.5), 4) if lat else None,
        "latency_p95_s": round(_percentile(lat, 0.95), 4) if lat else None,
    }


def load_summary(runs: list[dict]) -> dict:
    """The median run by tokens per second (its latencies with it); refusals summed."""
    runs = sorted(runs, key=lambda r: r["tokens_per_s"])
    out = dict(runs[len(runs) // 2])
    out["refused"] = sum(r["refused"] for r in runs)
    out["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return out
