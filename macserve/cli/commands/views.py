"""`macserve ls`, `status`, `show`: what each accepts; the bodies are in cli/views.py."""

from __future__ import annotations

import click

from ..complete import profile_names
from ..lazy import runs

_BODY = "macserve.cli.views:"


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@runs(_BODY + "ls")
def ls(as_json):
    """Profiles with their service state, pid, port, uptime and memory."""


@click.command()
@click.argument("name", required=False, shell_complete=profile_names)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@runs(_BODY + "status")
def status(name, as_json):
    """Service state plus a live health probe, for one profile or all."""


@click.command()
@click.argument("name", shell_complete=profile_names)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@runs(_BODY + "show")
def show(name, as_json):
    """A profile: its file, the exact server command, and its service."""
