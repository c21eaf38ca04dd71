"""`macserve preflight`: what it accepts; the body is in cli/preflight.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.preflight:"


@click.command()
@click.argument("name")
@runs(_BODY + "preflight")
def preflight(name):
    """Check a multi-host profile's hosts: ssh, Python/mlx/mlx-lm versions, model, memory."""
