"""`macserve ui`: open the running router's web page. Parsing and printing only; where the
routers run is what they publish (services/routed.py)."""

from __future__ import annotations

import click

from ..errors import MacserveError
from .lazy import lazy

routed = lazy("macserve.services.routed")
webbrowser = lazy("webbrowser")  # 20 ms of imports only `ui` needs


@click.command()
@click.option("--print", "print_only", is_flag=True, help="Print the URL; open nothing.")
@click.option("--port", type=int, help="The router on this port (when several run).")
def ui(print_only, port):
    """Open the router's web page (profiles, memory, actions, live speed, logs, chat) in a
    browser. It is served by the running `macserve router`, under its key and Host rules."""
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
