"""`macserve bench serve`: macserve's engine server against mlx_lm.server on the same model,
measured from outside, over HTTP, in one run.

The three servers (mlx_lm.server; macserve; macserve --kv int2 --mtp on --mtp-k 1) are started as
real subprocesses on loopback and warmed up with one request each; then, round after round,
each is measured in turn (the idle ones wait on a socket), with the same messages:

- **chat**: a chat of `turns` turns, the history growing by one user message and the answer
  every turn: the time to the first streamed token of every turn, and of the last turn's
  request sent again cold (the same history with a nonce at its very start, so no cache
  shares more than the chat template's first tokens);
- **load**: one client sending `requests` chat requests one after the other, then `clients`
  clients doing so at once (every prompt unique): aggregate completion tokens per second,
  latency p50 / p95, refusals (any status but 200).

- **restart** (`macserve serve --kv int2`, and the bf16 cache): a long chat turn (about
  `restart_prompt` tokens, near the demo model's 1,024-token limit) on one server, which is
  then stopped with SIGTERM (a service restart); a second server on the same
  `--prompt-cache-dir` answers the follow-up turn (a disk hit), the same history with another
  last message (a memory hit), and the same history with a nonce at its start (cold). Reported:
  the three TTFTs, `restart_followup_ttft_ratio` (after-restart follow-up / cold) and the
  tokens reused per tier, from the second server's /metrics.

Medians over the rounds are reported, so a noisy machine weighs on every server alike. Every
request is greedy (temperature 0) with no seed (mlx_lm.server batches only requests without
one). On a CPU-only MLX, mlx_lm.server gets a float32 copy of the model, as macserve's engine
casts to float32 there: MLX's CPU gather_mm (the MoE experts) has no bf16.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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


def targets(model: Path) -> list[Target]:
    py = sys.executable
    serve = (py, "-m", "macserve", "serve", str(model))
    return [
        Target("mlx_lm.server", (py, "-m", "mlx_lm.server", "--model", str(model)), "mlx_lm"),
        # Drafting pinned on and off (serve's default, --mtp auto, decides by its own timings).
        Target("macserve", serve + ("--mtp", "off"), "macserve"),
        Target(
            "macserve int2 mtp1",
            serve + ("--kv", "int2", "--mtp", "on", "--mtp-k", "1"),
            "macserve",
        ),
    ]


def restart_targets(model: Path) -> list[Target]:
    # Drafting off: a drafting request re-prefills the last shared token (--mtp auto: by timing)
    serve = (sys.executable, "-m", "macserve", "serve", str(model), "--mtp", "off")
    return [
        Target("macserve int2", serve + ("--kv", "int2"), "macserve"),
        Target("macserve", serve, "macserve"),
    ]


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
                    _chat(c, url, [{"role": "user", "content": plan.lines[0]}], 8)
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


def _metric(url: str, name: str, tier: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for x in fam.samples:
            if x.name == name and x.labels.get("tier") == tier:
                return x.value
    return 0.0


def _long_system(url: str, lines: tuple[str, ...], tokens: int) -> str:
    """Held-out lines joined into a system prompt whose first turn is about `tokens` long,
    counted by the server's tokenizer (count_tokens)."""
    text = " ".join(lines)
    while len(text) < 8 * tokens:
        text += " " + text
    lo, hi = 0, len(text)
    with httpx.Client(timeout=60) as c:
        while hi - lo > 16:
            mid = (lo + hi) // 2
            body = {"system": text[:mid], "messages": [{"role": "user", "content": "Go on."}]}
            n = c.post(url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
            lo, hi = (mid, hi) if n <= tokens else (lo, mid)
    return text[:lo]


def restart(plan: Plan, target: Target, log_dir: Path, progress) -> dict:
    """A long chat turn, a service restart, the follow-up: its TTFT from disk, from memory,
    and cold, medians over `plan.restart_rounds` rounds (each with its own prefix)."""
    rows = []
    system = None
    for k in range(plan.restart_rounds):
        progress(f"restart {k + 1}/{plan.restart_rounds}: {target.name}")
        with tempfile.TemporaryDirectory(prefix="macserve-bench-pc-") as pc:
            t = Target(target.name, target.argv + ("--prompt-cache-dir", pc), target.kind)
            with running(t, plan, log_dir) as url, httpx.Client(timeout=plan.ready_timeout) as c:
                if system is None:
                    system = _long_system(url, plan.lines[1:], plan.restart_prompt)
                first = [
                    {"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] {system}"},
                    {"role": "user", "content": "Go on."},
                ]
                r1 = _chat(c, url, first, plan.answer_tokens)
            # SIGTERM above (a service restart); the next server reads the same folder.
            msgs = first + [{"role": "assistant", "content": r1["text"]}]
            with running(t, plan, log_dir) as url, httpx.Client(timeout=plan.ready_timeout) as c:
                # The warm-up request of `running` shares only the chat template's first
                # tokens with this chat: no hit for it.
                disk = _chat(c, url, msgs + [{"role": "user", "content": "And then?"}], 8)
                warm = _chat(c, url, msgs + [{"role": "user", "content": "What then?"}], 8)
                again = [dict(m) for m in msgs] + [{"role": "user", "content": "And then?"}]
                again[0]["content"] = f"[{uuid.uuid4().hex[:8]}] " + again[0]["content"]
                cold = _chat(c, url, again, 8)
                reused = {
                    tier: _metric(url, "macserve_prompt_cache_tokens_reused_total", tier)
                    for tier in ("disk", "memory")
                }
        rows.append(
            {
                "first_turn_prompt_tokens": r1["usage"].get("prompt_tokens"),
                "followup_prompt_tokens": disk["usage"].get("prompt_tokens"),
                "cold_ttft_s": cold["ttft"],
                "restart_followup_ttft_s": disk["ttft"],
                "warm_followup_ttft_s": warm["ttft"],
                "restart_cached_tokens": _cached(disk),
                "warm_cached_tokens": _cached(warm),
                "cold_cached_tokens": _cached(cold),
                "tokens_reused": reused,
            }
        )
    med = statistics.median
    out = {k: rows[0][k] for k in ("first_turn_prompt_tokens", "followup_prompt_tokens")}
    for k in ("cold_ttft_s", "restart_followup_ttft_s", "warm_followup_ttft_s"):
        out[k] = round(med(r[k] for r in rows), 4)
    out["restart_followup_ttft_ratio"] = round(
        out["restart_followup_ttft_s"] / out["cold_ttft_s"], 3
    )
    out["warm_followup_ttft_ratio"] = round(out["warm_followup_ttft_s"] / out["cold_ttft_s"], 3)
    for k in ("restart_cached_tokens", "warm_cached_tokens", "cold_cached_tokens"):
        out[k] = [r[k] for r in rows]
    out["tokens_reused_per_tier"] = rows[-1]["tokens_reused"]  # one server's counters
    out["rounds"] = rows
    return out


def _cached(r: dict) -> int:
    return ((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0


def _chat(client: httpx.Client, url: str, messages: list, max_tokens: int) -> dict:
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


def conversation(url: str, plan: Plan, lines: list[str]) -> dict:
    """One growing chat: time to first token per turn; the last turn's request again cold."""
    ttft, msgs, nonce = [], [], f"[{uuid.uuid4().hex[:8]}] "
    with httpx.Client(timeout=plan.ready_timeout) as c:
        for turn in range(plan.turns):
            msgs.append({"role": "user", "content": (nonce if turn == 0 else "") + lines.pop()})
            r = _chat(c, url, msgs, plan.answer_tokens)
            ttft.append(r["ttft"])
            msgs.append({"role": "assistant", "content": r["text"]})
        again = [dict(m) for m in msgs[:-1]]
        again[0]["content"] = f"[{uuid.uuid4().hex[:8]}] " + again[0]["content"]
        cold = _chat(c, url, again, plan.answer_tokens)
    return {"ttft": ttft, "cold": cold["ttft"], "prompt_tokens": r["usage"].get("prompt_tokens")}


def _chat_summary(convs: list[dict]) -> dict:
    med = statistics.median
    per_turn = [med(c["ttft"][t] for c in convs) for t in range(len(convs[0]["ttft"]))]
    warm, cold = per_turn[-1], med(c["cold"] for c in convs)
    return {
        "ttft_per_turn_s": [round(t, 4) for t in per_turn],
        # Every follow-up turn (2..turns): less noisy than the last turn alone.
        "follow_up_ttft_mean_s": round(statistics.mean(per_turn[1:]), 4),
        "last_turn_prompt_tokens": convs[0]["prompt_tokens"],
        "last_turn_ttft_s": round(warm, 4),
        "same_history_cold_ttft_s": round(cold, 4),
        "warm_over_cold": round(warm / cold, 3),
    }


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


def _load_summary(runs: list[dict]) -> dict:
    """The median run by tokens per second (its latencies with it); refusals summed."""
    runs = sorted(runs, key=lambda r: r["tokens_per_s"])
    out = dict(runs[len(runs) // 2])
    out["refused"] = sum(r["refused"] for r in runs)
    out["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return out


def _per_round(plan: Plan) -> int:
    return plan.turns + plan.requests * (1 + plan.clients)


def needed_lines(plan: Plan) -> int:
    return 1 + plan.rounds * _per_round(plan)


def _round_lines(plan: Plan, k: int) -> list[str]:
    """Round k's messages, last first (they are popped)."""
    n = _per_round(plan)
    return list(reversed(plan.lines[1 + k * n : 1 + (k + 1) * n]))


def run(plan: Plan, progress=lambda m: None) -> dict:
    """Every server up at once (idle ones wait on a socket), measured in turn, round after
    round, so a noisy machine weighs on all of them alike; medians over the rounds."""
    if len(plan.lines) < needed_lines(plan):
        raise MacserveError(f"the bench needs {needed_lines(plan)} user messages")
    with tempfile.TemporaryDirectory(prefix="macserve-bench-serve-") as tmp:
        log_dir = plan.log_dir or Path(tmp)
        baseline_model = plan.model
        if mx.default_device().type == mx.DeviceType.cpu:
            progress("float32 copy of the model for mlx_lm.server (MLX's CPU backend)")
            baseline_model = float32_copy(plan.model, Path(tmp) / "model-f32")
        with contextlib.ExitStack() as stack:
            urls = {}
            for t in targets(plan.model):
                if t.kind == "mlx_lm":
                    t = Target(t.name, t.argv[:-1] + (str(baseline_model),), t.kind)
                else:  # a disk tier of its own: no hits from an earlier run of the bench
                    pc = str(Path(tmp) / f"pc-{t.name.replace(' ', '-')}")
                    t = Target(t.name, t.argv + ("--prompt-cache-dir", pc), t.kind)
                progress(f"{t.name}: starting")
                urls[t.name] = stack.enter_context(running(t, plan, log_dir))
            raw = {n: {"chat": [], "one": [], "many": []} for n in urls}
            for k in range(plan.rounds):
                for name, url in urls.items():
                    progress(f"round {k + 1}/{plan.rounds}: {name}")
                    lines = _round_lines(plan, k)  # the same messages for every server
                    raw[name]["chat"].append(conversation(url, plan, lines))
                    raw[name]["one"].append(load(url, plan, 1, lines))
                    raw[name]["many"].append(load(url, plan, plan.clients, lines))
    many = f"load_{plan.clients}_clients"
    results = {}
    for name, r in raw.items():
        one, several = _load_summary(r["one"]), _load_summary(r["many"])
        results[name] = {
            "chat": _chat_summary(r["chat"]),
            "load_1_client": one,
            many: several,
            "concurrency_speedup": round(several["tokens_per_s"] / one["tokens_per_s"], 3),
        }
    base = results["mlx_lm.server"]
    many = f"load_{plan.clients}_clients"
    ratios = {}
    for name, r in results.items():
        if name == "mlx_lm.server":
            continue
        ratios[name] = {
            # > 1 means macserve is better than mlx_lm.server on the same model.
            "follow_up_ttft": round(
                base["chat"]["last_turn_ttft_s"] / r["chat"]["last_turn_ttft_s"], 3
            ),
            "follow_up_ttft_mean": round(
                base["chat"]["follow_up_ttft_mean_s"] / r["chat"]["follow_up_ttft_mean_s"], 3
            ),
            "warm_over_cold": r["chat"]["warm_over_cold"],
            "warm_over_cold_mlx_lm": base["chat"]["warm_over_cold"],
            f"tokens_per_s_{plan.clients}_clients": round(
                r[many]["tokens_per_s"] / base[many]["tokens_per_s"], 3
            ),
            "concurrency_speedup": r["concurrency_speedup"],
            "concurrency_speedup_mlx_lm": base["concurrency_speedup"],
            "latency_p50": round(base[many]["latency_p50_s"] / r[many]["latency_p50_s"], 3),
            "latency_p95": round(base[many]["latency_p95_s"] / r[many]["latency_p95_s"], 3),
        }
    out = {
        "model": str(plan.model),
        "device": str(mx.default_device()),
        "plan": {
            "turns": plan.turns,
            "rounds": plan.rounds,
            "answer_tokens": plan.answer_tokens,
            "clients": plan.clients,
            "requests_per_client": plan.requests,
            "load_tokens": plan.load_tokens,
        },
        "servers": results,
        "vs_mlx_lm_server": ratios,
    }
    if plan.restart_rounds:
        with tempfile.TemporaryDirectory(prefix="macserve-bench-serve-") as tmp:
            log_dir = plan.log_dir or Path(tmp)
            rs = {t.name: restart(plan, t, log_dir, progress) for t in restart_targets(plan.model)}
        out["restart"] = rs
        # The headline: INT2, the cache this disk tier is for.
        out["restart_followup_ttft_ratio"] = rs["macserve int2"]["restart_followup_ttft_ratio"]
        out["restart_tokens_reused_per_tier"] = rs["macserve int2"]["tokens_reused_per_tier"]
    return out
