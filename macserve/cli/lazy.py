"""What keeps `macserve ... --help` instant: a command's body imports its wing when it runs.

Each command is one click function (cli/<family>.py): its arguments, options and help in the
decorators and docstring, its body below. Every family module is imported for any `macserve`
command, so at import it loads click and the leaves only; the wing modules a body uses are
named at the top as `manager = lazy("macserve.services.manager")`, and imported the first time
the body reads an attribute of them (`manager.start(...)`). So `--help`, `-h` and shell
completion of any command load no wing: mlx-lm alone takes seconds to import. The names are
strings, out of sight of tests/test_architecture.py's import graph (cli is its top, allowed
to import anything), so tests/test_cli_help.py imports every one and checks that each
attribute a body reads of it exists.
"""

from __future__ import annotations

import importlib
from typing import Any

import click


class Lazy:
    """A module imported on the first read of one of its attributes."""

    def __init__(self, name: str):
        self.__dict__["name"] = name  # `name` is read by tests/test_cli_help.py

    def __getattr__(self, attr: str) -> Any:
        # Only what is not on this object reaches here: the module's own attributes.
        return getattr(importlib.import_module(self.__dict__["name"]), attr)

    def __repr__(self) -> str:
        return f"<module {self.__dict__['name']!r}, imported on use>"


def lazy(name: str) -> Any:
    """`name`, a module path ("macserve.services.manager"), imported when first used. Typed
    Any: its attributes are the module's, which a checker cannot know from a string."""
    return Lazy(name)


def commands_in(*families) -> list[click.Command]:
    """The click commands defined at the top level of each family module (cli/<family>.py), in
    their order there: the subcommands cli/__init__.py gives a group, each under its own name."""
    return [
        v
        for module in families
        for v in vars(module).values()
        if isinstance(v, click.Command) and v.callback.__module__ == module.__name__
    ]


def walk(group: click.Group, path: tuple[str, ...] = ()):
    """(path, command) for every command and subcommand under `group`, as click resolves them:
    walking it imports no wing."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))
