"""A server's flags, for EXTRA_ARGS: its `--help` read into a flag table ({flag: (canonical
name, takes a value)}, cached per binary), EXTRA_ARGS checked against it (unknown, removed and
reserved flags refused) or by macserve's own click parser, and edited by it (`EXTRA_ARGS+=`).

What a provider reserves (the flags macserve sets from the profile's keys) is the provider's
own table (`BaseProvider.taken`); these functions take it as an argument.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write

_OPT_LINE = re.compile(r"^( {0,4})(-\S.*)$")


def flags_from_help(text: str) -> dict[str, bool]:
    """{flag: takes_value} from a llama.cpp- or argparse-style help text.

    Option lines start (at most 4 spaces in) with '-': "-c,    --ctx-size N   description" or
    "  --model MODEL   description". Description continuation lines are indented further, so
    a '- row: ...' bullet inside a description is not mistaken for a flag.
    """
    return {flag: takes for flag, (_, takes) in flag_table(text).items()}


def flag_table(text: str) -> dict[str, tuple[str, bool]]:
    """{flag: (its canonical name, takes_value)}: the aliases on one help line (`-c, --ctx-size N`)
    share the canonical name (the last one listed), so `-c` and `--ctx-size` are one flag."""
    table: dict[str, tuple[str, bool]] = {}
    for line in text.splitlines():
        m = _OPT_LINE.match(line)
        if not m:
            continue
        # llama.cpp pads after "-c," to align columns: squeeze that before cutting at the
        # two-space gap that separates the option spec from its description.
        spec = re.sub(r",\s+", ", ", m.group(2).strip())
        spec = re.split(r"\s{2,}", spec, maxsplit=1)[0]
        parts = [p.strip() for p in spec.split(", ")]
        takes = any(" " in p or "=" in p for p in parts)
        names = [p.split(" ", 1)[0].split("=", 1)[0] for p in parts]
        names = [n for n in names if re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_.-]*", n)]
        for n in names:
            table[n] = (names[-1], takes)
    return table


def is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not re.fullmatch(r"-\d.*", arg)


def normalize_flag(flag: str) -> str:
    # llama.cpp (and click) accept --ctx_size for --ctx-size
    return flag.replace("_", "-") if flag.startswith("--") else flag


def flag_groups(
    args: list[str], table: dict[str, tuple[str, bool]]
) -> list[tuple[str | None, list[str]]]:
    """EXTRA_ARGS as (canonical flag or None for a stray value, [flag, value?]) groups. A flag
    the table does not know takes the next word when that word is not a flag."""
    out: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not is_flag(a):
            out.append((None, [a]))
            i += 1
            continue
        flag, eq, _ = a.partition("=")
        norm = normalize_flag(flag)
        canon, takes = table.get(norm, (norm, None))
        if takes is None:
            takes = i + 1 < len(args) and not is_flag(args[i + 1])
        if takes and not eq and i + 1 < len(args):
            out.append((canon, [a, args[i + 1]]))
            i += 2
        else:
            out.append((canon, [a]))
            i += 1
    return out


def flag_value(args: tuple[str, ...] | list[str], *names: str) -> str | None:
    """The value of the last of `names` in `args` (`-c 512`, `--ctx-size=512`), or None."""
    value = None
    for i, a in enumerate(args):
        flag, eq, v = a.partition("=")
        if normalize_flag(flag) in names:
            value = v if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def edit_flags(
    args: list[str],
    add: list[str],
    drop: list[str],
    table: dict[str, tuple[str, bool]],
) -> list[str]:
    """`EXTRA_ARGS+=` / `EXTRA_ARGS-=`: each flag in `add` replaces the same flag (any alias) in
    place, or is appended; each flag in `drop` is removed with its value."""
    groups = flag_groups(args, table)
    # flags to drop are named without values: each is looked up alone
    gone = {table.get(normalize_flag(f), (normalize_flag(f), None))[0] for f in drop if is_flag(f)}
    groups = [(c, g) for c, g in groups if c is None or c not in gone]
    for canon, new in flag_groups(add, table):
        at = [i for i, (c, _) in enumerate(groups) if canon is not None and c == canon]
        if at:
            groups[at[0]] = (canon, new)
            groups = [g for i, g in enumerate(groups) if i not in at[1:]]
        else:
            groups.append((canon, new))
    return [a for _, g in groups for a in g]


def help_text(cmd: list[str], key_path: str) -> str:
    """`cmd --help` output, cached on disk per binary path + mtime + size (help runs are slow:
    mlx_lm imports mlx). A rebuilt or upgraded binary gets a new key, so the cache never lies."""
    try:
        st = os.stat(key_path)
    except OSError:
        raise MacserveError(f"{key_path} not found") from None
    ident = f"{os.path.realpath(key_path)}\0{st.st_mtime_ns}\0{st.st_size}\0{cmd}"
    cache = env.home() / "cache" / f"help-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.txt"
    try:
        return cache.read_text()
    except OSError:
        pass
    try:
        r = subprocess.run(
            cmd + ["--help"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MacserveError(f"could not run {shlex.join(cmd)} --help: {e}") from None
    text = r.stdout + "\n" + r.stderr
    if r.returncode != 0 or not flags_from_help(text):
        raise MacserveError(f"{shlex.join(cmd)} --help failed (exit {r.returncode})")
    atomic_write(cache, text)
    return text


def help_flags(cmd: list[str], key_path: str) -> dict[str, bool]:
    return flags_from_help(help_text(cmd, key_path))


def removed_flags(text: str) -> dict[str, str]:
    """Flags llama.cpp still lists but rejects at start ("the argument has been removed. use
    --spec-draft-n-max ..."): {flag: that message}. Listing them is how it points to the new name."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _OPT_LINE.match(line)
        if not m:
            continue
        parts = re.split(r"\s{2,}", re.sub(r",\s+", ", ", m.group(2).strip()), maxsplit=1)
        desc = parts[1] if len(parts) > 1 else ""
        if "has been removed" not in desc:
            continue
        for cont in lines[i + 1 :]:
            c = cont.strip()
            if not cont.startswith(" " * 8) or not c or c.startswith("(env:"):
                break
            desc += " " + c
        for p in parts[0].split(", "):
            out[p.split(" ", 1)[0]] = " ".join(desc.split())
    return out


def check_flags(
    args: list[str],
    flags: dict[str, bool],
    what: str,
    reserved: dict[str, str] | None = None,
    removed: dict[str, str] | None = None,
) -> None:
    """Refuse unknown or removed flags, a value-taking flag at the end, and flags macserve sets
    itself."""
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("-") or re.fullmatch(r"-\d.*", a) or a == "-":
            continue  # a value, or a negative number
        flag, eq, _ = a.partition("=")
        norm = flag.replace("_", "-") if flag.startswith("--") else flag
        if norm not in flags:
            raise MacserveError(f"{what} does not accept {flag} (checked against its --help)")
        if removed and norm in removed:
            raise MacserveError(f"{what}: {flag}: {removed[norm]}")
        if reserved and norm in reserved:
            raise MacserveError(
                f"{flag} is set by macserve from the profile; use the {reserved[norm]} key"
            )
        if flags[norm] and not eq:
            if i >= len(args):
                raise MacserveError(f"{flag} expects a value")
            i += 1


def cli_parse(command: str, args: list[str]) -> None:
    """`macserve COMMAND`'s own click parser on `args` (types, ranges, choices, unknown
    options), run as `macserve parse-args COMMAND ...` in a subprocess: services never import
    the CLI. One-line MacserveError with click's reason."""
    here = str(Path(__file__).resolve().parents[3])  # this checkout (or site-packages)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "macserve", "parse-args", command, "--", *args],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=path),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MacserveError(f"could not check the macserve {command} options: {e}") from None
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"exit {r.returncode}"
        raise MacserveError(why)
