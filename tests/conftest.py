"""pytest's hooks: every fixture of tests/fixtures.py registered for every test file, and the
`e2e` mark on each test that starts a process, found by reading the code it runs.

`python3 -m pytest -m "not e2e"` is the fast subset; `bash scripts/test.sh` runs everything.
"""

import ast
import inspect
import subprocess
import textwrap
import types

import pytest

from .fixtures import (  # noqa: F401  (constants other files import from here; fixtures)
    CONFIGS,
    REPO,
    TINY_MODEL,
    bundle,
    ggufs,
    hub,
    launchctl,
    llama_server_binary,
    macserve_home,
    model_gguf,
    services,
    tiny_gguf,
    tiny_mlx_f32,
)

# Fixtures that start a process inside macserve's own code, where reading the test's code
# cannot see it: supervisord (`services`), the llama-server binary (`llama_server`: a test
# that asks for it runs it).
PROCESS_FIXTURES = frozenset({"services", "llama_server"})


GET_LLAMA_SERVER = (
    "no llama-server binary: `bash scripts/test.sh` builds one (once, into "
    "~/.cache/macserve-build), or `bash scripts/build-llama-server.sh`, or put one on PATH or "
    "in MACSERVE_LLAMA_SERVER; `-m 'not e2e'` runs the tests that need none"
)


@pytest.fixture
def llama_server():
    """The llama-server binary. Absent, the test fails, saying how to get one: a skip would
    let `pytest` pass having never run a llama.cpp test."""
    p = llama_server_binary()
    if p is None:
        pytest.fail(GET_LLAMA_SERVER, pytrace=False)
    return p


_SEEN: dict = {}


def _starts_process(fn) -> bool:
    """True if `fn`, or a function of the tests it names (followed through the names it
    uses), refers to the subprocess module: every process the tests start goes through it."""
    fn = inspect.unwrap(fn)  # contextmanager and pytest's fixture wrappers
    if fn not in _SEEN:
        _SEEN[fn] = False  # a function being read (recursion) counts as starting nothing yet
        _SEEN[fn] = _reads_subprocess(fn)
    return _SEEN[fn]


def _reads_subprocess(fn) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    scope = getattr(fn, "__globals__", {})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or node.id not in scope:
            continue
        v = scope[node.id]
        if v is subprocess:
            return True
        inner = getattr(v, "__wrapped__", v)
        if (
            isinstance(inner, types.FunctionType)
            and inner is not fn
            and inner.__module__.startswith(("tests.", "conftest", "fixtures"))
            and _starts_process(inner)
        ):
            return True
    return False


def _is_e2e(item) -> bool:
    if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if _starts_process(item.function):
        return True
    defs = item._fixtureinfo.name2fixturedefs
    return any(
        _starts_process(d[-1].func) for name in item.fixturenames for d in [defs.get(name)] if d
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.Function) and _is_e2e(item):
            item.add_marker(pytest.mark.e2e)
