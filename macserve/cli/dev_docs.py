"""`macserve dev transcripts`: the docs' transcripts, run against today's code."""

from pathlib import Path

import click

from ..errors import MacserveError
from .lazy import lazy

transcripts = lazy("macserve.dev.transcripts")


@click.command("transcripts")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    type=click.Choice(["check", "run"]),
    help="Which marked blocks to run (default: check and run).",
)
@click.option("--write", is_flag=True, help="Rewrite the blocks with what the commands print.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("."))
def transcripts_cmd(files, kinds, write, root):
    """Run the commands of README.md's and docs/'s transcripts and compare what they print.

    Each transcript is marked `<!-- transcript: check|run|skip REASON -->` on the line
    before its fence: `check` blocks are cheap (the tests run them), `run` blocks start
    servers (run them here by hand, with --write, before a release). Timings, pids and this
    machine's memory budget are masked; sizes and counts are compared. Exit 2 on a
    difference (or a transcript without a marker), printing each."""
    root = root.resolve()
    paths = [f.resolve() for f in files] or transcripts.doc_files(root)
    bad = transcripts.problems(paths)
    kinds = set(kinds or ("check", "run"))
    for p in paths:
        found = [b for b in transcripts.blocks(p) if b.kind in kinds]
        # Last block first: a rewrite moves the lines after it, never those before.
        for b in reversed(found) if write else found:
            click.echo(f"{b.where}: {b.kind}, {len(b.commands)} command(s)", err=True)
            got = transcripts.run(b, root)
            if write:
                transcripts.rewrite(b, got)
            else:
                bad += transcripts.diff(b, got)
    for line in bad:
        click.echo(line)
    if bad:
        raise MacserveError(f"{len(bad)} transcript(s) differ from what the code prints")
