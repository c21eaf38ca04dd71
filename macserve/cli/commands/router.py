"""`macserve router`: what it accepts; the body (and its options' checks) in cli/router.py."""

from __future__ import annotations

import click

from ... import env
from ..lazy import later, runs

_BODY = "macserve.cli.router:"
# the wings' (services/providers/router.py, router/model.py: starlette and
# uvicorn); tests/test_cli_help.py checks that they agree
ROUTER_PORT = 8000
DEFAULT_START_TIMEOUT = 300.0


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help=f"Default: {ROUTER_PORT}; with --install, the first free port from {ROUTER_PORT}.",
)
@click.option(
    "--ttl",
    default="5m",
    callback=later(_BODY + "ttl_value"),
    show_default=True,
    help="Stop a profile after this long without a request (90s, 10m, 1h, or never); a "
    "profile's TTL key overrides it, TTL=never keeps it running.",
)
@click.option(
    "--memory",
    callback=later(_BODY + "memory_value"),
    help="Plan for a Mac with this much RAM (e.g. 192GB; the budget is its GPU working set). "
    "Default: this Mac's GPU wired limit.",
)
@click.option(
    "--keep-alive",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Seconds a streaming request waits for a starting model before it gets its 200 and "
    "an SSE comment this often until the model is up; 0 holds it.",
)
@click.option(
    "--start-timeout",
    type=click.FloatRange(1),
    default=DEFAULT_START_TIMEOUT,
    show_default=True,
    help="Seconds a model may take to become healthy (or to find room).",
)
@click.option(
    "--api-key",
    envvar=env.API_KEY,
    show_envvar=True,
    help="Require this key (Authorization: Bearer KEY or x-api-key). Each profile's own key "
    "is sent to its server by the router.",
)
@click.option(
    "--allow-unauthenticated",
    is_flag=True,
    help="Without --api-key, still forward to profiles that have their own API_KEY (anyone "
    "who reaches the router then uses their key). Default: such requests get 401.",
)
@click.option(
    "--allowed-hosts",
    default="",
    help="Bound to loopback, the Host names accepted besides localhost / 127.0.0.1 / [::1] "
    "(comma-separated): a page whose name resolves to this Mac (DNS rebinding) is refused.",
)
@click.option("--install", is_flag=True, help="Install it as a supervised service and start it.")
@click.option("--name", default="router", show_default=True, help="The service's profile name.")
@click.option("--no-start", is_flag=True, help="With --install: write the profile only.")
@click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=60.0,
    show_default=True,
    help="With --install: seconds to wait for the router to answer.",
)
@click.pass_context
@runs(_BODY + "router")
def router(
    ctx,
    host,
    port,
    ttl,
    memory,
    keep_alive,
    start_timeout,
    api_key,
    allow_unauthenticated,
    allowed_hosts,
    install,
    name,
    no_start,
    timeout,
):
    """One OpenAI- and Anthropic-compatible endpoint for every profile: each request goes to
    the profile its `model` names (or one of its ALIASES), started on demand, stopped after
    its TTL of idleness, and never more at once than fits the GPU memory budget (the least
    recently used ones are stopped first). Runs in the foreground, or with --install as a
    supervised service like any profile."""
