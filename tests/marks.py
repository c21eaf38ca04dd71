"""The guard that keeps the marks honest. Each test file says what its tests are
(`pytestmark = pytest.mark.e2e` at its top, or the mark on a test or class where a file mixes
kinds); these readings only check what the files say, they never set a mark:

    e2e    starts a process (macserve serve, a CLI subprocess, supervisord, llama-server,
           the launchctl stand-in)
    model  runs MLX in process (the demo model, a synthetic one, a calibration): seconds each
    none   pure Python: no process, no MLX; `-m "not e2e and not model"` runs these

At collection (conftest.py's pytest_collection_modifyitems), every test is read: the code it
runs (its function, its fixtures and the test helpers they name, followed to the end). A test
whose code uses (or imports) the `subprocess` module, or asks for a fixture that starts a
process inside macserve's own code (PROCESS_FIXTURES), must be `e2e`; one not `e2e` whose code
names an MLX module (`mlx.core`, `mlx.nn`, `mlx_lm`, a name imported from one), the engine's
loader (`macserve.engine.model`), or asks for a fixture that loads a model (MODEL_FIXTURES)
must be `model`. A test that lacks its mark stops the run, named with the mark to add.

At run time, what reading cannot see (macserve code that runs a model, e.g. `macserve
calibrate` through click's CliRunner) is caught by MLX's own allocator: a test marked neither
`e2e` nor `model` whose setup and call allocate a model's worth of MLX memory (MODEL_BYTES)
fails, saying so. A process started inside macserve's code is seen only through the fixtures
named in PROCESS_FIXTURES. An `e2e` test may also run MLX in process: it counts as e2e.
"""

import ast
import inspect
import subprocess
import textwrap
import types
from collections.abc import Callable

import pytest

# Fixtures that start a process inside macserve's own code, where reading the test's code
# cannot see it: supervisord (`services`), the llama-server binary (`llama_server`: a test
# that asks for it runs it), the launchctl stand-in (`launchctl`: a Python script macserve
# runs for every launchctl call).
PROCESS_FIXTURES = frozenset({"services", "llama_server", "launchctl"})
# Fixtures that load or convert a model with MLX inside macserve's code (a local import the
# reading does not follow).
MODEL_FIXTURES = frozenset(
    {
        "bundle",
        "gated_demo",
        "gated_hard",
        "tiny_mlx_f32",
        "tiny_gguf",
        "model_gguf",
        "ggufs",
        "hub",
        "smollm_twin",  # converts the GGUF with MLX (dev/gguf_twin.py) inside the fixture
        "transmla_smollm",  # converts the twin to MLA (dev/transmla.py) and calibrates it
    }
)


# The engine's model loader: MLX behind a macserve name.
MODEL_MODULES = ("macserve.engine.model",)


def _is_mlx(v) -> bool:
    """A module of MLX or mlx-lm, or a function or class defined in one or in MODEL_MODULES."""
    name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
    if not isinstance(name, str):
        return False
    return name.split(".")[0] in ("mlx", "mlx_lm") or name.startswith(MODEL_MODULES)


def _uses_subprocess(v) -> bool:
    return v is subprocess


class Reading:
    """Whether a function, or a test helper it names (followed through the names it uses),
    refers to what `hit` recognizes (a global it names, or a module it imports inside)."""

    def __init__(self, hit: Callable[[object], bool], imports: tuple[str, ...] = ()):
        self.hit, self.imports, self.seen = hit, imports, {}

    def __call__(self, fn) -> bool:
        fn = inspect.unwrap(fn)  # contextmanager and pytest's fixture wrappers
        if fn not in self.seen:
            self.seen[fn] = False  # a function being read (recursion) counts as nothing yet
            self.seen[fn] = self._read(fn)
        return self.seen[fn]

    def _read(self, fn) -> bool:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            return False
        scope = getattr(fn, "__globals__", {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and self.imports:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n.split(".")[0] in self.imports for n in names):
                    return True
            if not isinstance(node, ast.Name) or node.id not in scope:
                continue
            v = scope[node.id]
            if self.hit(v):
                return True
            inner = getattr(v, "__wrapped__", v)
            if (
                isinstance(inner, types.FunctionType)
                and inner is not fn
                and inner.__module__.startswith(("tests.", "conftest", "fixtures"))
                and self(inner)
            ):
                return True
        return False


starts_process = Reading(_uses_subprocess, imports=("subprocess",))
runs_mlx = Reading(_is_mlx, imports=("mlx", "mlx_lm"))


def _reads(item, reading: Reading, fixtures: frozenset) -> bool:
    if reading(item.function):
        return True
    defs = item._fixtureinfo.name2fixturedefs
    for name in getattr(item, "fixturenames", ()):
        d = defs.get(name)
        if not d:
            continue
        shared = d[-1].func.__module__ in ("tests.fixtures", "tests.conftest")
        if (shared and name in fixtures) or reading(d[-1].func):
            return True  # a file's own fixture of the same name is read, not trusted by name
    return False


def missing_mark(item) -> str | None:
    """The mark this test lacks by the reading ("e2e" or "model"), or None."""
    marked = {m.name for m in item.iter_markers()}
    if "e2e" not in marked and _reads(item, starts_process, PROCESS_FIXTURES):
        return "e2e"
    if not marked & {"e2e", "model"} and _reads(item, runs_mlx, MODEL_FIXTURES):
        return "model"
    return None


WHY = {
    "e2e": "they start a process (their code uses `subprocess`, or they ask for a fixture "
    "that does: " + ", ".join(sorted(PROCESS_FIXTURES)) + ")",
    "model": "they run MLX in process (their code names an MLX module or the engine's loader, "
    "or they ask for a model fixture: " + ", ".join(sorted(MODEL_FIXTURES)) + ")",
}


def check_collected(items) -> None:
    """Stop the run, naming every test whose mark is missing and the line that fixes it."""
    missing: dict[str, list[str]] = {}
    for item in items:
        if isinstance(item, pytest.Function):
            mark = missing_mark(item)
            if mark:
                missing.setdefault(mark, []).append(item.nodeid)
    if not missing:
        return
    lines = ["tests without the mark that says what they are (see tests/marks.py):"]
    for mark, ids in missing.items():
        lines.append(f"\n  not marked `{mark}`, yet {WHY[mark]}:")
        lines += [f"    {i}" for i in ids]
        lines.append(
            f"  add `pytestmark = pytest.mark.{mark}` below the imports of a file whose tests "
            f"all are, or `@pytest.mark.{mark}` on the test (or its class)"
        )
    raise pytest.UsageError("\n".join(lines))


def _mlx():
    import sys

    return sys.modules.get("mlx.core")  # not imported: nothing ran MLX yet


def is_pure(item) -> bool:
    return not {m.name for m in item.iter_markers()} & {"e2e", "model"}


_HELD = [0]  # MLX's active bytes at the last mlx_reset


def mlx_reset() -> None:
    mx = _mlx()
    if mx is not None:
        mx.reset_peak_memory()
        _HELD[0] = mx.get_active_memory()


def mlx_ran() -> int:
    """MLX bytes allocated since mlx_reset beyond what was already held then (0 when none, or
    MLX never imported). The peak after a reset starts from what is active: arrays earlier
    tests still hold (a run-scoped model, a cache not yet collected) are not this test's, so
    they are taken off, or a pure test would be blamed for its predecessors (seen: 32 MB held
    after test_mtp_decode.py, charged to test_multi_host.py)."""
    mx = _mlx()
    return max(0, mx.get_peak_memory() - _HELD[0]) if mx is not None else 0


# A model's weights: the demo model's alone are 12 MB. Below this, MLX built a graph without
# running a model (inspect measures a config's caches lazily: tens of KB of scalars).
MODEL_BYTES = 2**20


def fail_if_mlx_ran(item) -> None:
    used = mlx_ran()
    if used >= MODEL_BYTES and is_pure(item):
        pytest.fail(
            f"{item.nodeid} is marked neither `model` nor `e2e`, yet ran MLX in process "
            f"({used:,} bytes allocated in its setup and call): mark it `model` "
            "(`@pytest.mark.model`, or `pytestmark = pytest.mark.model` for the file)",
            pytrace=False,
        )
