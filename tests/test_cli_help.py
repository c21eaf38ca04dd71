"""`macserve --help` is the first thing a new user types, then a command's own `--help`: both
import none of the wings (mlx-lm alone takes seconds to import), and neither does shell
completion; `-h` works everywhere. What is imported is checked here, which does not depend on
the machine's speed; the wall times are printed by `python3 -m macserve bench startup`
(docs/architecture.md)."""

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.cli.lazy import Lazy, walk

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


def _loaded_after(args: list[str], shows: str = "Commands:") -> list[str]:
    """The modules a fresh interpreter holds after `macserve ARGS` (a help: it exits)."""
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
    assert shows in r.stdout
    return ast.literal_eval(r.stdout[r.stdout.rindex("LOADED") + len("LOADED") :].strip())


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["--help"], ["-h"], ["bench", "--help"], ["dev", "-h"]])
def test_group_help_imports_no_wing(args):
    assert _heavy(_loaded_after(args)) == []


COMMANDS = [(path, cmd) for path, cmd in walk(main) if not isinstance(cmd, click.Group)]


@pytest.mark.e2e
def test_a_command_imports_the_families_only_until_its_own():
    """`macserve start` imports the service families (the first looked in), not the engine's,
    the benchmarks' or the developers' commands (cli/lazy.py: Families)."""
    loaded = set(_loaded_after(["start", "--help"], shows="Usage:"))
    assert "macserve.cli.lifecycle" in loaded
    assert not loaded & {"macserve.cli.engine", "macserve.cli.bench", "macserve.cli.dev"}


@pytest.mark.parametrize("group", [(), ("bench",), ("dev",)])
def test_each_listed_summary_is_how_its_command_begins(group):
    """A group's --help lists each command with its summary, the first sentence of its own
    help (written once, in its docstring), shortened to the width with "..." if need be."""
    out = CliRunner().invoke(main, [*group, "-h"], terminal_width=80).output
    rows = dict(
        line.strip().split(None, 1) for line in out.split("Commands:")[1].splitlines() if line
    )
    cmds = {path[-1]: cmd for path, cmd in walk(main) if path[:-1] == group and not cmd.hidden}
    assert sorted(rows) == sorted(cmds)
    for name, summary in rows.items():
        first = " ".join((cmds[name].help or "").split("\n\n")[0].split())
        short = summary.removesuffix("...")
        assert short and first.startswith(short), (name, summary, first)
        assert summary.endswith(("...", ".", "?")), (name, summary)  # a sentence, or its start


def test_dash_h_everywhere_and_the_list_complete():
    r = CliRunner().invoke(main, ["-h"])
    assert r.exit_code == 0
    for name in main.list_commands(None):
        if not main.get_command(None, name).hidden:
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
    assert sorted(seen) == sorted(" ".join(path) for path in paths)
    for path, (text, loaded) in seen.items():
        if path == "parse-args":  # hidden; it has no --help: its arguments are another command's
            continue
        assert text.startswith(f"Usage: macserve {path} "), (path, text[:200])
        assert _heavy(loaded) == [], (path, _heavy(loaded))


def test_each_command_takes_its_declared_parameters():
    """Click passes a command's parameters to its function by name: each function takes
    exactly those (after the context, for a pass_context one)."""
    for path, cmd in COMMANDS:
        declared = list(inspect.signature(cmd.callback).parameters)
        context = declared[: len(declared) - len(cmd.params)]
        assert context in ([], ["ctx"]), (path, declared)
        assert sorted(declared[len(context) :]) == sorted(p.name for p in cmd.params), path
    assert {("inspect",), ("set",), ("bench", "engine"), ("dev", "llama-truth")} <= {
        path for path, _ in COMMANDS
    }


def test_declared_defaults_agree_with_their_wings():
    """The few defaults a declaration cannot import without loading a wing are written there
    again; these are the wings' own."""
    from macserve import chat as chat_client
    from macserve.cli import bench, chat, engine, router
    from macserve.engine import gate
    from macserve.engine.bench import kv
    from macserve.router.model import DEFAULT_START_TIMEOUT
    from macserve.services.providers.router import DEFAULT_PORT

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


def _lazy_reads() -> dict[str, set[str]]:
    """{module path: the attributes read of it} for every `x = lazy("module")` of a family
    module, read from their source: `service_lifecycle.start(...)` reads `start` of services.lifecycle."""
    reads: dict[str, set[str]] = {}
    for name in sorted({cmd.callback.__module__ for _, cmd in COMMANDS}):
        mod = sys.modules[name]
        names = {k: v.name for k, v in vars(mod).items() if isinstance(v, Lazy)}
        unread = set(names)
        for node in ast.walk(ast.parse(Path(mod.__file__).read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
            ):
                reads.setdefault(names[node.value.id], set()).add(node.attr)
                unread.discard(node.value.id)
        assert not unread, (name, unread)  # what ruff's unused-import check would say
    return reads


@pytest.mark.e2e
def test_every_lazy_module_imports_quietly_with_what_bodies_read():
    """The wing modules the bodies use are named as strings (cli/lazy.py), which the import
    graph and the linters do not see: imported together in one interpreter, each is there and
    has every attribute a body reads of it, and the interpreter exits with nothing on stderr.
    (A struct_passwd held in a module global, services/supervisors/launchd_files.py, made
    CPython print "Exception ignored in tp_clear ... SystemError" at the exit of every
    `macserve dev` command.)"""
    reads = _lazy_reads()
    assert "macserve.services.supervisors.launchd_files" in reads
    assert "start" in reads["macserve.services.lifecycle"]
    assert "SetFailed" in reads["macserve.services.health"]
    code = (
        "import importlib, json, sys\n"
        "missing = [f'{m}.{a}' for m, attrs in json.loads(sys.argv[1]).items()\n"
        "           for a in attrs if not hasattr(importlib.import_module(m), a)]\n"
        "print(json.dumps(missing))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps({m: sorted(a) for m, a in reads.items()})],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert json.loads(r.stdout) == []
