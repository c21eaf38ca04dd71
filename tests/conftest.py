"""pytest's hooks: every fixture of tests/fixtures.py registered for every test file, and the
guard (tests/marks.py) that checks the marks the test files set: `e2e` (starts a process),
`model` (runs MLX in process), neither (pure Python).

`python3 -m pytest -m "not e2e and not model"` is the inner loop (seconds);
`bash scripts/test.sh` runs everything. tests/README.md has the subsets and their timings.
"""

import os
from pathlib import Path

import pytest

from . import marks
from .fixtures import (  # noqa: F401  (constants other files import from here; fixtures)
    CONFIGS,
    REPO,
    TINY_MODEL,
    bundle,
    gated_demo,
    gated_hard,
    ggufs,
    home,
    hub,
    launchctl,
    llama_server,
    llama_server_binary,
    macserve_home,
    model_gguf,
    seen,
    services,
    smollm_gguf,
    smollm_twin,
    tiny_gguf,
    tiny_mlx_f32,
    transmla_smollm,
)


def pytest_collection_modifyitems(config, items):
    # Before `-m` deselects (this conftest's hook runs ahead of pytest's own): every test
    # collected is checked, whatever subset runs.
    marks.check_collected(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        longest_files_first(items)


def longest_files_first(items):
    """The files of slow_files.txt first, longest first; the rest after them, each file's
    tests in their own order. Every worker collects the same order, and `--dist loadfile
    --no-loadscope-reorder` (scripts/test.sh) hands the files out in it: xdist's own order
    (most tests first) put a 71 s one-test file last, with one worker idle meanwhile."""
    listed = Path(__file__).with_name("slow_files.txt").read_text().splitlines()
    names = [line.split()[1] for line in listed if line.strip() and not line.startswith("#")]
    rank = {name: i for i, name in enumerate(names)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    marks.mlx_reset()  # from here to the end of the call: what this test allocates in MLX
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    marks.fail_if_mlx_ran(item)
    return result
