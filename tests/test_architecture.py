"""The package's shape: wings whose imports flow one way, no cycles, imports at the top, and an
`inspect` that starts without the heavy machinery. Read from the source (ast), so a new
import anywhere is checked, including one hidden inside a function."""

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from .conftest import CONFIGS, REPO

PKG = REPO / "macserve"

# What each part may import of macserve (besides itself). cli is the top: it may import all.
LEAVES = {
    "macserve.cache_kinds",
    "macserve.errors",
    "macserve.env",
    "macserve.fileio",
    "macserve.hf_config",
    "macserve.int2_format",
    "macserve.listen",
    "macserve.web",
}
ALLOWED = {
    "macserve.sizing": LEAVES,
    "macserve.services": LEAVES | {"macserve.sizing"},
    # A wing above services: it drives them (manager, routed); nothing below imports it.
    "macserve.router": LEAVES | {"macserve.services", "macserve.sizing"},
    "macserve.engine": LEAVES,
    "macserve.server": LEAVES | {"macserve.engine"},
    "macserve.dev": LEAVES | {"macserve.engine"},
    "macserve.chat": LEAVES,
    "macserve.errors": set(),
    "macserve.env": set(),
    "macserve.fileio": set(),
    "macserve.hf_config": set(),
    "macserve.listen": {"macserve.errors"},
    "macserve.int2_format": set(),
    "macserve.cache_kinds": {"macserve.int2_format"},
    "macserve.web": set(),
}
TOP = {"macserve.cli", "macserve.__main__", "macserve"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _target(mod: str, path: Path, node: ast.ImportFrom, name: str) -> str:
    if node.level:
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    full = f"{pkg}.{name}"
    return full if full in MODULES else pkg


def imports(mod: str) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, inside a function, source line) for every import in `mod`."""
    path = MODULES[mod]
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    inner = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_target(mod, path, node, a.name) for a in node.names]
        else:
            continue
        for n in names:
            out.append((n, node.lineno, id(node) in inner, lines[node.lineno - 1]))
    return out


def graph() -> dict[str, set[str]]:
    return {m: {t for t, *_ in imports(m) if t.startswith("macserve") and t != m} for m in MODULES}


def _part(mod: str) -> str:
    for p in sorted(ALLOWED, key=len, reverse=True):
        if mod == p or mod.startswith(p + "."):
            return p
    return mod


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if t not in MODULES:
                continue
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])


def test_imports_flow_down_the_wings():
    bad = []
    for m, targets in graph().items():
        if _part(m) in TOP or m.startswith("macserve.cli"):
            continue
        allowed = ALLOWED[_part(m)] | {_part(m)}
        bad += [f"{m} -> {t}" for t in targets if _part(t) not in allowed and t != "macserve"]
    assert not bad, (
        "imports against the flow (cli -> router -> services; server -> engine; -> sizing):\n"
        + "\n".join(bad)
    )


def test_the_engine_never_imports_services_or_dev():
    g = graph()
    for m in g:
        if m.startswith(("macserve.engine", "macserve.server")):
            assert not {t for t in g[m] if t.startswith(("macserve.services", "macserve.dev"))}, m


def test_imports_are_at_the_top():
    """Our own modules always at the top; a third-party import inside a function only with a
    comment saying why (a heavy or optional dependency kept out of a cold start)."""
    bad = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for target, line, inner, text in imports(m):
            if not inner:
                continue
            if target.startswith("macserve"):
                bad.append(f"{path.relative_to(REPO)}:{line}: {text.strip()}")
            elif "#" not in text and not lines[line - 2].strip().startswith("#"):
                bad.append(f"{path.relative_to(REPO)}:{line}: {text.strip()} (no comment)")
    assert not bad, "\n".join(bad)


def lazy_modules(tree: ast.Module) -> dict[str, str]:
    """The CLI's `name = lazy("macserve.x.y")` bindings (cli/lazy.py): a module imported on
    first use is still a module its reader takes names from, so the scans below see it."""
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "lazy"
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
            and node.value.args[0].value in MODULES
        ):
            out[node.targets[0].id] = node.value.args[0].value
    return out


def private_uses(mod: str) -> set[str]:
    """Another macserve module's `_private` names `mod` uses: imported by name (`from .x import
    _helper`) or read off an imported module (`x._helper`)."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    modules = lazy_modules(tree)  # local name -> the macserve module it is bound to
    out = set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                target = _target(mod, path, node, a.name)
                if target in MODULES and target.endswith("." + a.name):
                    modules[a.asname or a.name] = target  # a module: `from . import x`
                elif private(a.name) and target.startswith("macserve") and target != mod:
                    out.add(f"{target}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    modules[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and modules[node.value.id] != mod
            and private(node.attr)
        ):
            out.add(f"{modules[node.value.id]}.{node.attr}")
    return out


def test_no_module_uses_another_modules_private_names():
    """A name with a leading underscore is its module's own; one another module needs is public
    (named without it, with a docstring: part of its module's API) or moved where both users
    belong. (Tests may reach into privates: they are not scanned.)"""
    found = {(m, name) for m in MODULES for name in private_uses(m)}
    bad = sorted(found)
    assert not bad, "\n".join(f"{m} uses {name}" for m, name in bad)


def test_the_private_name_scan_finds_both_spellings(monkeypatch, tmp_path):
    """Both ways of reaching into another module are found, a module's own privates are not."""
    src = tmp_path / "probe.py"
    src.write_text(
        "from .setup import _hidden, shown\n"
        "from .. import calibration\n"
        "from . import setup\n"
        "def _own():\n"
        "    return calibration._weights, setup.shown, _own\n"
    )
    monkeypatch.setitem(MODULES, "macserve.engine.bench.probe", src)
    assert private_uses("macserve.engine.bench.probe") == {
        "macserve.engine.bench.setup._hidden",
        "macserve.engine.calibration._weights",
    }


def _borrowed(mod: str) -> dict[str, str]:
    """The names `mod` imports at its top from another macserve module (not modules):
    local name -> its home, `module.name`."""
    path = MODULES[mod]
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                target = _target(mod, path, node, a.name)
                if target.startswith("macserve") and not target.endswith("." + a.name):
                    out[a.asname or a.name] = f"{target}.{a.name}"
    return out


def reexports_used() -> set[tuple[str, str, str]]:
    """(importer, module, name): `importer` takes `name` from `module`, which only imported it
    from its home (`from module import name` or `module.name`). A package's `__init__` is its
    API and may gather names; a plain module may not."""
    borrowed = {m: _borrowed(m) for m in MODULES if MODULES[m].name != "__init__.py"}
    found = set()
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        modules = lazy_modules(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    target = _target(m, path, node, a.name)
                    if target in MODULES and target.endswith("." + a.name):
                        modules[a.asname or a.name] = target
                    elif a.name in borrowed.get(target, {}):
                        found.add((m, target, a.name))
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name: a.name for a in node.names if a.name in MODULES}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = modules.get(node.value.id)
                if target and node.attr in borrowed.get(target, {}):
                    found.add((m, target, node.attr))
    return found


def test_names_are_imported_from_their_home():
    """A name moved to another module is imported from there by every user; the old module
    keeps no re-export of it (a shim hides where a name lives)."""
    bad = sorted(reexports_used())
    assert not bad, "\n".join(f"{m} takes {n} from {t}: import it from its home" for m, t, n in bad)


def test_the_reexport_scan_finds_both_spellings(monkeypatch, tmp_path):
    """A name taken through a module that only imported it is found, imported by name or read
    off the module; one taken from its home, or from a package's `__init__`, is not."""
    files = {
        "probe_home": "x = 1\n",
        "probe_shim": "from .probe_home import x\n",
        "probe_user": "from .probe_home import x\nfrom .probe_shim import x as y\n",
        "probe_reader": "from . import probe_home, probe_shim\nz = probe_shim.x + probe_home.x\n",
    }
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.setitem(MODULES, f"macserve.engine.bench.{name}", tmp_path / f"{name}.py")
    found = {f for f in reexports_used() if "probe" in f[0]}
    shim = "macserve.engine.bench.probe_shim"
    assert found == {
        ("macserve.engine.bench.probe_user", shim, "x"),
        ("macserve.engine.bench.probe_reader", shim, "x"),
    }


HEAVY = ("mlx", "mlx_lm", "httpx", "huggingface_hub", "starlette", "uvicorn", "supervisor")


def _inspect_imports(tmp_path, *args) -> tuple[dict, list[str]]:
    """Run `macserve inspect V3 --json *args` in a fresh interpreter: (report, modules loaded)."""
    code = (
        "import sys\n"
        "from macserve.cli import main\n"
        "try:\n"
        f"    main(['inspect', {str(CONFIGS / 'deepseek-ai__DeepSeek-V3.json')!r}, '--json', *sys.argv[1:]])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(sys.modules))\n"
    )
    env = {**os.environ, "MACSERVE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    cut = r.stdout.rindex("LOADED")
    return json.loads(r.stdout[:cut]), ast.literal_eval(r.stdout[cut + len("LOADED") :].strip())


def _top(mods):
    return sorted({m.split(".")[0] for m in mods} & set(HEAVY + ("numpy", "transformers")))


@pytest.mark.e2e
def test_inspect_cold_start_loads_no_heavy_machinery(tmp_path):
    """`inspect --modelled` of a local config imports neither mlx nor the HTTP, service or
    hub stacks (what made cold starts slow); the wall times are in docs/architecture.md."""
    report, mods = _inspect_imports(tmp_path, "--modelled")
    assert report["kv_bytes_per_token"]["mlx/bf16"] == 70272
    assert set(report["row_source"].values()) == {"modelled"}
    assert _top(mods) == []


@pytest.mark.e2e
def test_measuring_loads_mlx_and_one_model_module_only(tmp_path):
    """The mlx/bf16 measurement (sizing/mlx_measure.py) needs mlx and mlx-lm's model code,
    not mlx-lm's package __init__ (transformers: it would show here), nor numpy or the hub;
    once measured, the figures come from $MACSERVE_HOME/cache and mlx stays unloaded."""
    report, mods = _inspect_imports(tmp_path)
    assert report["row_source"]["mlx/bf16"] == "measured"
    assert report["kv_bytes_per_token"]["mlx/bf16"] == 70272
    # mlx stays loaded; mlx-lm's modules are dropped with the stand-in package once the model
    # module has been used (mlx_measure._import_model_module), and its __init__ never ran.
    assert _top(mods) == ["mlx"]
    again, mods = _inspect_imports(tmp_path)
    assert again == report
    assert _top(mods) == []


def test_nothing_below_the_router_imports_it():
    """The router (router/) builds on the services wing and asks it for what it needs
    (`manager`, `routed`); only the CLI imports it back."""
    bad = [
        f"{m} -> {t}"
        for m, targets in graph().items()
        if not m.startswith(("macserve.router", "macserve.cli"))
        for t in targets
        if t == "macserve.router" or t.startswith("macserve.router.")
    ]
    assert not bad, "\n".join(bad)


# The size rule: past WARN_LINES a module is worth a look (a warning in pytest's summary, so
# nobody is stopped before a review), past MAX_LINES it does several jobs and fails: split it
# by purpose, never by trimming. The room between the two is headroom for a change in review.
WARN_LINES = 400
MAX_LINES = 600


def _lines() -> dict[str, int]:
    """Lines of every module but the models (macserve/models/: weights, tokenizers, generated
    tables are data, not code)."""
    return {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for m, p in MODULES.items()
        if not m.startswith("macserve.models")
    }


def _over(lines: dict[str, int]) -> tuple[str, str]:
    """(the warning, the failure) the size rule gives these modules' line counts; '' for none."""

    def listed(found: dict[str, int]) -> str:
        return "\n".join(f"{rel}: {n} lines" for rel, n in sorted(found.items()))

    near = listed({rel: n for rel, n in lines.items() if WARN_LINES < n <= MAX_LINES})
    long = listed({rel: n for rel, n in lines.items() if n > MAX_LINES})
    return (
        near and f"over {WARN_LINES} lines (the cap is {MAX_LINES}: split by purpose):\n{near}",
        long and f"over {MAX_LINES} lines: split by purpose:\n{long}",
    )


def test_no_module_over_600_lines():
    """A module that grows past MAX_LINES does several jobs: split it by purpose. One past
    WARN_LINES is named in a warning (pytest's summary), to be split before it reaches the cap."""
    warning, failure = _over(_lines())
    if warning:
        warnings.warn(warning, stacklevel=1)
    assert not failure, failure


def test_the_size_rule_warns_before_it_fails():
    """A module between the limits is named in the warning, not the failure; one past the cap
    in the failure; one at WARN_LINES in neither."""
    warning, failure = _over(
        {
            "at.py": WARN_LINES,
            "near.py": WARN_LINES + 1,
            "cap.py": MAX_LINES,
            "big.py": MAX_LINES + 1,
        }
    )
    assert f"near.py: {WARN_LINES + 1} lines" in warning and f"cap.py: {MAX_LINES}" in warning
    assert "at.py" not in warning and "big.py" not in warning
    assert failure.endswith(f"big.py: {MAX_LINES + 1} lines") and "near.py" not in failure
    assert _over({"at.py": WARN_LINES}) == ("", "")


def test_only_providers_read_context_or_cache_type_out_of_extra_args():
    """CTX and KV are typed profile keys; each provider renders them as its flags (and lifts an
    old profile's flags out of EXTRA_ARGS). Elsewhere nobody looks for those flags in
    EXTRA_ARGS, nor reads it through `flag_value`."""
    spellings = (
        '"-c"',
        '"--ctx-size"',
        '"--ctx"',
        '"-ctk"',
        '"--cache-type',
        '"--kv"',
        "--kv-bits",
    )
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("macserve.services") or m.startswith("macserve.services.providers"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "flag_value" in line or ("extra_args" in line and any(s in line for s in spellings)):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
