"""The reaper's tick with no clock to keep: `macserve router --ttl never` and no profile with a
TTL of its own. (It divided None by 4, so the reaper's task died at its first tick and no
profile TTL was ever kept; found by the type checker, tests/test_types.py.)"""

from macserve.services.router.model import Settings
from macserve.services.router.pool import TICK_MAX, TICK_MIN, Pool


def test_the_reaper_ticks_without_any_ttl(macserve_home):
    assert Pool(Settings(ttl=None)).tick() == TICK_MAX
    assert TICK_MIN <= Pool(Settings(ttl=1.0)).tick() < TICK_MAX  # a short TTL: a faster tick
