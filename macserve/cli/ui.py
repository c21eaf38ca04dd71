"""`macserve ui`: open the running router's web page. Parsing and printing only; where the
routers run is what they publish (services/routed.py).
Each command's arguments, options and help: cli/commands/ui.py."""

from __future__ import annotations

import webbrowser

import click

from ..errors import MacserveError
from ..services import routed


def ui(print_only, port):
    routers = [r for r in routed.live() if port is None or r.get("port") == port]
    if not routers:
        raise MacserveError(
            "no router is running"
            + (f" on port {port}" if port else "")
            + ": start one (macserve router, or macserve router --install)"
        )
    if len(routers) > 1:
        ports = ", ".join(str(r.get("port")) for r in routers)
        raise MacserveError(f"several routers run (ports {ports}): pick one with --port")
    url = routers[0]["url"] + "/ui"
    click.echo(url)
    if not print_only and not webbrowser.open(url):
        click.echo("(no browser here: open that URL in one)", err=True)
