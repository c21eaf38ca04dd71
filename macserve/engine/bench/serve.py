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

- **restart** (serve_restart.py: `macserve serve --kv int2`, the bf16 cache, and mlx_lm.server
  as the baseline): a long chat turn (about `restart_prompt` tokens, near the demo model's
  1,024-token limit), a service restart, the follow-up turn from disk, from memory and cold.
  `restart_followup_ttft_ratio` (after-restart follow-up / cold) and the tokens reused per tier;
  `disk_bytes`: the bytes on disk per token that first turn left (serve_disk.py), INT2 and
  bf16, and `disk_projection`, the same at DeepSeek-V3's width for 128K tokens from the
  per-row formula (a projection, labelled so).
- **capacity** (serve_capacity.py): `capacity_clients` clients at once against serve's default
  `--max-batch` and each fixed one; `default_over_best`.

Medians over the rounds are reported, so a noisy machine weighs on every server alike. Every
request is greedy (temperature 0) with no seed (mlx_lm.server batches only requests without
one). On a CPU-only MLX, mlx_lm.server gets a float32 copy of the model, as macserve's engine
casts to float32 there: MLX's CPU gather_mm (the MoE experts) has no bf16.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import mlx.core as mx

from ...errors import MacserveError
from . import serve_disk
from .serve_capacity import capacity
from .serve_http import Plan, Target, chat, float32_copy, load, load_summary, running
from .serve_restart import restarts

__all__ = ["needed_lines", "run"]


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


def conversation(url: str, plan: Plan, lines: list[str]) -> dict:
    """One growing chat: time to first token per turn; the last turn's request again cold."""
    ttft, msgs, nonce = [], [], f"[{uuid.uuid4().hex[:8]}] "
    with httpx.Client(timeout=plan.ready_timeout) as c:
        for turn in range(plan.turns):
            msgs.append({"role": "user", "content": (nonce if turn == 0 else "") + lines.pop()})
            r = chat(c, url, msgs, plan.answer_tokens)
            ttft.append(r["ttft"])
            msgs.append({"role": "assistant", "content": r["text"]})
        again = [dict(m) for m in msgs[:-1]]
        again[0]["content"] = f"[{uuid.uuid4().hex[:8]}] " + again[0]["content"]
        cold = chat(c, url, again, plan.answer_tokens)
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


def _per_round(plan: Plan) -> int:
    return plan.turns + plan.requests * (1 + plan.clients)


def needed_lines(plan: Plan) -> int:
    return 1 + plan.rounds * _per_round(plan)


def _round_lines(plan: Plan, k: int) -> list[str]:
    """Round k's messages, last first (they are popped)."""
    n = _per_round(plan)
    return list(reversed(plan.lines[1 + k * n : 1 + (k + 1) * n]))


def _baseline(plan: Plan, tmp: Path, progress) -> Path:
    """The model mlx_lm.server is given: a float32 copy on a CPU-only MLX."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return plan.model
    progress("float32 copy of the model for mlx_lm.server (MLX's CPU backend)")
    return float32_copy(plan.model, tmp / "model-f32")


def run(plan: Plan, progress=lambda m: None) -> dict:
    """Every server up at once (idle ones wait on a socket), measured in turn, round after
    round, so a noisy machine weighs on all of them alike; medians over the rounds."""
    if len(plan.lines) < needed_lines(plan):
        raise MacserveError(f"the bench needs {needed_lines(plan)} user messages")
    with tempfile.TemporaryDirectory(prefix="macserve-bench-serve-") as tmp:
        log_dir = plan.log_dir or Path(tmp)
        baseline_model = _baseline(plan, Path(tmp), progress)
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
        one, several = load_summary(r["one"]), load_summary(r["many"])
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
            rs = restarts(plan, plan.model, _baseline(plan, Path(tmp), progress), log_dir, progress)
        out["restart"] = rs
        # The headline: INT2, the cache this disk tier is for.
        out["restart_followup_ttft_ratio"] = rs["macserve int2"]["restart_followup_ttft_ratio"]
        out["restart_tokens_reused_per_tier"] = rs["macserve int2"]["tokens_reused_per_tier"]
        # The baseline: mlx_lm.server's follow-up after its restart is a cold prefill.
        out["restart_followup_ttft_ratio_mlx_lm"] = rs["mlx_lm.server"][
            "restart_followup_ttft_ratio"
        ]
        # Bytes on disk per token of the first turn's prefix, each cache; and at real width.
        out["disk_bytes"] = {n: r["disk"] for n, r in rs.items() if r.get("disk")}
        out["disk_projection"] = serve_disk.projection()
    if plan.capacity_clients:
        with tempfile.TemporaryDirectory(prefix="macserve-bench-serve-") as tmp:
            out["capacity"] = capacity(plan, plan.log_dir or Path(tmp), progress)
    return out
