"""The package's shape: wings whose imports flow one way, no cycles, imports at the top, and an
`inspect` that starts without the heavy machinery. Read from the source (ast), so a new
import anywhere is checked, including one hidden inside a function."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import CONFIGS, REPO

PKG = REPO / "macserve"

# What each part may import of macserve (besides itself). cli is the top: it may import all.
LEAVES = {
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
        "imports against the flow (cli -> server/services/engine -> sizing):\n" + "\n".join(bad)
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


def test_the_services_wing_never_imports_the_router():
    """The router (services/router/) builds on the services wing and asks it for what it needs
    (`manager`, `routed`); nothing else in services/ imports it back."""
    bad = [
        f"{m} -> {t}"
        for m, targets in graph().items()
        if m.startswith("macserve.services.") and not m.startswith("macserve.services.router")
        for t in targets
        if t.startswith("macserve.services.router")
    ]
    assert not bad, "\n".join(bad)


# Modules over the limit that someone else is changing now; each is split once that lands.
LONG_FOR_NOW: set[str] = set()


def test_no_module_over_500_lines():
    """A module that grows past this does several jobs: split it by purpose. The models
    (macserve/models/: weights, tokenizers, generated tables) are data, not code."""
    long = {
        rel: n
        for m, p in MODULES.items()
        if not m.startswith("macserve.models")
        and (rel := str(p.relative_to(REPO))) not in LONG_FOR_NOW
        and (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, "split by purpose:\n" + "\n".join(
        f"{rel}: {n} lines" for rel, n in sorted(long.items())
    )


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
