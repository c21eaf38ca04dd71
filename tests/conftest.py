"""pytest's hooks: every fixture of tests/fixtures.py registered for every test file, and the
guard (tests/marks.py) that checks the marks the test files set: `e2e` (starts a process),
`model` (runs MLX in process), neither (pure Python).

`python3 -m pytest -m "not e2e and not model"` is the inner loop (seconds);
`bash scripts/test.sh` runs everything. tests/README.md has the subsets and their timings.
"""

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    marks.mlx_reset()  # from here to the end of the call: what this test allocates in MLX
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    marks.fail_if_mlx_ran(item)
    return result
