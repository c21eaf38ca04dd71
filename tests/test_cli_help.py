"""`macserve --help` is the first thing a new user types, then a command's own `--help`: both
import none of the wings (mlx-lm alone takes seconds to import), and neither does shell
completion; `-h` works everywhere. What is imported is checked here, which does not depend on
the machine's speed; the wall times are printed by `python3 -m macserve bench startup`
(docs/architecture.md)."""

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from macserve.cli import BENCH, COMMANDS, DEV, main
from macserve.cli.lazy import resolve, walk

from .conftest import REPO

HEAVY = (
    "mlx",
    "mlx_lm",
    "transformers",
    "torch",
    "numpy",
    "httpx",
    "starlette",
    "uvicorn",
    "psutil",
)
WINGS = {"services", "engine", "server", "sizing", "dev", "chat"}


def _heavy(mods) -> list[str]:
    """The heavy packages and the wings' modules among `mods`."""
    return sorted(
        {m.split(".")[0] for m in mods} & set(HEAVY)
        | {m for m in mods if m.startswith("macserve.") and m.split(".")[1] in WINGS}
    )


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


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["--help"], ["-h"], ["bench", "--help"], ["dev", "-h"]])
def test_group_help_imports_no_wing(args):
    assert _heavy(_loaded_after(args)) == []


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


@pytest.mark.e2e
def test_every_commands_own_help_imports_no_wing():
    """`macserve CMD --help` for every command and subcommand of the tree, one after another in
    one interpreter: what each newly loads (modules only accumulate, so each is blamed on the
    first help that loaded it) holds no wing and no mlx, transformers, torch, httpx..."""
    code = (
        "import contextlib, io, json, sys\n"
        "from macserve.cli import main\n"
        "out = {}\n"
        "for path in json.loads(sys.argv[1]):\n"
        "    before = set(sys.modules)\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main([*path, '--help'], prog_name='macserve')\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    out[' '.join(path)] = [buf.getvalue(), sorted(set(sys.modules) - before)]\n"
        "print(json.dumps(out))\n"
    )
    paths = [path for path, _ in walk(main)]  # walked here: the child imports only what help does
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(paths)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert {"inspect", "new", "serve", "bench engine", "dev llama-truth"} <= set(seen)
    tables = [*COMMANDS, "bench", "dev", *(f"bench {n}" for n in BENCH), *(f"dev {n}" for n in DEV)]
    assert sorted(seen) == sorted(tables)
    for path, (text, loaded) in seen.items():
        if path == "parse-args":  # hidden; it has no --help: its arguments are another command's
            continue
        assert text.startswith(f"Usage: macserve {path} "), (path, text[:200])
        assert _heavy(loaded) == [], (path, _heavy(loaded))


def test_each_body_takes_its_declarations_parameters():
    """A declaration names its body as a string (cli/lazy.py), which the import graph does not
    see: each one resolves, and takes exactly the parameters its declaration does (click passes them by name)."""
    checked = 0
    for path, cmd in walk(main):
        if isinstance(cmd, click.Group):
            continue
        target = cmd.callback.runs
        # the declaration's own parameters: click's, after the context for a pass_context one
        declared = list(inspect.signature(cmd.callback).parameters)
        context = declared[: len(declared) - len(cmd.params)]
        assert context in ([], ["ctx"]), (path, declared)
        assert sorted(declared[len(context) :]) == sorted(p.name for p in cmd.params), path
        taken = list(inspect.signature(resolve(target)).parameters)
        assert taken == declared, (path, target, taken, declared)
        for p in cmd.params:
            if hasattr(p.callback, "runs"):
                assert callable(resolve(p.callback.runs)), (path, p.name)
        checked += 1
    assert checked == len(COMMANDS) + len(BENCH) + len(DEV)


def test_declared_defaults_agree_with_their_wings():
    """The few defaults a declaration cannot import without loading a wing are written there
    again; these are the wings' own."""
    from macserve import chat as chat_client
    from macserve.cli.commands import bench, chat, engine, router
    from macserve.engine import gate
    from macserve.engine.bench import kv
    from macserve.services.providers.router import DEFAULT_PORT
    from macserve.services.router.model import DEFAULT_START_TIMEOUT

    assert chat.DEFAULT_MAX_TOKENS == chat_client.DEFAULT_MAX_TOKENS
    assert engine.DEFAULT_TARGET == gate.DEFAULT_TARGET
    assert router.ROUTER_PORT == DEFAULT_PORT
    assert router.DEFAULT_START_TIMEOUT == DEFAULT_START_TIMEOUT
    assert bench.KV_SETS == kv.SETS


@pytest.mark.e2e
def test_profile_names_complete_without_loading_a_wing(tmp_path):
    """Shell completion runs `macserve` on every Tab: it reads the profile names (by file
    name) and imports neither the services wing nor anything heavy."""
    (tmp_path / "profiles").mkdir()
    for n in ("tiny", "tiny-gguf", "other"):
        (tmp_path / "profiles" / f"{n}.env").write_text("PROVIDER=mlx\n")
    code = (
        "import sys\n"
        "sys.argv[0] = 'macserve'\n"
        "from macserve.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(sys.modules))\n"
    )
    for line, names in (
        ("macserve start ti", ["tiny", "tiny-gguf"]),
        ("macserve logs o", ["other"]),
        ("macserve chat ", ["other", "tiny", "tiny-gguf"]),
    ):
        env = {
            **os.environ,
            "MACSERVE_HOME": str(tmp_path),
            "_MACSERVE_COMPLETE": "bash_complete",
            "COMP_WORDS": line,
            "COMP_CWORD": str(len(line.split(" ")) - 1),
        }
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env
        )
        assert r.returncode == 0, r.stderr
        cut = r.stdout.rindex("LOADED")
        got = sorted(x.split(",", 1)[1] for x in r.stdout[:cut].splitlines() if "," in x)
        assert got == names, (line, r.stdout[:cut])
        assert _heavy(ast.literal_eval(r.stdout[cut + len("LOADED") :].strip())) == [], line


@pytest.mark.e2e
def test_every_body_imports_and_exits_quietly():
    """Every command's body module imported in one interpreter, which then exits: nothing on
    stderr. A struct_passwd held in a module global (services/supervisors/launchd_files.py)
    made CPython print "Exception ignored in tp_clear ... SystemError" at the exit of every
    `macserve dev` command."""
    modules = sorted(
        {
            cmd.callback.runs.split(":")[0]
            for _, cmd in walk(main)
            if not isinstance(cmd, click.Group)
        }
    )
    code = "".join(f"import {m}\n" for m in modules)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert "macserve.cli.dev" in modules
