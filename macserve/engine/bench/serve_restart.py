"""`bench serve`'s restart scenario: a long chat turn on one server, a service restart (SIGTERM),
then the follow-up turn on a new server: from macserve's disk tier, from memory (the same
history with another last message) and cold (a nonce at the very start). mlx_lm.server, which
keeps its prompt cache in memory only, runs the same sequence in the same run as the baseline:
its follow-up after a restart is a cold prefill.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import httpx

from . import serve_disk
from .serve_http import Plan, Target, cached_tokens, chat, metric, running


def restart_targets(model: Path, baseline_model: Path) -> list[Target]:
    # Drafting off: a drafting request re-prefills the last shared token (--mtp auto: by timing)
    serve = (sys.executable, "-m", "macserve", "serve", str(model), "--mtp", "off")
    mlx_lm = (sys.executable, "-m", "mlx_lm.server", "--model", str(baseline_model))
    return [
        Target("macserve int2", serve + ("--kv", "int2"), "macserve"),
        Target("macserve", serve, "macserve"),
        Target("mlx_lm.server", mlx_lm, "mlx_lm"),  # last: it has no count_tokens route
    ]


def restarts(plan: Plan, model: Path, baseline_model: Path, log_dir: Path, progress) -> dict:
    """Every restart target in turn, with one long system prompt sized by macserve's
    tokenizer (the same model's, so the same token count for mlx_lm.server)."""
    system: list[str] = []
    return {
        t.name: restart(plan, t, log_dir, progress, system)
        for t in restart_targets(model, baseline_model)
    }


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


def restart(plan: Plan, target: Target, log_dir: Path, progress, system: list[str]) -> dict:
    """A long chat turn, a service restart, the follow-up: its TTFT from disk, from memory,
    and cold, medians over `plan.restart_rounds` rounds (each with its own prefix).
    `system`: the long system prompt once a macserve server has sized it (filled here)."""
    rows = []
    macserve = target.kind == "macserve"
    for k in range(plan.restart_rounds):
        progress(f"restart {k + 1}/{plan.restart_rounds}: {target.name}")
        with tempfile.TemporaryDirectory(prefix="macserve-bench-pc-") as pc:
            t = target
            if macserve:
                t = Target(target.name, target.argv + ("--prompt-cache-dir", pc), target.kind)
            with running(t, plan, log_dir) as url, httpx.Client(timeout=plan.ready_timeout) as c:
                if not system:
                    system.append(_long_system(url, plan.lines[1:], plan.restart_prompt))
                first = [
                    {"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] {system[0]}"},
                    {"role": "user", "content": "Go on."},
                ]
                r1 = chat(c, url, first, plan.answer_tokens)
            # SIGTERM above (a service restart); the next server reads the same folder.
            # What it left there: bytes on disk per token of that first turn.
            disk = serve_disk.measure(Path(pc), plan.model, "int2" in t.argv) if macserve else None
            msgs = first + [{"role": "assistant", "content": r1["text"]}]
            with running(t, plan, log_dir) as url, httpx.Client(timeout=plan.ready_timeout) as c:
                # The warm-up request of `running` shares only the chat template's first
                # tokens with this chat: no hit for it.
                after = chat(c, url, msgs + [{"role": "user", "content": "And then?"}], 8)
                warm = chat(c, url, msgs + [{"role": "user", "content": "What then?"}], 8)
                again = [dict(m) for m in msgs] + [{"role": "user", "content": "And then?"}]
                again[0]["content"] = f"[{uuid.uuid4().hex[:8]}] " + again[0]["content"]
                cold = chat(c, url, again, 8)
                reused = {  # mlx_lm.server has no /metrics
                    tier: metric(url, "macserve_prompt_cache_tokens_reused_total", tier)
                    for tier in ("disk", "memory")
                    if macserve
                }
        rows.append(
            {
                "first_turn_prompt_tokens": r1["usage"].get("prompt_tokens"),
                "followup_prompt_tokens": after["usage"].get("prompt_tokens"),
                "cold_ttft_s": cold["ttft"],
                "restart_followup_ttft_s": after["ttft"],
                "warm_followup_ttft_s": warm["ttft"],
                "restart_cached_tokens": cached_tokens(after),
                "warm_cached_tokens": cached_tokens(warm),
                "cold_cached_tokens": cached_tokens(cold),
                "tokens_reused": reused,
                "disk": disk,
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
    out["disk"] = rows[0]["disk"]  # the first round's folder (each round's prefix is as long)
    out["rounds"] = rows
    return out
