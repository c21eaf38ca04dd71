"""Shell completion of profile names (click's: `eval "$(_MACSERVE_COMPLETE=bash_source
macserve)"` in ~/.bashrc, zsh_source in ~/.zshrc, fish_source for fish; docs/services.md)."""

from __future__ import annotations

from click.shell_completion import CompletionItem

from .. import env


def profile_names(ctx, param, incomplete: str) -> list[CompletionItem]:
    """The profiles whose names start with what is typed: the files in $MACSERVE_HOME/profiles
    (read by name only, so completing is instant and never fails on a bad profile)."""
    folder = env.home() / "profiles"
    try:
        names = sorted(p.stem for p in folder.glob("*.env"))
    except OSError:
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]
