"""What keeps `macserve ... --help` instant: a command's body imports its wing when it runs.

Each command is one click function (cli/<family>.py): its arguments, options and help in the
decorators and docstring, its body below. A family module loads click and the leaves only; the
wing modules a body uses are named at the top as `lifecycle = lazy("macserve.services.lifecycle")`,
and imported the first time the body reads an attribute of them (`lifecycle.start(...)`). So
`--help`, `-h` and shell completion of any command load no wing: mlx-lm alone takes seconds to
import. The families themselves are imported by a `Families` group only until the command
asked for is found (all of them for a group's --help, which lists every summary): their click
declarations cost ~1-3 ms each. The names are strings, out of sight of
tests/test_architecture.py's import graph (cli is its top, allowed to import anything), so
tests/test_cli_help.py imports every one and checks that each attribute a body reads exists.
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
    """`name`, a module path ("macserve.services.lifecycle"), imported when first used. Typed
    Any: its attributes are the module's, which a checker cannot know from a string."""
    return Lazy(name)


class Families(click.Group):
    """A click group whose subcommands are every click command defined at the top level of its
    family modules (cli/<family>.py, named as "macserve.cli.<family>"), each under its own name;
    a family is imported when a command not yet found is looked for, in the order given."""

    def __init__(self, *args, families: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.families = list(families)  # those not imported yet

    def _import_next(self) -> None:
        module = importlib.import_module(self.families.pop(0))
        for v in vars(module).values():
            if isinstance(v, click.Command) and v.callback.__module__ == module.__name__:
                if v.name in self.commands:
                    raise RuntimeError(f"{module.__name__} defines {v.name!r} again")
                self.add_command(v)

    def get_command(self, ctx, name):
        while name not in self.commands and self.families:
            self._import_next()
        return self.commands.get(name)

    def list_commands(self, ctx):
        while self.families:
            self._import_next()
        return super().list_commands(ctx)


def walk(group: click.Group, path: tuple[str, ...] = ()):
    """(path, command) for every command and subcommand under `group`, as click resolves them:
    walking it imports no wing."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))
