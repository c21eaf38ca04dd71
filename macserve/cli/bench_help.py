"""`macserve bench help`: the wall time of every command's `--help` (the work is in
dev/startup.py; the command tree from cli/lazy.py)."""

from __future__ import annotations

import json

import click

from ..dev.startup import time_commands
from . import main
from .lazy import walk


def bench_help(runs, as_json):
    paths = [("--help",)] + [(*path, "--help") for path, cmd in walk(main) if not cmd.hidden]
    base, timings = time_commands(paths, runs)
    if as_json:
        rows = {" ".join(t.args): list(t.seconds) for t in [base, *timings]}
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(
        f"wall seconds over {runs} runs, each a fresh interpreter; x = median / the bare one's"
    )
    click.echo(f"{'command':34} {'min':>6} {'median':>7} {'max':>6} {'x':>6}")
    for t in [base, *timings]:
        name = "python -c pass" if t is base else "macserve " + " ".join(t.args)
        click.echo(
            f"{name[:34]:34} {min(t.seconds):6.2f} {t.median:7.2f} {max(t.seconds):6.2f} "
            f"{t.median / base.median:6.2f}"
        )
    slowest = max(timings, key=lambda t: t.median)
    click.echo(f"slowest: macserve {' '.join(slowest.args)}, median {slowest.median:.2f} s")
