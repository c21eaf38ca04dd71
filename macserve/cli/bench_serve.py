"""`bench serve`: macserve serve against mlx_lm.server on one model, over HTTP (the work is in
engine/bench/serve.py; docs/server.md), and its printed report."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .fmt import size
from .lazy import lazy

serve_bench = lazy("macserve.engine.bench.serve")
serve_http = lazy("macserve.engine.bench.serve_http")
tiny_data = lazy("macserve.dev.tiny.data")


def _user_messages(n: int, chars: int = 80) -> list[str]:
    """Chat messages from the demo model's held-out plays: consecutive speeches joined and cut
    to `chars` characters (the demo tokenizer spends about a token per character, so a
    10-turn chat with answers of up to 32 tokens reaches a ~700-token history)."""
    out, cur = [], ""
    for sp in tiny_data.speeches(tiny_data.held_out_text()):
        cur = f"{cur}\n{sp}" if cur else sp
        if len(cur) >= chars:
            out.append(cur[:chars])
            cur = ""
            if len(out) == n:
                break
    return out


@click.command("serve")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--turns", type=click.IntRange(2), default=10, show_default=True)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="each: a chat, one client, then the concurrent clients, on every server in turn; "
    "medians are reported",
)
@click.option("--answer-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--clients", type=click.IntRange(2), default=8, show_default=True)
@click.option("--requests", type=click.IntRange(1), default=3, show_default=True, help="per client")
@click.option(
    "--load-tokens",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="max_tokens of each load request",
)
@click.option("--logs", type=click.Path(file_okay=False), help="keep the servers' logs here")
@click.option(
    "--restart-rounds",
    type=click.IntRange(0),
    default=3,
    show_default=True,
    help="rounds of the restart scenario (a long turn, a server restart, the follow-up from "
    "the disk cache); 0 skips it",
)
@click.option(
    "--capacity-clients",
    type=click.IntRange(0),
    default=32,
    show_default=True,
    help="clients at once against serve's default --max-batch and each --capacity-batch; "
    "0 skips it",
)
@click.option(
    "--capacity-batch",
    "capacity_batches",
    type=click.IntRange(1),
    multiple=True,
    default=(8, 16, 32),
    show_default=True,
    help="a fixed --max-batch measured beside the default (repeatable)",
)
@click.option("--json", "as_json", is_flag=True)
def bench_serve(
    model,
    turns,
    rounds,
    answer_tokens,
    clients,
    requests,
    load_tokens,
    logs,
    restart_rounds,
    capacity_clients,
    capacity_batches,
    as_json,
):
    """macserve serve (bf16, then --kv int2 --mtp-k 1) against mlx_lm.server on MODEL, over
    HTTP: time to first token in a growing chat, and tokens/s and latency under concurrent
    clients; ratios against mlx_lm.server."""
    plan = serve_http.Plan(
        Path(model).resolve(),
        (),
        turns=turns,
        rounds=rounds,
        answer_tokens=answer_tokens,
        clients=clients,
        requests=requests,
        load_tokens=load_tokens,
        log_dir=Path(logs).resolve() if logs else None,
        restart_rounds=restart_rounds,
        capacity_clients=capacity_clients,
        capacity_batches=tuple(sorted(set(capacity_batches))),
    )
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
    lines = _user_messages(serve_bench.needed_lines(plan))
    plan = serve_http.Plan(**{**plan.__dict__, "lines": tuple(lines)})
    res = serve_bench.run(plan, progress=lambda m: click.echo(f"... {m}", err=True))
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    for name, r in res["servers"].items():
        c, one, many = r["chat"], r["load_1_client"], r[f"load_{clients}_clients"]
        click.echo(
            f"{name}: chat TTFT per turn {', '.join(f'{t * 1000:.0f}' for t in c['ttft_per_turn_s'])} ms; "
            f"last turn ({c['last_turn_prompt_tokens']} prompt tokens) {c['last_turn_ttft_s'] * 1000:.0f} ms "
            f"vs {c['same_history_cold_ttft_s'] * 1000:.0f} ms cold ({c['warm_over_cold']:.2f}x); "
            f"1 client {one['tokens_per_s']:.1f} tok/s, {clients} clients {many['tokens_per_s']:.1f} "
            f"tok/s ({r['concurrency_speedup']:.2f}x), p50 {many['latency_p50_s']:.2f} s, "
            f"p95 {many['latency_p95_s']:.2f} s, refused {many['refused']}"
        )
    for name, q in res["vs_mlx_lm_server"].items():
        click.echo(
            f"{name} / mlx_lm.server: last-turn TTFT {q['follow_up_ttft']:.2f}x "
            f"(every follow-up turn {q['follow_up_ttft_mean']:.2f}x), "
            f"{clients}-client tokens/s {q[f'tokens_per_s_{clients}_clients']:.2f}x, "
            f"latency p50 {q['latency_p50']:.2f}x, p95 {q['latency_p95']:.2f}x (>1: macserve better)"
        )
    for name, r in res.get("restart", {}).items():
        reused = r["tokens_reused_per_tier"]
        click.echo(
            f"{name} restart: follow-up ({r['followup_prompt_tokens']} prompt tokens) after a "
            f"restart {r['restart_followup_ttft_s'] * 1000:.0f} ms "
            f"({r['restart_followup_ttft_ratio']:.2f}x cold), warm "
            f"{r['warm_followup_ttft_s'] * 1000:.0f} ms ({r['warm_followup_ttft_ratio']:.2f}x), "
            f"cold {r['cold_ttft_s'] * 1000:.0f} ms"
            + (f"; tokens reused {reused}" if reused else "")
        )
    for name, d in res.get("disk_bytes", {}).items():
        if "tokens" not in d:
            continue
        formula = f" (formula {d['formula_bytes']:,} B)" if "formula_bytes" in d else ""
        click.echo(
            f"{name} on disk: {d['bytes_per_token']:,.1f} bytes per token, a "
            f"{d['tokens']}-token prefix in {d['files']} files, {d['bytes']:,} B{formula}; the "
            f"folder {d['folder_entries']} entries, {d['folder_bytes']:,} B"
        )
    if p := res.get("disk_projection"):
        click.echo(
            f"on disk at DeepSeek-V3 width, {p['tokens']:,} tokens (a projection from the "
            f"per-row formula, not measured): INT2 {size(p['int2_bytes'])} "
            f"({p['int2_bytes_per_token']:,.1f} B/token), bf16 {size(p['bf16_bytes'])} "
            f"({p['bf16_bytes_per_token']:,.1f} B/token), {p['bf16_over_int2']:.2f}x; "
            f"format 3 (a window per 2,048-token chunk) {size(p['int2_format3_bytes'])}"
        )
    if cap := res.get("capacity"):
        for name, s in cap["servers"].items():
            click.echo(
                f"capacity, {cap['clients']} clients, {name} (max batch {s['max_batch']}): "
                f"{s['tokens_per_s']:.1f} tok/s, p50 {s['latency_p50_s']:.2f} s, "
                f"p95 {s['latency_p95_s']:.2f} s, refused {s['refused']}"
            )
        click.echo(
            f"capacity: default / best fixed ({cap['best_fixed']}) = {cap['default_over_best']:.2f}x"
        )
