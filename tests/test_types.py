"""The type checker over the wings that have adopted it: mypy (its settings in pyproject.toml,
[tool.mypy]) on macserve/services/ and macserve/router/. A type error
there fails the suite. It also checks that every provider in the registry satisfies the
`Provider` protocol: REGISTRY is typed `dict[str, Provider]`.

Run in this process (mypy.api), so it starts nothing; its cache (.mypy_cache/) makes a second
run take seconds. A wing joins by adding its folder to CHECKED."""

from .conftest import REPO

CHECKED = ("macserve/services", "macserve/router")


def test_the_checked_wings_type_check():
    try:
        from mypy import api  # the type checker: a test dependency, loaded by this test only
    except ImportError:
        raise AssertionError("mypy is in the test extras: pip install -e '.[test]'") from None
    missing = [f for f in CHECKED if not (REPO / f).is_dir()]
    assert not missing, f"moved? {missing}: name the wing's folder in CHECKED"
    out, err, status = api.run(
        ["--config-file", str(REPO / "pyproject.toml"), *(str(REPO / f) for f in CHECKED)]
    )
    assert status == 0, f"mypy on {', '.join(CHECKED)}:\n{out}{err}"
