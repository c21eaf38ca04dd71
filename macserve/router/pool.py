"""The router's pool of profiles: start on demand, stop when idle, never more than fits.

Every profile that serves a model is in the pool (not RPC workers, not routers). For each the
pool keeps what the supervisor cannot tell it: requests in flight, when it was last used, the
start or stop under way, and its footprint (weights + cache at its configured context, as
`inspect` counts them: `services.footprint`). The supervisor stays the truth about what runs:
its status is read before a request is forwarded, before a start is admitted, and at every
reaper tick, so a service started, stopped or crashed behind the router's back is seen.

What the pool asks of the world (the profiles, the supervisor, start and stop, footprints,
clocks) comes in one `PoolOps` (ops.py), real or faked by the unit tests. Each profile's state
is a state machine (state.py): named states, the moves allowed, every move logged.

Starting (`ready`): one task per profile; every request for it waits on that task, so racing
requests start it once. A profile the supervisor runs is only waited for; a stopped one is
first admitted against the budget, then started with `services.lifecycle.start` (the same checks, unit
and health wait as `macserve start`); a failed start is stopped again (no crash loop left
behind; FAILED until the next request) and its error, with the server's own line, goes to
every waiting request.

Admission (the memory budget: who fits, who is evicted): admission.py.

Idle stop: a reaper stops a profile whose last request ended more than its TTL ago (the
profile's TTL key, else the router's --ttl). A profile found running that the router never
served counts as used when first seen. The reaper also stops idle profiles, least recently
used first, while more runs than the budget holds (supervisord starts every installed service
when it starts; a `macserve start` by hand).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..errors import MacserveError
from ..services import providers
from ..services import routed as state_file
from ..services.share import Share
from ..services.supervisors import Status
from ..sizing.budget import machine_budget
from . import admission
from .admission import IN_MEMORY
from .errors import RouteError
from .model import Model, Settings, clear_task, mtime
from .ops import PoolOps
from .prom import RouterMetrics
from .state import State

log = logging.getLogger("macserve.router")

WAITS, STARTS = "waiting for its server to answer", "starting it"  # why a request moves it
# The supervisor's states as the router's (every other one: stopped, exited, failed, not installed).
SEEN = {"running": State.RUNNING, "starting": State.STARTING, "stopping": State.STOPPING}
TICK_MIN, TICK_MAX = 0.1, 5.0


class Lease:
    """A request's hold on a model: counted in flight until released (once)."""

    def __init__(self, pool: Pool, m: Model):
        self.pool, self.model, self.done = pool, m, False
        m.inflight += 1

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.model.inflight -= 1
            self.model.last_used = self.pool.ops.clock()
            self.pool.pulse()


class Pool:
    def __init__(self, settings: Settings, ops: PoolOps | None = None):
        self.settings = settings
        self.ops = ops or PoolOps.real()
        self.budget = machine_budget(settings.memory_bytes)
        self.models: dict[str, Model] = {}
        self.broken: dict[str, tuple] = {}  # profiles that do not load: name -> (why, stamp)
        self._admission: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None
        self._published: str | None = None
        self.held: set[str] = set()  # left running while a `set` changes them (logged once)
        self.prom = RouterMetrics(self)

    # ---- the profiles --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up new, changed and removed profiles (a stat per profile; parsed on change)."""
        st = self.ops.profiles()
        names = st.names()
        for name in names:
            stamp = tuple(mtime(p) for p in (st.path(name), st.secrets_path(name)))
            m = self.models.get(name)
            if (m and m.stamp == stamp) or self.broken.get(name, (None, None))[1] == stamp:
                continue
            try:
                p = st.load(name)
                key = st.load_secrets(name).get("API_KEY")
            except MacserveError as e:
                self.broken[name] = (str(e), stamp)
                self.models.pop(name, None)
                continue
            self.broken.pop(name, None)
            if not providers.for_profile(p).serves_model:
                self.models.pop(name, None)
            elif m:
                m.update(p, key, stamp)
            else:
                self.models[name] = Model(p, key, stamp)
        for gone in set(self.models) - set(names):
            del self.models[gone]
        for gone in set(self.broken) - set(names):
            del self.broken[gone]

    def resolve(self, name: str) -> Model:
        """The profile a request's `model` names: a profile name, else an alias."""
        m = self.models.get(name)
        if m:
            return m
        hits = [m for m in self.models.values() if name in m.profile.aliases]
        if len(hits) > 1:
            raise RouteError(
                400,
                f"model {name!r} is an alias of several profiles "
                f"({', '.join(sorted(h.name for h in hits))}): remove it from all but one "
                "(macserve set NAME -- ALIASES=...)",
                "invalid_request_error",
            )
        if hits:
            return hits[0]
        known = sorted(self.models) + sorted(
            a for m in self.models.values() for a in m.profile.aliases
        )
        why = (
            f"; {name} is not a valid profile ({self.broken[name][0]})"
            if name in self.broken
            else ""
        )
        raise RouteError(
            404,
            f"model {name!r} not found (known: {', '.join(known) or 'none'}){why}",
            "invalid_request_error",
            code="model_not_found",
        )

    # ---- the event loop's helpers --------------------------------------------------------------

    @property
    def admission_lock(self) -> asyncio.Lock:
        if self._admission is None:
            self._admission = asyncio.Lock()
        return self._admission

    def pulse(self) -> None:
        """Wake whoever waits for a change (a request ended, a service stopped)."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def status(self, m: Model) -> Status:
        st = await asyncio.to_thread(self.ops.status, m.name)
        self.observe(m, st)
        return st

    async def statuses(self) -> dict[str, Status]:
        models = list(self.models.values())
        sts = await asyncio.to_thread(lambda: [self.ops.status(m.name) for m in models])
        for m, st in zip(models, sts):
            self.observe(m, st)
        return {m.name: st for m, st in zip(models, sts)}

    def observe(self, m: Model, st: Status) -> None:
        """The supervisor's view, read: kept in `seen`, and followed by the state machine
        when no start or stop of the router's is under way (those move it themselves): a
        crash, a start or stop by hand, a respawn. A failed start stays FAILED while stopped."""
        m.seen = st.state
        if m.start_task is not None or m.stop_task is not None:
            return
        to = SEEN.get(st.state, State.STOPPED)
        if to is State.STOPPED and m.state is State.FAILED:
            return
        if to is not m.state:
            died = " (its process died)" if st.died else ""
            m.transition(to, f"the supervisor says {st.state}{died}")

    async def footprint(self, m: Model) -> Share:
        if m.footprint is None:
            m.footprint = await asyncio.to_thread(self.ops.footprint, m.name)
        return m.footprint

    def lease(self, m: Model) -> Lease:
        return Lease(self, m)

    # ---- ready: start on demand -----------------------------------------------------------------

    async def ready(self, m: Model) -> None:
        """Return once `m`'s server answers, starting it (once) if needed; RouteError if not."""
        while m.stop_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(m.stop_task)
        if m.start_task is None:
            st = await self.status(m)
            if st.state == "running" and st.pid and st.pid == m.ready_pid:
                return
            if m.start_task is None and m.stop_task is None:
                if m.state is not State.STARTING:
                    up = st.state in ("running", "starting") and not st.died
                    m.transition(State.STARTING, f"a request: {WAITS if up else STARTS}")
                task = asyncio.ensure_future(self._bring_up(m, st))
                m.start_task = task
                task.add_done_callback(lambda t: self._start_done(m, t))
        if m.start_task is None:  # a stop began while the status was read
            return await self.ready(m)
        await asyncio.shield(m.start_task)

    def _start_done(self, m: Model, task: asyncio.Task) -> None:
        """A start that ended without settling (admission refused, a bug): back to stopped."""
        clear_task(m, "start_task", task)
        if m.state is State.STARTING and m.start_task is None:
            why = "not started" if task.cancelled() else f"not started: {task.exception()}"
            m.transition(State.STOPPED, why)

    def _settle(self, m: Model, to: State, why: str) -> None:
        """The end of a start: unless a stop overtook it (the page's), which then decides."""
        if m.state is State.STARTING:
            m.transition(to, why)

    async def _bring_up(self, m: Model, st: Status) -> None:
        timeout = self.settings.start_timeout
        clock = self.ops.clock
        restart = False
        if st.state in ("running", "starting") and not st.died:
            # Up (perhaps respawned by its supervisor after a crash): wait for it.
            ok, why = await asyncio.to_thread(self.ops.wait_ready, m.profile, timeout)
            if ok:
                m.ready_pid = (await self.status(m)).pid
                m.last_used, m.error = clock(), None
                self._settle(m, State.RUNNING, f"ready (pid {m.ready_pid})")
                return
            log.warning("%s: running but not ready (%s): restarting it", m.name, why)
            restart = True  # its memory is already counted: no admission
        else:
            await admission.admit(self, m)
        t0 = clock()
        try:
            fn = self.ops.restart if restart else self.ops.start
            out = await asyncio.to_thread(fn, m.name, timeout=timeout)
        except MacserveError as e:
            m.error = str(e)
            self.prom.failed(m.name)
            log.error("%s did not start: %s", m.name, e)
            # Leave no crash loop (nor its memory) behind: the next request starts it afresh.
            with contextlib.suppress(MacserveError):
                await asyncio.to_thread(self.ops.stop, m.name)
            m.seen = "stopped"
            self._settle(m, State.FAILED, "its start failed, stopped again")
            raise RouteError(502, f"model {m.name} did not start: {e}", "server_error") from None
        finally:
            m.admitted = False
            self.pulse()
        m.ready_pid, m.seen = out.pid, "running"
        m.last_used, m.error = clock(), None
        self.prom.started(m.name, clock() - t0)
        self._settle(m, State.RUNNING, f"ready in {clock() - t0:.1f}s (pid {out.pid})")

    # ---- stop -----------------------------------------------------------------------------------

    async def stop(self, m: Model, why: str, reason: str = "other") -> None:
        if m.stop_task is None:
            self.prom.stopped(m.name, reason)
            if m.state is State.STOPPING:  # a stop by hand seen under way: the router's too
                log.info("%s: stopping: %s", m.name, why)
            else:
                m.transition(State.STOPPING, why)
            task = asyncio.ensure_future(self._stop(m))
            m.stop_task = task
            task.add_done_callback(lambda t: clear_task(m, "stop_task", t))
        await asyncio.shield(m.stop_task)
        self.pulse()

    async def _stop(self, m: Model) -> None:
        try:
            await asyncio.to_thread(self.ops.stop, m.name)
            why = "stopped"
        except MacserveError as e:
            log.warning("%s: stop failed: %s", m.name, e)
            why = f"stop failed ({e}); counted as stopped"
        m.ready_pid, m.seen = None, "stopped"
        if m.state is not State.STOPPED:
            m.transition(State.STOPPED, why)

    # ---- the reaper -----------------------------------------------------------------------------

    def tick(self) -> float:
        # None: never (--ttl never, TTL=never): no clock of its own to keep
        ttls = [
            t
            for t in (self.settings.ttl, *(m.ttl(self.settings.ttl) for m in self.models.values()))
            if t is not None
        ]
        return min(TICK_MAX, max(TICK_MIN, min(ttls) / 4)) if ttls else TICK_MAX

    async def reap(self) -> None:
        """Stop every profile idle past its TTL; note the ones seen running for the first time."""
        self.refresh()
        sts = await self.statuses()
        now = self.ops.clock()
        stops = []
        up = [m for m in self.models.values() if (st := sts.get(m.name)) and st.state in IN_MEMORY]
        moved = await self.ops.moved(up, self.models.values())  # clients at their ports
        for m, worked in zip(up, moved):
            if not m.last_used or worked:
                m.last_used = now  # never served by this router, or used past it: from now
            used = self.ops.last_use(m.name)  # a use past the router (chat to its port, start)
            if used is not None:
                m.last_used = max(m.last_used, used - (self.ops.wall() - now))
            ttl = m.ttl(self.settings.ttl)
            idle = m.idle(now)
            if ttl is not None and idle is not None and idle > ttl and admission.evictable(self, m):
                stops.append(self.stop(m, f"idle {idle:.1f}s, past its TTL of {ttl:g}s", "ttl"))
        if stops:
            await asyncio.gather(*stops)  # side by side: each waits for its process to exit
        await admission.trim(self)
        self.publish()

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.tick())
            try:
                await self.reap()
            except Exception:  # the router must outlive one bad tick (a supervisor hiccup)
                log.exception("reaper tick failed")

    # ---- what a client or `ls` sees -------------------------------------------------------------

    def state_of(self, m: Model) -> str:
        """What clients see: running, starting, stopping or stopped."""
        return m.state.shown

    async def listing(self) -> list[dict]:
        self.refresh()
        await self.statuses()
        now = self.ops.clock()
        out = []
        for name in sorted(self.models):
            m = self.models[name]
            fp = await self.footprint(m)
            idle = m.idle(now) if self.state_of(m) == "running" else None
            out.append(
                {
                    "id": name,
                    "state": self.state_of(m),
                    "provider": m.profile.provider,
                    "aliases": list(m.profile.aliases),
                    "ttl_s": m.ttl(self.settings.ttl),
                    "always_on": m.profile.always_on,
                    "idle_s": None if idle is None else round(idle, 1),
                    "in_flight": m.inflight,
                    "footprint_bytes": fp.share_bytes,
                    "footprint": fp.as_dict(),
                    "error": m.error,
                }
            )
        return out

    def publish(self) -> None:
        """Write the state file for `macserve ls` when what it says has changed."""
        wall = self.ops.wall() - self.ops.clock()
        models = {
            name: {
                "state": self.state_of(m),
                "ttl_s": m.ttl(self.settings.ttl),
                "last_used": round(wall + m.last_used, 1) if m.last_used else None,
                "in_flight": m.inflight,
            }
            for name, m in sorted(self.models.items())
        }
        s = self.settings
        doc = {
            "url": f"http://{providers.url_host(s.host)}:{s.port}",
            "port": s.port,
            "ttl_s": s.ttl,
            "budget_bytes": self.budget.budget_bytes,
            "models": models,
        }
        text = repr(doc)
        if text != self._published:
            state_file.write(s.port, doc)
            self._published = text

    def unpublish(self) -> None:
        state_file.remove(self.settings.port)
