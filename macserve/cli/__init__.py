"""The `macserve` command group. Each sub-module registers its own commands; no logic here."""

import sys

import click

from ..errors import MacserveError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MacserveError as e:
            # One line, exit 2, no traceback: what a user can act on.
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="macserve")
def main():
    """Serve large local models on a Mac: size, supervise, chat."""


@main.group()
def bench():
    """Benchmarks to run on your own Mac (ratios against a baseline in the same run)."""


@main.group()
def dev():
    """Developer commands: train the demo model, export GGUF twins."""


def _register():
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_register()
