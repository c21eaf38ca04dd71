"""The router's pool of profiles: start on demand, stop when idle, never more than fits.

Every profile that serves a model is in the pool (not RPC workers, not routers). For each the
pool keeps what the supervisor cannot tell it: requests in flight, when it was last used, the
start or stop under way, and its footprint (weights + cache at its configured context, as
`inspect` counts them: `manager.footprint`). The supervisor stays the truth about what runs:
its status is read before a request is forwarded, before a start is admitted, and at every
reaper tick, so a service started, stopped or crashed behind the router's back is seen.

Starting (`ready`): one task per profile; every request for it waits on that task, so racing
requests start it once. A profile the supervisor runs is only waited for; a stopped one is
first admitted against the budget, then started with `manager.start` (the same checks, unit
and health wait as `macserve start`); a failed start is stopped again (no crash loop left
behind) and its error, with the server's own line, goes to every waiting request.

Admission: one at a time. The footprints of the profiles in memory (running, starting or
stopping per the supervisor, or admitted and not yet started) plus this one must fit the
budget (the GPU wired limit, `sizing.budget.machine_budget`); if not, idle profiles are
stopped, least recently used first. A profile with requests in flight, a start under way, or
TTL=never is never evicted: if only such profiles stand in the way, the start waits for them
to finish (up to the start timeout). A profile bigger than the whole budget is refused at once.

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
import time

from ..errors import MacserveError
from ..services import manager, providers, usage
from ..services import routed as state_file
from ..services.profiles import MODELLESS
from ..services.supervisors import Status
from ..sizing.budget import machine_budget
from ..web.errors import HttpError
from .activity import Activity

# Model and Settings live in model.py; app.py and cli/router.py still name them (and size,
# DEFAULT_START_TIMEOUT) here.
from .model import DEFAULT_START_TIMEOUT, Model, Settings, clear_task, mtime, size  # noqa: F401
from .prom import RouterMetrics

log = logging.getLogger("macserve.router")

IN_MEMORY = ("running", "starting", "stopping")  # supervisor states that hold the model's memory
TICK_MIN, TICK_MAX = 0.1, 5.0


class RouteError(HttpError):
    """A request the router answers itself (web.errors.HttpError, with the router's argument
    order). The router always says whether a client should retry (`x-should-retry`): by
    default not, since its errors are the request's or a server's that failed to start."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "server_error",
        retry: bool = False,
        retry_after: float | None = None,
        code: str | None = None,
    ):
        super().__init__(
            status, message, type_=type_, code=code, retry_after=retry_after, retry=retry
        )


class Lease:
    """A request's hold on a model: counted in flight until released (once)."""

    def __init__(self, pool: Pool, m: Model):
        self.pool, self.model, self.done = pool, m, False
        m.inflight += 1

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.model.inflight -= 1
            self.model.last_used = time.monotonic()
            self.pool.pulse()


class Pool:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.budget = machine_budget(settings.memory_bytes)
        self.models: dict[str, Model] = {}
        self.broken: dict[str, tuple] = {}  # profiles that do not load: name -> (why, stamp)
        self.backend = manager.get_backend()
        self._admission: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None
        self._published: str | None = None
        self._held: set[str] = set()  # left running while a `set` changes them (logged once)
        self.prom = RouterMetrics(self)
        self.activity = Activity()

    # ---- the profiles --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up new, changed and removed profiles (a stat per profile; parsed on change)."""
        st = manager.store()
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
            if p.provider in MODELLESS:
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
    def admission(self) -> asyncio.Lock:
        if self._admission is None:
            self._admission = asyncio.Lock()
        return self._admission

    def pulse(self) -> None:
        """Wake whoever waits for a change (a request ended, a service stopped)."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def status(self, m: Model) -> Status:
        st = await asyncio.to_thread(self.backend.status, m.name)
        m.state = st.state
        return st

    async def statuses(self) -> dict[str, Status]:
        models = list(self.models.values())
        sts = await asyncio.to_thread(lambda: [self.backend.status(m.name) for m in models])
        for m, st in zip(models, sts):
            m.state = st.state
        return {m.name: st for m, st in zip(models, sts)}

    async def footprint(self, m: Model) -> manager.Footprint:
        if m.footprint is None:
            m.footprint = await asyncio.to_thread(manager.footprint, m.name)
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
                task = asyncio.ensure_future(self._bring_up(m, st))
                m.start_task = task
                task.add_done_callback(lambda t: clear_task(m, "start_task", t))
        if m.start_task is None:  # a stop began while the status was read
            return await self.ready(m)
        await asyncio.shield(m.start_task)

    async def _bring_up(self, m: Model, st: Status) -> None:
        timeout = self.settings.start_timeout
        restart = False
        if st.state in ("running", "starting") and not st.died:
            # Up (perhaps respawned by its supervisor after a crash): wait for it.
            ok, why = await asyncio.to_thread(manager.wait_ready, m.profile, timeout)
            if ok:
                m.ready_pid = (await self.status(m)).pid
                m.last_used, m.error = time.monotonic(), None
                return
            log.warning("%s: running but not ready (%s): restarting it", m.name, why)
            restart = True  # its memory is already counted: no admission
        else:
            await self._admit(m)
        t0 = time.monotonic()
        log.info("starting %s", m.name)
        try:
            fn = manager.restart if restart else manager.start
            out = await asyncio.to_thread(fn, m.name, timeout=timeout)
        except MacserveError as e:
            m.error = str(e)
            self.prom.failed(m.name)
            log.error("%s did not start: %s", m.name, e)
            # Leave no crash loop (nor its memory) behind: the next request starts it afresh.
            with contextlib.suppress(MacserveError):
                await asyncio.to_thread(self.backend.stop, m.name)
            m.state = "stopped"
            raise RouteError(502, f"model {m.name} did not start: {e}", "server_error") from None
        finally:
            m.admitted = False
            self.pulse()
        m.ready_pid, m.state = out.pid, "running"
        m.last_used, m.error = time.monotonic(), None
        self.prom.started(m.name, time.monotonic() - t0)
        log.info("%s ready in %.1fs (pid %s)", m.name, time.monotonic() - t0, out.pid)

    # ---- the budget -----------------------------------------------------------------------------

    def _evictable(self, o: Model) -> bool:
        if o.inflight or o.admitted or o.start_task or o.stop_task or o.profile.always_on:
            return False
        if manager.changing(o.name):
            # a `set` is changing it: stopping it now would read as its new settings failing
            if o.name not in self._held:
                self._held.add(o.name)
                log.info("%s: left running: a change to it is in progress (macserve set)", o.name)
            return False
        self._held.discard(o.name)
        return True

    async def _holders(self, exclude: Model) -> list[tuple[Model, int]]:
        """The other profiles holding memory now (or about to), with their footprints."""
        sts = await self.statuses()
        out = []
        for o in list(self.models.values()):
            if o is exclude:
                continue
            if o.admitted or sts[o.name].state in IN_MEMORY:
                fp = await self.footprint(o)
                out.append((o, fp.total_bytes or 0))
        return out

    async def _admit(self, m: Model) -> None:
        fp = await self.footprint(m)
        need, budget = fp.total_bytes, self.budget.budget_bytes
        if need is None:
            log.warning("%s: footprint unknown (%s): started without counting it", m.name, fp.error)
            m.admitted = True
            return
        if need > budget:
            fix = (
                f"give it a smaller context (macserve set {m.name} -- CTX=N) or raise the "
                "limit (macserve doctor)"
                if m.provider.context_args(1)
                else "raise the limit (macserve doctor)"
            )
            raise RouteError(
                400,
                f"model {m.name} needs {size(need)} (weights {size(fp.weights_bytes)} + cache "
                f"{size(fp.cache_bytes)} at {fp.ctx or 0:,} tokens, {fp.cache_key}) but the "
                f"memory budget is {size(budget)} ({self.budget.source}): it cannot fit even "
                f"alone; {fix}",
                "invalid_request_error",
                code="model_too_large",
            )
        deadline = time.monotonic() + self.settings.start_timeout
        async with self.admission:
            while True:
                holders = await self._holders(m)
                used = sum(b for _, b in holders)
                if used + need <= budget:
                    m.admitted = True
                    return
                victims = sorted(
                    (h for h in holders if self._evictable(h[0])), key=lambda h: h[0].last_used
                )
                freed = 0
                for v, b in victims:
                    if used - freed + need <= budget:
                        break
                    await self.stop(
                        v,
                        f"evicted, least recently used: {m.name} needs {size(need)}, "
                        f"{size(used)} of {size(budget)} in use",
                        "evicted",
                    )
                    freed += b
                if victims:
                    continue  # read the supervisor again: what runs now
                busy = ", ".join(sorted(o.name for o, _ in holders))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RouteError(
                        503,
                        f"no room for model {m.name} ({size(need)}): {size(used)} of the "
                        f"{size(budget)} budget is held by {busy}, busy or always on",
                        "unavailable_error",
                        retry=True,
                        retry_after=5,
                    )
                log.info("%s waits for room: %s busy", m.name, busy)
                await self._wait_change(min(left, 1.0))

    # ---- stop -----------------------------------------------------------------------------------

    async def stop(self, m: Model, why: str, reason: str = "other") -> None:
        if m.stop_task is None:
            log.info("stopping %s: %s", m.name, why)
            self.prom.stopped(m.name, reason)
            task = asyncio.ensure_future(asyncio.to_thread(self.backend.stop, m.name))
            m.stop_task = task
            task.add_done_callback(lambda t: clear_task(m, "stop_task", t))
        try:
            await asyncio.shield(m.stop_task)
        except MacserveError as e:
            log.warning("%s: stop failed: %s", m.name, e)
        m.ready_pid, m.state = None, "stopped"
        self.pulse()

    # ---- the reaper -----------------------------------------------------------------------------

    def tick(self) -> float:
        ttls = [self.settings.ttl] + [
            t for m in self.models.values() if (t := m.ttl(self.settings.ttl)) is not None
        ]
        return min(TICK_MAX, max(TICK_MIN, min(ttls) / 4))

    async def reap(self) -> None:
        """Stop every profile idle past its TTL; note the ones seen running for the first time."""
        self.refresh()
        sts = await self.statuses()
        now = time.monotonic()
        stops = []
        up = [m for m in self.models.values() if (st := sts.get(m.name)) and st.state in IN_MEMORY]
        moved = await self.activity.moved(up, self.models.values())  # clients at their ports
        for m, worked in zip(up, moved):
            if not m.last_used or worked:
                m.last_used = now  # never served by this router, or used past it: from now
            used = usage.last(m.name)  # a use past the router (chat to its port, start)
            if used is not None:
                m.last_used = max(m.last_used, used - (time.time() - now))
            ttl = m.ttl(self.settings.ttl)
            idle = m.idle(now)
            if ttl is not None and idle is not None and idle > ttl and self._evictable(m):
                stops.append(self.stop(m, f"idle {idle:.1f}s, past its TTL of {ttl:g}s", "ttl"))
        if stops:
            await asyncio.gather(*stops)  # side by side: each waits for its process to exit
        await self._trim()
        self.publish()

    async def _trim(self) -> None:
        """More in memory than the budget (supervisord starts every installed service when it
        starts itself; someone ran `macserve start`): stop idle ones, least recently used
        first, until it fits. A start under way makes its own room instead."""
        if self.admission.locked():
            return
        budget = self.budget.budget_bytes
        holders = [
            (m, (await self.footprint(m)).total_bytes or 0)
            for m in list(self.models.values())
            if m.admitted or m.state in IN_MEMORY
        ]
        used = sum(b for _, b in holders)
        victims = sorted(
            (h for h in holders if self._evictable(h[0])), key=lambda h: h[0].last_used
        )
        for v, b in victims:
            if used <= budget:
                break
            await self.stop(
                v,
                f"over the memory budget ({size(used)} of {size(budget)}), least recently used",
                "over_budget",
            )
            used -= b

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.tick())
            try:
                await self.reap()
            except Exception:  # the router must outlive one bad tick (a supervisor hiccup)
                log.exception("reaper tick failed")

    # ---- what a client or `ls` sees -------------------------------------------------------------

    def state_of(self, m: Model) -> str:
        if m.stop_task is not None:
            return "stopping"
        if m.start_task is not None:
            return "starting"
        return {"running": "running", "starting": "starting", "stopping": "stopping"}.get(
            m.state, "stopped"
        )

    async def listing(self) -> list[dict]:
        self.refresh()
        await self.statuses()
        now = time.monotonic()
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
                    "footprint_bytes": fp.total_bytes,
                    "footprint": fp.as_dict(),
                    "error": m.error,
                }
            )
        return out

    def publish(self) -> None:
        """Write the state file for `macserve ls` when what it says has changed."""
        wall = time.time() - time.monotonic()
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
