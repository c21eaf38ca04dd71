"""`macserve --help` is the first thing a new user types: it lists the commands from their
registered summaries and imports none of the wings (mlx-lm alone takes seconds to import);
`-h` works everywhere. What is imported is checked here, which does not depend on the
machine's speed; the wall time is measured in docs/architecture.md."""

import ast
import importlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from macserve.cli import BENCH, COMMANDS, DEV, main

from .conftest import REPO

HEAVY = ("mlx", "mlx_lm", "transformers", "numpy", "httpx", "starlette", "uvicorn", "psutil")


def _loaded_after(args: list[str]) -> list[str]:
    code = (
        "import sys\n"
        "from macserve.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "Commands:" in r.stdout
    return ast.literal_eval(r.stdout[r.stdout.rindex("LOADED") + len("LOADED") :].strip())


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["bench", "--help"], ["dev", "-h"]])
def test_group_help_imports_no_wing(args):
    mods = _loaded_after(args)
    heavy = sorted({m.split(".")[0] for m in mods} & set(HEAVY))
    wings = sorted(
        m
        for m in mods
        if m.startswith("macserve.")
        and m.split(".")[1] in {"services", "engine", "server", "sizing", "dev"}
    )
    assert heavy == [] and wings == [], (heavy, wings)


@pytest.mark.parametrize(
    "group,name",
    [(g, n) for g, table in (("", COMMANDS), ("bench", BENCH), ("dev", DEV)) for n in table],
)
def test_each_summary_is_how_its_command_begins(group, name):
    table = {"": COMMANDS, "bench": BENCH, "dev": DEV}[group]
    spec, summary = table[name]
    module, _, attr = spec.partition(":")
    cmd = getattr(importlib.import_module(module), attr)
    first = " ".join((cmd.help or "").split("\n\n")[0].split())
    assert first.startswith(summary.rstrip(".")), (name, summary, first)


def test_dash_h_everywhere_and_the_list_complete():
    r = CliRunner().invoke(main, ["-h"])
    assert r.exit_code == 0
    for name in COMMANDS:
        assert f"  {name} " in r.output, name
    r = CliRunner().invoke(main, ["ls", "-h"])
    assert r.exit_code == 0 and "Usage:" in r.output and "--json" in r.output


@pytest.mark.parametrize(
    "args,says",
    [
        (["inspect", "--ctx", "abc", "x"], "inspect: Invalid value for '--ctx'"),
        (["inspect"], "inspect: Missing argument 'SOURCE'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["bench", "kv"], "bench kv: Missing argument 'MODEL'"),
    ],
)
def test_click_errors_are_one_line_naming_the_option(args, says):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert "-h` for help" in lines[0]
