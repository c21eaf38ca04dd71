"""`macserve bench kv|mtp|dsa|serve`: what each accepts; the bodies are in cli/bench.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.bench:"
KV_SETS = ("all", "gate", "windows")  # engine/bench/kv.py's SETS, not imported: it loads mlx


@click.command("kv")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--rotation",
    type=click.Path(exists=True, dir_okay=False),
    help="calibration file (default: the model folder's latent-rotation.safetensors, "
    "else calibrate now on the training plays)",
)
@click.option(
    "--data",
    type=click.Path(exists=True, dir_okay=False),
    help="held-out text (default: the demo model's held-out plays)",
)
@click.option("--windows", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--gen-tokens", type=int, default=256, show_default=True)
@click.option("--contexts", default="1024,4096,16384", show_default=True)
@click.option(
    "--variants",
    "which",
    type=click.Choice(KV_SETS),
    default="all",
    show_default=True,
    help="all: every rotation and option; gate: uniform INT2 and INT4 against the "
    "calibration's per-layer plan; windows: the served cache at sink 64/128 x recent 256/512 "
    "and with no codes (a control)",
)
@click.option(
    "--gen-prompts",
    type=click.IntRange(0),
    default=4,
    show_default=True,
    help="held-out chat prompts each cache generates from freely (greedy, until end of turn "
    "or --gen-max-tokens), set against bf16's generation; 0 skips",
)
@click.option("--gen-prompt-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--gen-max-tokens", type=click.IntRange(1), default=700, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@runs(_BODY + "bench_kv")
def bench_kv(
    model,
    rotation,
    data,
    windows,
    seq_len,
    gen_tokens,
    contexts,
    which,
    gen_prompts,
    gen_prompt_tokens,
    gen_max_tokens,
    as_json,
):
    """Quality and decode speed of every latent-cache variant vs the bf16 latent cache."""


@click.command("dsa")
@click.option(
    "--contexts",
    default="4096,16384",
    show_default=True,
    help="cached tokens before the timed decode steps",
)
@click.option("--json", "as_json", is_flag=True)
@runs(_BODY + "bench_dsa")
def bench_dsa(contexts, as_json):
    """DSA decode on the INT2 cache: top-k rows only vs every row masked (a random model with
    DeepSeek-V3.2's cache dims; speed does not depend on trained weights)."""


@click.command("mtp")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-k",
    "ks",
    type=int,
    multiple=True,
    default=[1, 2, 3],
    show_default=True,
    help="draft lengths to measure",
)
@click.option("--prompts", type=int, default=8, show_default=True)
@click.option("--prompt-tokens", type=int, default=64, show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True, help="generated per prompt")
@click.option("--kv", type=click.Choice(["bf16", "int2"]), default="bf16", show_default=True)
@click.option("--rotation", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--llama-server",
    "llama_url",
    help="URL of a llama-server running the GGUF twin "
    "with --spec-type draft-mtp: its acceptance on the same prompts is reported",
)
@click.option("--json", "as_json", is_flag=True)
@runs(_BODY + "bench_mtp")
def bench_mtp(model, ks, prompts, prompt_tokens, tokens, kv, rotation, llama_url, as_json):
    """MTP drafting vs plain decoding: acceptance per position and decode tokens/s."""


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
@runs(_BODY + "bench_serve")
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


@click.command("startup")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@runs("macserve.cli.bench_startup:bench_startup")
def bench_startup(runs, as_json):
    """Wall time of `macserve --help` and of every command's own --help, against the bare
    interpreter's in the same run."""
