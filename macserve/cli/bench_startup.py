"""`macserve bench startup`: the wall time of every command's `--help` (the work is in
dev/startup.py; the command tree from cli/lazy.py's `walk`)."""

from __future__ import annotations

import json

import click

from .lazy import lazy, walk

startup = lazy("macserve.dev.startup")


@click.command("startup")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def bench_startup(ctx, runs, as_json):
    """Wall time of `macserve --help` and of every command's own --help, against the bare
    interpreter's in the same run."""
    main = ctx.find_root().command
    paths = [("--help",)] + [(*path, "--help") for path, cmd in walk(main) if not cmd.hidden]
    base, timings = startup.time_commands(paths, runs)
    if as_json:
        rows = {
            " ".join(t.args): {"wall": list(t.seconds), "cpu": list(t.cpu)}
            for t in [base, *timings]
        }
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(
        f"seconds over {runs} runs, each a fresh interpreter; x = median / the bare one's median"
    )
    click.echo(
        f"{'command':34} {'wall min':>8} {'median':>7} {'max':>6} {'x':>5} {'cpu median':>11} {'x':>5}"
    )
    for t in [base, *timings]:
        name = "python -c pass" if t is base else "macserve " + " ".join(t.args)
        click.echo(
            f"{name[:34]:34} {min(t.seconds):8.2f} {t.median:7.2f} {max(t.seconds):6.2f} "
            f"{t.median / base.median:5.2f} {t.cpu_median:11.2f} "
            f"{t.cpu_median / base.cpu_median:5.2f}"
        )
    slowest = max(timings, key=lambda t: t.median)
    click.echo(
        f"slowest: macserve {' '.join(slowest.args)}, wall median {slowest.median:.2f} s, "
        f"cpu median {slowest.cpu_median:.2f} s"
    )
