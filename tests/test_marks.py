"""The guard of the marks (tests/marks.py) can fail: it finds a process, MLX, a model fixture
and MLX memory where they are, and says which mark is missing."""

import types

import pytest

from . import marks

# Samples the readings are run on. The tests below name them through SAMPLES (a string key),
# so the collection-time reading of these tests does not follow them: these tests are pure.
SAMPLES = {}


def _sample(fn):
    SAMPLES[fn.__name__] = fn
    return fn


@_sample
def starts_a_cli():
    import subprocess  # noqa: F401  (read by the guard, never run)


@_sample
def calls_a_helper_that_starts_one():
    return _helper_naming_subprocess()


def _helper_naming_subprocess():
    return SUBPROCESS.run  # the subprocess module, a global of this file


SUBPROCESS = marks.subprocess


@_sample
def runs_mlx_inside():
    import mlx.core as mx

    return mx.zeros((1,))


@_sample
def pure():
    return sum(range(3))


def _item(fn, fixtures=(), mark=None):
    """What the guard reads of a collected test: its function, its fixtures, its marks."""
    defs = {n: [types.SimpleNamespace(func=SAMPLES["pure"])] for n in fixtures}
    marked = [types.SimpleNamespace(name=mark)] if mark else []
    return types.SimpleNamespace(
        function=fn,
        fixturenames=list(fixtures),
        _fixtureinfo=types.SimpleNamespace(name2fixturedefs=defs),
        iter_markers=lambda: iter(marked),
        nodeid=f"tests/test_x.py::{fn.__name__}",
    )


def test_a_process_needs_e2e():
    assert marks.missing_mark(_item(SAMPLES["pure"])) is None
    assert marks.missing_mark(_item(SAMPLES["starts_a_cli"])) == "e2e"  # imported inside
    assert marks.missing_mark(_item(SAMPLES["calls_a_helper_that_starts_one"])) == "e2e"
    item = _item(SAMPLES["pure"], fixtures=["services"])
    item._fixtureinfo.name2fixturedefs["services"][0].func = types.SimpleNamespace(
        __module__="tests.fixtures"
    )
    assert marks.missing_mark(item) == "e2e"
    assert marks.missing_mark(_item(SAMPLES["pure"], ["services"], mark="e2e")) is None


def test_the_reading_follows_the_subprocess_module_and_imports():
    assert marks.starts_process(SAMPLES["pure"]) is False
    assert marks.runs_mlx(SAMPLES["runs_mlx_inside"]) is True  # an import inside the function
    assert marks.runs_mlx(SAMPLES["pure"]) is False
    # followed through a helper of the tests to the subprocess module it names
    assert marks.starts_process(SAMPLES["calls_a_helper_that_starts_one"]) is True


def test_mlx_needs_model_unless_e2e():
    assert marks.missing_mark(_item(SAMPLES["runs_mlx_inside"])) == "model"
    assert marks.missing_mark(_item(SAMPLES["runs_mlx_inside"], mark="model")) is None
    assert marks.missing_mark(_item(SAMPLES["runs_mlx_inside"], mark="e2e")) is None


def test_the_collection_error_names_the_test_and_the_mark(monkeypatch):
    monkeypatch.setattr(marks.pytest, "Function", types.SimpleNamespace)
    with pytest.raises(pytest.UsageError) as e:
        marks.check_collected([_item(SAMPLES["runs_mlx_inside"])])
    msg = str(e.value)
    assert "tests/test_x.py::runs_mlx_inside" in msg and "not marked `model`" in msg
    assert "pytestmark = pytest.mark.model" in msg
    marks.check_collected([_item(SAMPLES["pure"])])  # nothing missing: no error


@pytest.mark.model
def test_a_model_worth_of_mlx_memory_fails_an_unmarked_test():
    import mlx.core as mx

    marks.mlx_reset()
    mx.eval(mx.zeros((marks.MODEL_BYTES // 4 + 1,), mx.float32))
    assert marks.mlx_ran() >= marks.MODEL_BYTES
    marks.fail_if_mlx_ran(_item(SAMPLES["pure"], mark="model"))  # marked: fine
    with pytest.raises(pytest.fail.Exception, match="mark it `model`"):
        marks.fail_if_mlx_ran(_item(SAMPLES["pure"]))


@pytest.mark.model
def test_what_earlier_tests_still_hold_is_not_charged_to_the_next():
    """A model's worth already held at the reset (a run-scoped model, arrays not yet collected)
    is not this test's: a pure test after a model test is not blamed for it."""
    import mlx.core as mx

    held = mx.zeros((marks.MODEL_BYTES // 4 + 1,), mx.float32)
    mx.eval(held)
    marks.mlx_reset()
    mx.eval(mx.ones((256,), mx.float32))  # this test's own: 1 KB (the peak now counts `held` too)
    assert marks.mlx_ran() < marks.MODEL_BYTES
    marks.fail_if_mlx_ran(_item(SAMPLES["pure"]))  # a kilobyte of its own: no failure
    del held
