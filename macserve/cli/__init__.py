"""The `macserve` command group: parse and print only; the work is in the wings.

Every command is registered here, by name, as "module:function". A command's module is
imported when that command runs (or when --help lists them all), so `macserve inspect`
never imports mlx, httpx or the service machinery: its cold start stays well under a second.
Each cli module imports its wing at the top.
"""

from __future__ import annotations

import importlib
import sys

import click

from ..errors import MacserveError


class LazyGroup(click.Group):
    """A click group whose subcommands are named "module:attr" and imported on use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, _, attr = self.lazy[name].partition(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


class _Main(LazyGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MacserveError as e:
            # One line, exit 2, no traceback: what a user can act on.
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


_S = "macserve.cli.services:"
COMMANDS = {
    "inspect": "macserve.cli.inspect:inspect",
    "new": _S + "new",
    "worker": _S + "worker",
    "router": "macserve.cli.router:router",
    "set": _S + "set_",
    "run": _S + "run",
    "ls": _S + "ls",
    "status": _S + "status",
    "show": _S + "show",
    "start": _S + "start",
    "stop": _S + "stop",
    "restart": _S + "restart",
    "logs": _S + "logs",
    "rm": _S + "rm",
    "pull": _S + "pull",
    "doctor": _S + "doctor",
    "parse-args": _S + "parse_args",
    "preflight": "macserve.cli.preflight:preflight",
    "serve": "macserve.cli.serve:serve",
    "chat": "macserve.cli.chat:chat",
    "calibrate": "macserve.cli.engine:calibrate",
    "generate": "macserve.cli.engine:generate",
}
BENCH = {
    "kv": "macserve.cli.engine:bench_kv",
    "mtp": "macserve.cli.engine:bench_mtp",
    "dsa": "macserve.cli.engine:bench_dsa",
    "engine": "macserve.cli.engine:bench_engine",
    "serve": "macserve.cli.engine:bench_serve",
}
DEV = {
    "train-tiny": "macserve.cli.dev:train_tiny",
    "export-gguf": "macserve.cli.dev:export_gguf_cmd",
    "mlx-check": "macserve.cli.dev:mlx_check_cmd",
    "llama-truth": "macserve.cli.dev:llama_truth_cmd",
    "launchd-plists": "macserve.cli.dev:launchd_plists_cmd",
}


@click.group(cls=_Main, lazy=COMMANDS)
@click.version_option(package_name="macserve")
def main():
    """Serve large local models on a Mac: size, supervise, chat."""


@main.group(cls=LazyGroup, lazy=BENCH)
def bench():
    """Benchmarks to run on your own Mac (ratios against a baseline in the same run)."""


@main.group(cls=LazyGroup, lazy=DEV)
def dev():
    """Developer commands: train the demo model, export GGUF twins, render launchd/."""
