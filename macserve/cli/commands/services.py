"""The service commands (new, worker, set, run, start, stop, restart, logs, rm, pull, doctor,
parse-args): what each accepts; the bodies are in cli/services.py."""

from __future__ import annotations

import click

from ..complete import profile_names
from ..lazy import runs

_BODY = "macserve.cli.services:"

TIMEOUT = click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the service to become healthy.",
)


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
@runs(_BODY + "new")
def new(source, quant, name, provider, ctx, kv, port, host, extra_args, no_start, timeout, api_key):
    """Write a profile for SOURCE sized to this Mac, install the service and start it.
    A Hugging Face repo is downloaded first (macserve pull), with progress."""


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
@runs(_BODY + "worker")
def worker(name, host, port, extra_args, no_start, timeout):
    """Run llama.cpp's rpc-server here as a supervised service: an RPC worker that another
    Mac's llama.cpp profile uses with HOSTS=THIS_HOST:PORT (BACKEND=rpc)."""


@click.command(name="set", context_settings={"ignore_unknown_options": True})
@click.argument("name", shell_complete=profile_names)
@click.argument("items", nargs=-1, type=click.UNPROCESSED)
@click.option("--no-restart", is_flag=True, help="Only write the profile (batch edits).")
@TIMEOUT
@runs(_BODY + "set_")
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


@click.command()
@click.argument("source")
@click.option("--quant", help="GGUF quant to pick from a repo (or write REPO:QUANT).")
@runs(_BODY + "pull")
def pull(source, quant):
    """Download a Hugging Face model (org/name or org/name:QUANT) into the Hugging Face cache:
    only the files that quant or the MLX layout needs, with progress, resuming a partial
    download. `new` and `inspect` then use the cached copy, also offline."""


@click.command(
    name="parse-args",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
)
@click.argument("command")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@runs(_BODY + "parse_args")
def parse_args(ctx, command, args):
    """Parse ARGS with `macserve COMMAND`'s own click options, without running it: how the
    services check a `macserve serve` profile (services never import the CLI)."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@runs(_BODY + "run")
def run(name):
    """Run a profile's server in the foreground (what the service runs)."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--no-wait", is_flag=True, help="Do not wait for health.")
@TIMEOUT
@runs(_BODY + "start")
def start(name, no_wait, timeout):
    """Install (if needed) and start a profile's service."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@runs(_BODY + "stop")
def stop(name):
    """Stop a profile's service (it stays stopped until start)."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--no-wait", is_flag=True, help="Do not wait for health.")
@TIMEOUT
@runs(_BODY + "restart")
def restart(name, no_wait, timeout):
    """Restart a profile's service (reloading its unit if that changed)."""


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--memory", help="Check for a Mac with this much RAM (e.g. 192GB), not this one.")
@runs(_BODY + "doctor")
def doctor(as_json, memory):
    """Do the services that start at login fit the GPU memory? The wired limit and RAM, each
    profile's weights + cache at its context (inspect's figures), and the sysctl to raise it."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "lines", type=click.IntRange(0), default=50, show_default=True)
@runs(_BODY + "logs")
def logs(name, follow, lines):
    """A service's log (server output, plus one line per start)."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@runs(_BODY + "rm")
def rm(name):
    """Stop and uninstall a profile's service, then delete the profile (logs are kept)."""
