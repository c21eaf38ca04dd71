"""The `macserve` command group: parse and print only; the work is in the wings.

Each command is one click function in its family's module (cli/<family>.py): arguments,
options, help (the docstring, whose first sentence is its line in `macserve --help`) and body.
The families are named here, a module each, under the group they belong to; every click
command a family defines is a subcommand of that group, and a family is imported only when a
command is looked for there and not yet found (cli/lazy.py: `Families`). A family imports click
and the leaves only; the wing modules its bodies use are imported when a body first uses them
(cli/lazy.py: `lazy`). So `macserve --help`, every command's own `--help` and shell completion
import no wing, and `macserve inspect` never imports httpx or the service machinery.
tests/test_cli_help.py checks the modules each help loads and that every lazily named module
attribute a body reads exists.
"""

from __future__ import annotations

import sys

import click

from ..errors import MacserveError
from .lazy import Families

HELP = {"help_option_names": ["-h", "--help"]}  # inherited by every subcommand's context


class _Main(Families):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MacserveError as e:
            # One line, exit 2, no traceback: what a user can act on.
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except click.UsageError as e:
            # click's own form is three lines (usage, a hint, then the error): one line
            # naming the option, the command and where its help is.
            where = e.ctx.command_path if e.ctx else ctx.command_path
            click.echo(f"error: {where}: {e.format_message()} (`{where} -h` for help)", err=True)
            sys.exit(2)


def _families(*names: str) -> tuple[str, ...]:
    return tuple(f"macserve.cli.{n}" for n in names)


# The most used first: a family is imported only until the command named is found.
@click.group(
    cls=_Main,
    families=_families(
        "services",
        "lifecycle",
        "views",
        "chat",
        "inspect",
        "router",
        "launch",
        "ui",
        "preflight",
        "serve",
        "engine",
    ),
    context_settings=HELP,
)
@click.version_option(package_name="macserve")
def main():
    """Serve large local models on a Mac: size, supervise, chat."""


@main.group(
    "bench",
    cls=Families,
    families=_families(
        "bench",
        "bench_engine",
        "bench_serve",
        "bench_startup",
        "bench_memory",
        "bench_twin",
        "bench_agent",
    ),
)
def bench_group():
    """Benchmarks to run on your own Mac (ratios against a baseline in the same run)."""


@main.group("dev", cls=Families, families=_families("dev", "dev_docs", "dev_transmla"))
def dev_group():
    """Developer commands: train the demo model, export GGUF twins, render launchd/."""
