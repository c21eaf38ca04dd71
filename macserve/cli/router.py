"""`macserve router`: one endpoint for every profile, in the foreground or as a service.

Parsing and printing only; the work is in router/ and services/create.py (`router --install`).
"""

from __future__ import annotations

import click

from .. import env
from ..errors import MacserveError
from .lazy import lazy
from .services import read_secret, run_waiting

budget = lazy("macserve.sizing.budget")
create = lazy("macserve.services.create")
profiles = lazy("macserve.services.profiles")
values = lazy("macserve.services.values")
providers = lazy("macserve.services.providers")
router_app = lazy("macserve.router.app")
router_model = lazy("macserve.router.model")

# the wings' (services/providers/router.py, router/model.py: starlette and
# uvicorn); tests/test_cli_help.py checks that they agree
ROUTER_PORT = 8000
DEFAULT_START_TIMEOUT = 300.0


def ttl_value(ctx, param, value: str):
    """Seconds, or None for never; checked while parsing, so `set router -- EXTRA_ARGS+=...`
    (macserve parse-args router) refuses a bad one before any restart."""
    ctx.meta["router.ttl"] = value  # as typed, for --install's EXTRA_ARGS
    try:
        return (
            None
            if value.strip().lower() == profiles.NEVER
            else values.parse_duration(value, "--ttl")
        )
    except MacserveError as e:
        raise click.BadParameter(str(e).removeprefix("bad --ttl ")) from None


def memory_value(ctx, param, value: str | None):
    ctx.meta["router.memory"] = value
    try:
        return budget.parse_size(value) if value else None
    except MacserveError as e:
        raise click.BadParameter(str(e)) from None


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
    callback=ttl_value,
    show_default=True,
    help="Stop a profile after this long without a request (90s, 10m, 1h, or never); a "
    "profile's TTL key overrides it, TTL=never keeps it running.",
)
@click.option(
    "--memory",
    callback=memory_value,
    help="Plan for a Mac with this much RAM (e.g. 192GB; the budget is its GPU working set). "
    "Default: this Mac's GPU wired limit.",
)
@click.option(
    "--keep-alive",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Seconds a streaming request waits for a starting model before it gets its 200 and "
    "a keep-alive this often until the model is up (Anthropic's ping events, SSE comments, "
    "or the loading note); 0 holds it.",
)
@click.option(
    "--loading-note/--no-loading-note",
    default=True,
    show_default=True,
    help="Keep-alives carry a visible note, loading NAME, 12 s, as the answer's reasoning "
    "(chat completions' reasoning_content, an Anthropic thinking block, a Responses "
    "reasoning summary); without it, SSE comments and Anthropic pings.",
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
def router(
    ctx,
    host,
    port,
    ttl,
    memory,
    keep_alive,
    loading_note,
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
        if not loading_note:
            args.append("--no-loading-note")
        if allow_unauthenticated:
            args.append("--allow-unauthenticated")
        if allowed_hosts:
            args += ["--allowed-hosts", allowed_hosts]
        key = api_key if given("api_key") else None  # not one exported for `chat`
        if key == "-":
            key = read_secret("API_KEY")
        out = run_waiting(
            name,
            create.new_router,
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
    url = f"http://{providers.url_host(host)}:{port or ROUTER_PORT}"
    click.echo(f"router: API at {url}/v1, web page at {url}/ui", err=True)
    router_app.run(
        router_model.Settings(
            host=host,
            port=port or ROUTER_PORT,
            ttl=ttl,
            memory_bytes=memory,
            keep_alive=keep_alive,
            loading_note=loading_note,
            start_timeout=start_timeout,
            api_key=api_key or None,
            allow_unauthenticated=allow_unauthenticated,
            allowed_hosts=tuple(h.strip() for h in allowed_hosts.split(",") if h.strip()),
        )
    )
