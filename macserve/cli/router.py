"""`macserve router`: one endpoint for every profile, in the foreground or as a service.

Its own module so the other service commands never import the HTTP stack (starlette, uvicorn).
Parsing and printing only; the work is in router/ and services/manager.py.
Each command's arguments, options and help: cli/commands/router.py.
"""

from __future__ import annotations

import click

from ..errors import MacserveError
from ..router import app as router_app
from ..router.model import Settings as RouterSettings
from ..services import manager
from ..services.profiles import NEVER, parse_duration
from ..services.providers import url_host
from ..services.providers.router import DEFAULT_PORT as ROUTER_PORT
from ..sizing.budget import parse_size
from .services import _read_secret, _run_waiting


def ttl_value(ctx, param, value: str):
    """Seconds, or None for never; checked while parsing, so `set router -- EXTRA_ARGS+=...`
    (macserve parse-args router) refuses a bad one before any restart."""
    ctx.meta["router.ttl"] = value  # as typed, for --install's EXTRA_ARGS
    try:
        return None if value.strip().lower() == NEVER else parse_duration(value, "--ttl")
    except MacserveError as e:
        raise click.BadParameter(str(e).removeprefix("bad --ttl ")) from None


def memory_value(ctx, param, value: str | None):
    ctx.meta["router.memory"] = value
    try:
        return parse_size(value) if value else None
    except MacserveError as e:
        raise click.BadParameter(str(e)) from None


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
    if install:
        given = lambda p: ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE  # noqa: E731
        args = []
        for opt, param, value in (
            ("--ttl", "ttl", ctx.meta["router.ttl"]),
            ("--memory", "memory", ctx.meta["router.memory"]),
            ("--keep-alive", "keep_alive", f"{keep_alive:g}"),
            ("--start-timeout", "start_timeout", f"{start_timeout:g}"),
        ):
            if given(param):
                args += [opt, value]
        if allow_unauthenticated:
            args.append("--allow-unauthenticated")
        if allowed_hosts:
            args += ["--allowed-hosts", allowed_hosts]
        key = api_key if given("api_key") else None  # not one exported for `chat`
        if key == "-":
            key = _read_secret("API_KEY")
        out = _run_waiting(
            name,
            manager.new_router,
            name,
            host,
            port,
            args,
            api_key=key,
            start=not no_start,
            timeout=timeout,
        )
        if no_start:
            click.echo(f"{out.name}: profile written; start it with: macserve start {out.name}")
        else:
            click.echo(
                f"{out.name}: routing at {out.url}/v1, web page at {out.url}/ui (pid {out.pid})"
            )
        return
    url = f"http://{url_host(host)}:{port or ROUTER_PORT}"
    click.echo(f"router: API at {url}/v1, web page at {url}/ui", err=True)
    router_app.run(
        RouterSettings(
            host=host,
            port=port or ROUTER_PORT,
            ttl=ttl,
            memory_bytes=memory,
            keep_alive=keep_alive,
            start_timeout=start_timeout,
            api_key=api_key or None,
            allow_unauthenticated=allow_unauthenticated,
            allowed_hosts=tuple(h.strip() for h in allowed_hosts.split(",") if h.strip()),
        )
    )
