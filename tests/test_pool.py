"""The router's pool, its rules alone: admission under the budget, eviction order, TTL, a crash,
a start that fails, a profile that can never fit, and the state machine's refusals.

The pool is given fakes for what it asks of the world (router/ops.py's `PoolOps`): a supervisor
that is a dict of what runs, starts that succeed or fail as told, footprints as fractions of
the pool's own budget, and a clock the test moves. The profiles are real files in the test's
MACSERVE_HOME. No process, no sleep: each test runs in milliseconds. The same rules with real
servers: tests/test_router.py.
"""

import asyncio
import itertools
import logging

import pytest

from macserve.errors import MacserveError
from macserve.router import state
from macserve.router.errors import RouteError
from macserve.router.model import Settings, size
from macserve.router.ops import PoolOps
from macserve.router.pool import TICK_MAX, TICK_MIN, Pool
from macserve.router.state import MOVES, IllegalTransition, Machine, State
from macserve.services.health import Outcome
from macserve.services.profiles import Profile, ProfileStore
from macserve.services.share import Share
from macserve.services.supervisors import Status

RAM = 64 * 2**30  # the Mac the pool plans for (--memory); every footprint is a share of its budget


class World:
    """What the pool asks of the world, faked: `running` is the supervisor (name -> pid)."""

    def __init__(self):
        self.running: dict[str, int] = {}
        self.died: set[str] = set()  # stopped by a crash, not by a stop
        self.fails: dict[str, str] = {}  # name -> the error its start raises
        self.share: dict[str, float] = {}  # name -> its footprint, as a share of the budget
        self.changing: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.now = 1000.0
        self.pids = itertools.count(100)
        self.budget = 0  # the pool's budget_bytes, once it exists

    def status(self, name: str) -> Status:
        if name in self.running:
            return Status(name, True, "running", pid=self.running[name])
        died = name in self.died
        return Status(name, True, "exited" if died else "stopped", died=died)

    def start(self, name: str, timeout: float) -> Outcome:
        self.calls.append(("start", name))
        if name in self.fails:
            raise MacserveError(self.fails[name])
        self.running[name] = pid = next(self.pids)
        self.died.discard(name)
        return Outcome(name, pid=pid)

    def stop(self, name: str) -> None:
        self.calls.append(("stop", name))
        self.running.pop(name, None)
        self.died.discard(name)

    def crash(self, name: str) -> None:
        del self.running[name]
        self.died.add(name)

    def footprint(self, name: str) -> Share:
        b = int(self.share[name] * self.budget)  # the share by hand, as MEMORY= gives it
        return Share(name, b, 0, 1, 0, 0, "", 0, 4096, "llama.cpp/f16", b, "MEMORY")

    async def moved(self, up, models) -> list[bool]:
        return [False] * len(up)

    def ops(self) -> PoolOps:
        return PoolOps(
            profiles=ProfileStore,
            status=self.status,
            start=self.start,
            restart=self.start,
            stop=self.stop,
            wait_ready=lambda p, timeout: (p.name in self.running, "not running"),
            footprint=self.footprint,
            changing=lambda name: name in self.changing,
            last_use=lambda name: None,
            moved=self.moved,
            clock=lambda: self.now,
            wall=lambda: self.now + 1.7e9,
        )

    def stops(self) -> list[str]:
        return [n for op, n in self.calls if op == "stop"]

    def starts(self) -> list[str]:
        return [n for op, n in self.calls if op == "start"]


def profiles(**shares_and_keys):
    """Profile files, each `name=(share, {KEY: value})` or `name=share`."""
    out = {}
    for port, (name, spec) in enumerate(shares_and_keys.items(), 18100):
        share, keys = spec if isinstance(spec, tuple) else (spec, {})
        values = {"PROVIDER": "llama.cpp", "MODEL": f"/models/{name}.gguf", "PORT": str(port)}
        ProfileStore().save(Profile(name, {**values, **keys}))
        out[name] = share
    return out


def pool_of(world: World, ttl: float | None = 300.0, start_timeout: float = 300.0, **shares):
    world.share.update(profiles(**shares))
    pool = Pool(Settings(memory_bytes=RAM, ttl=ttl, start_timeout=start_timeout), world.ops())
    world.budget = pool.budget.budget_bytes
    pool.refresh()
    return pool


async def use(pool: Pool, world: World, name: str, at: float | None = None) -> None:
    """One request for `name`: ready, then released at `at` (the clock's now by default)."""
    m = pool.models[name]
    lease = pool.lease(m)
    try:
        await pool.ready(m)
    finally:
        if at is not None:
            world.now = at
        lease.release()


def states(pool: Pool) -> dict[str, State]:
    return {n: m.state for n, m in pool.models.items()}


# ---- admission ---------------------------------------------------------------------------------


def test_admits_what_fits_beside_what_runs():
    w = World()
    pool = pool_of(w, a=0.4, b=0.4)

    async def go():
        await use(pool, w, "a")
        await use(pool, w, "b")

    asyncio.run(go())
    assert w.starts() == ["a", "b"] and w.stops() == []
    assert states(pool) == {"a": State.RUNNING, "b": State.RUNNING}
    assert not any(m.admitted for m in pool.models.values())  # counted by the supervisor now
    assert pool.models["a"].ready_pid == w.running["a"]


def test_a_running_profile_is_not_started_again():
    w = World()
    pool = pool_of(w, a=0.4)

    async def go():
        await use(pool, w, "a")
        await use(pool, w, "a")

    asyncio.run(go())
    assert w.starts() == ["a"]


def test_racing_requests_start_a_profile_once():
    w = World()
    pool = pool_of(w, a=0.4)

    async def go():
        await asyncio.gather(*(use(pool, w, "a") for _ in range(5)))

    asyncio.run(go())
    assert w.starts() == ["a"] and pool.models["a"].inflight == 0


# ---- eviction ----------------------------------------------------------------------------------


def test_evicts_the_least_recently_used_first_and_only_what_the_room_needs():
    w = World()
    pool = pool_of(w, a=0.3, b=0.3, c=0.3, d=0.3)

    async def go():
        await use(pool, w, "a", at=1001)
        await use(pool, w, "b", at=1002)
        await use(pool, w, "c", at=1003)
        await use(pool, w, "a", at=1004)  # a used again: b is now the least recently used
        await use(pool, w, "d", at=1005)

    asyncio.run(go())
    assert w.stops() == ["b"]  # one stop frees enough; a and c stay
    assert set(w.running) == {"a", "c", "d"}
    assert states(pool)["b"] is State.STOPPED
    assert 'profile="b",reason="evicted"' in pool.prom.render().decode()


def test_never_evicts_a_profile_in_use_always_on_or_being_changed():
    w = World()
    pool = pool_of(w, start_timeout=0, a=0.3, b=(0.3, {"TTL": "never"}), c=0.3, d=0.3)
    w.changing.add("c")  # a `macserve set` at work on it

    async def go():
        await use(pool, w, "b", at=1001)
        await use(pool, w, "c", at=1002)
        held = pool.lease(pool.models["a"])  # a request still being answered
        await pool.ready(pool.models["a"])
        with pytest.raises(RouteError) as e:
            await pool.ready(pool.models["d"])
        held.release()
        return e.value

    e = asyncio.run(go())
    assert (e.status, e.retry, e.retry_after) == (503, True, 5)
    assert "no room for model d" in e.message and "held by a, b, c" in e.message
    assert w.stops() == [] and set(w.running) == {"a", "b", "c"}
    assert states(pool)["d"] is State.STOPPED and not pool.models["d"].admitted


def test_a_start_waits_for_a_busy_profile_then_evicts_it(caplog):
    w = World()
    pool = pool_of(w, a=0.6, b=0.6)
    caplog.set_level(logging.INFO, "macserve.router")

    async def go():
        held = pool.lease(pool.models["a"])
        await pool.ready(pool.models["a"])
        waiting = asyncio.ensure_future(use(pool, w, "b"))
        for _ in range(100_000):  # until it waits for room (its status reads are threads)
            if "b waits for room: a busy" in caplog.text:
                break
            await asyncio.sleep(0)
        assert not waiting.done() and w.stops() == []
        held.release()  # the request ends: a is idle, so it can go
        await waiting

    asyncio.run(go())
    assert w.stops() == ["a"] and set(w.running) == {"b"}


def test_a_tick_trims_what_runs_past_the_budget_least_recently_used_first():
    w = World()
    pool = pool_of(w, a=0.4, b=0.4, c=0.4)

    async def go():
        await use(pool, w, "c", at=1001)
        await use(pool, w, "a", at=1002)
        w.running["b"] = 999  # started by hand (`macserve start b`) beside them
        await pool.reap()

    asyncio.run(go())
    assert w.stops() == ["c"] and set(w.running) == {"a", "b"}


# ---- TTL ---------------------------------------------------------------------------------------


def test_an_idle_profile_is_stopped_past_its_ttl_and_not_before():
    w = World()
    pool = pool_of(w, ttl=60, a=(0.3, {"TTL": "10s"}), b=0.3)

    async def go():
        await use(pool, w, "a", at=1000)
        await use(pool, w, "b", at=1000)
        w.now = 1009
        await pool.reap()
        assert w.stops() == []
        w.now = 1011  # a: idle past its own TTL; b: under the router's
        await pool.reap()
        assert w.stops() == ["a"]
        w.now = 1061
        await pool.reap()

    asyncio.run(go())
    assert w.stops() == ["a", "b"] and states(pool) == {"a": State.STOPPED, "b": State.STOPPED}
    text = pool.prom.render().decode()
    assert 'profile="a",reason="ttl"' in text and 'profile="b",reason="ttl"' in text


def test_no_ttl_stop_while_a_request_is_in_flight_nor_for_ttl_never():
    w = World()
    pool = pool_of(w, ttl=10, a=0.3, b=(0.3, {"TTL": "never"}))

    async def go():
        held = pool.lease(pool.models["a"])
        await pool.ready(pool.models["a"])
        await use(pool, w, "b", at=1000)
        w.now = 5000
        await pool.reap()
        held.release()

    asyncio.run(go())
    assert w.stops() == []


def test_a_profile_found_running_counts_as_used_from_when_it_is_seen():
    w = World()
    pool = pool_of(w, ttl=10, a=0.3)
    w.running["a"] = 555  # a `macserve start` by hand, or a router restarted

    async def go():
        await pool.reap()
        assert states(pool)["a"] is State.RUNNING and w.stops() == []
        w.now += 11
        await pool.reap()

    asyncio.run(go())
    assert w.stops() == ["a"]


# ---- a crash -----------------------------------------------------------------------------------


def test_a_crash_is_seen_and_the_next_request_starts_it_again(caplog):
    w = World()
    pool = pool_of(w, a=0.4)
    caplog.set_level(logging.INFO, "macserve.router")

    async def go():
        await use(pool, w, "a")
        first = w.running["a"]
        w.crash("a")
        await pool.reap()
        assert states(pool)["a"] is State.STOPPED
        await use(pool, w, "a")
        return first

    first = asyncio.run(go())
    assert "a: running -> stopped: the supervisor says exited (its process died)" in caplog.text
    assert w.starts() == ["a", "a"] and w.running["a"] != first
    assert states(pool)["a"] is State.RUNNING and pool.models["a"].ready_pid == w.running["a"]


def test_a_server_respawned_by_its_supervisor_is_waited_for_not_started():
    w = World()
    pool = pool_of(w, a=0.4)

    async def go():
        await use(pool, w, "a")
        w.running["a"] = 4242  # supervisord restarted it after a crash: a new pid
        await use(pool, w, "a")

    asyncio.run(go())
    assert w.starts() == ["a"] and pool.models["a"].ready_pid == 4242


# ---- a start that fails ------------------------------------------------------------------------


def test_a_failed_start_reaches_the_caller_leaves_nothing_running_nor_counted():
    w = World()
    pool = pool_of(w, a=0.6, b=0.6)
    w.fails["a"] = "a did not become ready: its log says: error loading model"

    async def go():
        with pytest.raises(RouteError) as e:
            await use(pool, w, "a")
        failed = states(pool)["a"]
        listed = {x["id"]: x for x in await pool.listing()}["a"]
        await use(pool, w, "b")  # the whole budget is free again: nothing to evict
        return e.value, failed, listed

    e, failed, listed = asyncio.run(go())
    assert (e.status, e.retry) == (502, False)
    assert "model a did not start" in e.message and "error loading model" in e.message
    assert failed is State.FAILED
    assert listed["state"] == "stopped" and "error loading model" in listed["error"]
    assert w.calls == [("start", "a"), ("stop", "a"), ("start", "b")]  # no crash loop left
    a = pool.models["a"]
    assert not a.admitted and a.inflight == 0 and a.start_task is None
    assert 'macserve_router_start_failures_total{profile="a"} 1.0' in pool.prom.render().decode()


def test_after_a_failed_start_the_next_request_starts_it_afresh():
    w = World()
    pool = pool_of(w, a=0.4)
    w.fails["a"] = "boom"

    async def go():
        with pytest.raises(RouteError):
            await use(pool, w, "a")
        await pool.reap()  # the supervisor says stopped: a failed start stays FAILED
        assert states(pool)["a"] is State.FAILED
        del w.fails["a"]
        await use(pool, w, "a")

    asyncio.run(go())
    assert states(pool)["a"] is State.RUNNING and pool.models["a"].error is None


# ---- a profile that can never fit --------------------------------------------------------------


def test_a_profile_bigger_than_the_budget_is_refused_at_once_with_the_figures():
    w = World()
    pool = pool_of(w, a=0.4, big=1.5)

    async def go():
        await use(pool, w, "a")
        with pytest.raises(RouteError) as e:
            await use(pool, w, "big")
        return e.value

    e = asyncio.run(go())
    assert (e.status, e.code) == (400, "model_too_large")
    need, budget = int(1.5 * w.budget), w.budget
    assert f"model big needs {size(need)}" in e.message
    assert f"the memory budget is {size(budget)}" in e.message
    assert "cannot fit even alone" in e.message and "CTX=N" in e.message
    assert w.calls == [("start", "a")]  # nothing evicted, nothing started
    assert states(pool) == {"a": State.RUNNING, "big": State.STOPPED}
    assert not pool.models["big"].admitted


# ---- the state machine -------------------------------------------------------------------------


def test_the_table_names_every_state_and_reaches_failed_only_from_a_start():
    assert set(MOVES) == set(State)
    assert [s for s in State if State.FAILED in MOVES[s]] == [State.STARTING]
    assert all(s not in MOVES[s] for s in State)  # staying put is not a move
    assert {s.shown for s in State} == {"stopped", "starting", "running", "stopping"}


@pytest.mark.parametrize(
    "path, bad",
    [
        ((), State.STOPPED),  # no move
        ((), State.FAILED),  # nothing was started
        ((State.STARTING, State.RUNNING), State.FAILED),  # a crash is seen as stopped
        ((State.STARTING, State.RUNNING, State.STOPPING), State.FAILED),
        ((State.STARTING, State.FAILED), State.STOPPED),  # a failed start stays failed
    ],
)
def test_an_illegal_move_is_refused_and_changes_nothing(path, bad):
    m = Machine("x")
    for s in path:
        m.transition(s, "test")
    was = m.state
    with pytest.raises(IllegalTransition, match=f"x: {was.value} -> {bad.value} refused"):
        m.transition(bad, "test")
    assert m.state is was


def test_every_move_is_logged_with_profile_from_to_and_why(caplog):
    caplog.set_level(logging.INFO, state.log.name)
    m = Machine("x")
    m.transition(State.STARTING, "a request: starting it")
    m.transition(State.RUNNING, "ready in 1.0s (pid 7)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "x: stopped -> starting: a request: starting it",
        "x: starting -> running: ready in 1.0s (pid 7)",
    ]


def test_the_pool_logs_each_move_of_a_request_and_an_eviction(caplog):
    w = World()
    pool = pool_of(w, a=0.6, b=0.6)
    caplog.set_level(logging.INFO, "macserve.router")

    async def go():
        await use(pool, w, "a", at=1001)
        await use(pool, w, "b", at=1002)

    asyncio.run(go())
    moves = [r.getMessage() for r in caplog.records if " -> " in r.getMessage()]
    assert [x.split(":")[0] + ":" + x.split(":")[1] for x in moves] == [
        "a: stopped -> starting",
        "a: starting -> running",
        "b: stopped -> starting",
        "a: running -> stopping",
        "a: stopping -> stopped",
        "b: starting -> running",
    ]
    assert any(x.startswith("a: running -> stopping: evicted, least recently used") for x in moves)


SUPERVISOR_STATES = (
    "running",
    "starting",
    "stopping",
    "stopped",
    "exited",
    "failed",
    "not installed",
)


@pytest.mark.parametrize("was", list(State))
def test_whatever_the_supervisor_says_is_a_legal_move_from_every_state(was):
    """The pool follows the supervisor (a crash, a start or stop by hand) from any state without
    an illegal move: a refusal there would break every reaper tick."""
    w = World()
    pool = pool_of(w, a=0.4)
    m = pool.models["a"]
    for says in SUPERVISOR_STATES:
        m._state = was  # the state under test, however it was reached
        pool.observe(m, Status("a", True, says, pid=7 if says == "running" else None))
        want = {"running": State.RUNNING, "starting": State.STARTING, "stopping": State.STOPPING}
        assert m.state is want.get(says, State.FAILED if was is State.FAILED else State.STOPPED)


def test_the_reaper_ticks_without_any_ttl(macserve_home):
    """`macserve router --ttl never` and no profile with a TTL of its own: no clock to keep, the
    slowest tick (it divided None by 4, so the reaper's task died at its first tick and no
    profile's TTL was ever kept; found by the type checker, tests/test_types.py)."""
    assert Pool(Settings(ttl=None)).tick() == TICK_MAX
    assert TICK_MIN <= Pool(Settings(ttl=1.0)).tick() < TICK_MAX  # a short TTL: a faster tick
