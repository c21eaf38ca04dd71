"""What keeps `macserve ... --help` instant: commands and their bodies imported by name, late.

A command's declaration (its arguments, options and help, in cli/commands/) imports click and
the leaves only; its body (in cli/<family>.py, which imports its wing at the top) is named as
"module:function" and imported when the command runs. So `--help`, `-h` and shell completion of
any command load no wing: mlx-lm alone takes seconds to import. The names are strings, out of
sight of tests/test_architecture.py's import graph, so tests/test_cli_help.py resolves every
one and checks that each body takes exactly its declaration's parameters.
"""

from __future__ import annotations

import functools
import importlib

import click


def resolve(target: str):
    """The object `module:attr` names, importing its module."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def later(target: str):
    """A function that calls `target` ("module:function") with its arguments, importing it only
    then: an option's callback, which click calls while parsing, never for --help."""

    def call(*args, **kwargs):
        return resolve(target)(*args, **kwargs)

    call.runs = target  # read by tests/test_cli_help.py
    return call


def runs(target: str):
    """Decorate a declaration (a function whose body is its docstring) so that calling it calls
    `target` ("module:function") with the same arguments, importing it only then."""

    def wrap(decl):
        return functools.wraps(decl)(later(target))

    return wrap


def _clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(width - 3, 1)].rsplit(" ", 1)[0] + "..."


class LazyGroup(click.Group):
    """A click group whose subcommands are ("module:attr", summary), imported on use; its
    --help lists them from the summaries, importing nothing."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            return resolve(self.lazy[name][0])
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy:
                rows.append((name, self.lazy[name][1]))
            else:
                cmd = super().get_command(ctx, name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str(formatter.width)))
        if rows:
            width = formatter.width - 6 - max(len(n) for n, _ in rows)
            with formatter.section("Commands"):
                formatter.write_dl([(n, _clip(h, width)) for n, h in rows])


def walk(group: click.Group, path: tuple[str, ...] = ()):
    """(path, command) for every command and subcommand under `group`, as click resolves them:
    the declarations only, so walking imports no wing."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))
