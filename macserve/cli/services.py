"""The commands that write a profile: `new`, `worker`, `set`, and `pull` (new's download
step) and the hidden `parse-args` (how the services check a `macserve serve` profile's flags);
and the progress and secret prompts the service commands share (also cli/lifecycle.py,
cli/router.py, cli/chat.py). Parsing and printing only; the work is in services/create.py
(new, worker), services/edit.py (set) and services/pull.py.
"""

from __future__ import annotations

import itertools
import sys

import click

from ..errors import MacserveError
from .complete import profile_names
from .lazy import lazy

hub = lazy("macserve.services.pull")
create = lazy("macserve.services.create")
edit = lazy("macserve.services.edit")
health = lazy("macserve.services.health")
service_views = lazy("macserve.services.views")

TIMEOUT = click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the service to become healthy.",
)


class Waiting:
    """Progress while a service loads: a spinner on a terminal, one line otherwise."""

    def __init__(self, name: str):
        self.name = name
        self.tty = sys.stderr.isatty()
        self.spin = itertools.cycle("|/-\\")
        self.said = False

    def __call__(self, elapsed: float, status) -> None:
        if self.tty:
            click.echo(
                f"\r{next(self.spin)} waiting for {self.name} to become healthy "
                f"({status.state}, {elapsed:.0f}s) ",
                nl=False,
                err=True,
            )
        elif not self.said:
            click.echo(f"waiting for {self.name} to become healthy ...", err=True)
            self.said = True

    def done(self) -> None:
        if self.tty:
            click.echo("\r\033[K", nl=False, err=True)


def run_waiting(label, fn, *args, **kw):
    w = Waiting(label)
    try:
        return fn(*args, tick=w, **kw)
    except health.SetFailed as e:
        w.done()
        if e.log_tail:
            click.echo(f"--- last lines of {label}'s log with the failed settings ---", err=True)
            for line in e.log_tail:
                click.echo(f"  {line}", err=True)
            click.echo("---", err=True)
        raise
    finally:
        w.done()


def read_secret(key: str) -> str:
    """A secret from stdin: prompted without echo on a terminal, else the first line."""
    if sys.stdin.isatty():
        return click.prompt(key, hide_input=True, err=True)
    return sys.stdin.readline().strip()


def pull_model(source, quant):
    """`new`'s download step: `pull` with progress on stderr; the local path to serve."""
    click.echo(f"pulling {source} ...", err=True)
    return hub.pull(source, quant).model_path


def _ctx(value):
    if value is None or value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter("a positive number of tokens, or auto")
    return int(value)


@click.command()
@click.argument("source")
@click.option("--quant", help="GGUF quant to pick from a repo (or write REPO:QUANT).")
@click.option("--name", help="Profile name (default: from the model).")
@click.option(
    "--provider",
    type=click.Choice(["llama.cpp", "mlx", "macserve"]),
    help="Default: llama.cpp for GGUF, mlx for MLX/safetensors.",
)
@click.option(
    "--ctx",
    default="auto",
    show_default=True,
    help="Context tokens, or auto: the most that fits the memory budget.",
)
@click.option(
    "--kv",
    help="Cache type, in the provider's names (llama.cpp f16, q8_0, q4_0, ...; mlx bf16, q8, "
    "q4; macserve bf16, int2). Default: the provider's own.",
)
@click.option("--port", type=click.IntRange(1, 65535), help="Default: the first free from 8080.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--extra-args", default="", help="More server flags, e.g. '--threads 8'.")
@click.option("--no-start", is_flag=True, help="Write the profile only.")
@click.option(
    "--api-key",
    help="Require this key (Authorization: Bearer KEY); kept in the profile's 0600 secrets "
    "file and given to the server in its environment. '-' reads it from stdin.",
)
@TIMEOUT
def new(source, quant, name, provider, ctx, kv, port, host, extra_args, no_start, timeout, api_key):
    """Write a profile for SOURCE sized to this Mac, install the service and start it.
    A Hugging Face repo is downloaded first (macserve pull), with progress."""
    ctx = _ctx(ctx)
    if api_key == "-":
        api_key = read_secret("API_KEY")
    nm = name or create.default_name(source, quant)
    out = run_waiting(
        nm,
        create.new,
        source,
        quant=quant,
        name=name,
        provider=provider,
        ctx=ctx,
        port=port,
        host=host,
        extra_args=extra_args,
        start=not no_start,
        timeout=timeout,
        api_key=api_key,
        pull=pull_model,
        kv=kv,
    )
    for n in out.notes:
        click.echo(f"note: {n}", err=True)
    if no_start:
        click.echo(f"{out.name}: profile written; start it with: macserve start {out.name}")
    else:
        click.echo(service_views.outcome_line(out.name, "started", out.url, out.pid))


@click.command()
@click.argument("name")
@click.option(
    "--host",
    required=True,
    help="Address to bind: the one the head Mac reaches this "
    "Mac on (a Thunderbolt bridge or private LAN IP). RPC has no authentication.",
)
@click.option("--port", type=click.IntRange(1, 65535), help="Default: 50052 (rpc-server's).")
@click.option(
    "--extra-args",
    default="",
    help="More rpc-server flags, e.g. '-c' (cache received weights on disk) or '-t 8'.",
)
@click.option("--no-start", is_flag=True, help="Write the profile only.")
@click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the worker to listen.",
)
def worker(name, host, port, extra_args, no_start, timeout):
    """Run llama.cpp's rpc-server here as a supervised service. It is an RPC worker that
    another Mac's llama.cpp profile uses with HOSTS=THIS_HOST:PORT (BACKEND=rpc)."""
    out = run_waiting(
        name,
        create.new_worker,
        name,
        host,
        port=port,
        extra_args=extra_args,
        start=not no_start,
        timeout=timeout,
    )
    if no_start:
        click.echo(f"{out.name}: profile written; start it with: macserve start {out.name}")
    else:
        click.echo(
            f"{out.name}: rpc worker listening on {out.url} (pid {out.pid}); on the head: "
            f"macserve set PROFILE -- HOSTS={out.url} BACKEND=rpc"
        )


@click.command(name="set", context_settings={"ignore_unknown_options": True})
@click.argument("name", shell_complete=profile_names)
@click.argument("items", nargs=-1, type=click.UNPROCESSED)
@click.option("--no-restart", is_flag=True, help="Only write the profile (batch edits).")
@TIMEOUT
def set_(name, items, no_restart, timeout):
    """Change a profile and restart its service: set NAME -- KEY=VALUE ... | set NAME KEY VALUE.

    The new values are checked first (keys, ports, provider, and EXTRA_ARGS against the
    server). If the restarted service does not become healthy (or the wait is interrupted),
    the previous profile is put back, restarted and checked, the failed run's log is shown and
    the exit code is 2. An empty value (KEY=) removes an optional key.

    EXTRA_ARGS+='FLAG VALUE ...' sets or replaces single flags; EXTRA_ARGS-='FLAG ...' removes
    them. API_KEY=... and HF_TOKEN=... go to the profile's 0600 secrets file ('-' reads the
    value from stdin).
    """
    changes = edit.parse_assignments(items)
    secrets = {k: (read_secret(k) if v == "-" else v) for k, v in changes.secrets.items()}
    changes = edit.Changes(changes.values, secrets, changes.add_args, changes.drop_args)
    st = health.store()
    before = st.text(name)
    try:
        out = run_waiting(
            name, edit.set_values, name, changes, restart=not no_restart, timeout=timeout
        )
    except KeyboardInterrupt:
        # Before the restart (the checks: a server's --help, ssh): nothing was written. Once
        # the restart is under way, set's own handler rolls back and says so (SetFailed).
        if st.text(name) == before:
            raise MacserveError(f"interrupted: nothing changed ({name} is as it was)") from None
        raise MacserveError(
            f"interrupted while saving: the next macserve command puts {name} back"
        ) from None
    for n in out.notes:
        click.echo(f"{name}: {n}")
    if out.pid:
        click.echo(service_views.outcome_line(name, "restarted", out.url, out.pid))


@click.command()
@click.argument("source")
@click.option("--quant", help="GGUF quant to pick from a repo (or write REPO:QUANT).")
def pull(source, quant):
    """Download a Hugging Face model (org/name or org/name:QUANT) into the Hugging Face cache:
    only the files that quant or the MLX layout needs, with progress, resuming a partial
    download. `new` and `inspect` then use the cached copy, also offline."""
    p = hub.pull(source, quant)
    click.echo(f"{p.repo}{':' + p.quant if p.quant else ''}: {p.model_path}")


@click.command(
    name="parse-args",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
)
@click.argument("command")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def parse_args(ctx, command, args):
    """Parse ARGS with `macserve COMMAND`'s own click options, without running it: how the
    services check a `macserve serve` profile (services never import the CLI)."""
    cmd = ctx.find_root().command.get_command(ctx, command)
    if cmd is None:
        raise MacserveError(f"no command {command!r}")
    what = f"macserve {command}"
    try:
        cmd.make_context(what, list(args))
    except click.NoSuchOption as e:
        raise MacserveError(
            f"{what} does not accept {e.option_name} (checked by its parser)"
        ) from None
    except click.BadOptionUsage as e:
        if "requires an argument" in e.message:
            raise MacserveError(f"{e.option_name} expects a value") from None
        raise MacserveError(f"{what}: {e.format_message()}") from None
    except click.ClickException as e:
        raise MacserveError(f"{what}: {e.format_message()}") from None
