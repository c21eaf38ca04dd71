"""`macserve ui`: what it accepts; the body is in cli/ui.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.ui:"


@click.command()
@click.option("--print", "print_only", is_flag=True, help="Print the URL; open nothing.")
@click.option("--port", type=int, help="The router on this port (when several run).")
@runs(_BODY + "ui")
def ui(print_only, port):
    """Open the router's web page (profiles, memory, actions, live speed, logs, chat) in a
    browser. It is served by the running `macserve router`, under its key and Host rules."""
