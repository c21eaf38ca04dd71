"""The memory budget: which profiles may be in memory together, and who makes room.

Admission, one start at a time, counts each profile at its share (services/share.py: the most
its server's process tree may hold, which its provider passes to the server as its limits):

1. a share that is unknown (inspect cannot read the model, no MEMORY=) is refused at once: the
   router starts nothing it cannot count;
2. a share bigger than the whole budget (the GPU wired limit, `sizing.budget.machine_budget`)
   is refused at once, with its figures, nothing evicted;
3. the shares of the profiles in memory (running, starting or stopping per the supervisor, or
   admitted and not yet started) plus this one must fit the budget;
4. the machine must have this share free now (psutil's available memory), plus the shares of
   the other starts admitted and still loading (counted, not yet taken): another program's
   memory is not handed to a model.

When 3 or 4 fails, idle profiles are stopped, least recently used first, as many as the room
needs (their memory comes back; free memory is read again), unless stopping every idle one
would not free what is short of free memory: then none is stopped. A profile with requests in
flight, a start under way, or TTL=never is never evicted: if only such profiles stand in the
way of the budget, the start waits for them (up to the start timeout), then 503. If free
memory is short and stopping the idle ones cannot cover it, the start is refused at once
(503) naming free memory and what holds it.

Eviction order (`lru`): the idle ones, least recently used first. The reaper's `trim` uses the
same order when more runs than the budget holds.
"""

from __future__ import annotations

import asyncio
import logging

from .errors import RouteError
from .model import Model, size

log = logging.getLogger("macserve.router")
IN_MEMORY = ("running", "starting", "stopping")  # supervisor states that hold the model's memory


def lru(holders: list[tuple[Model, int]], pool) -> list[tuple[Model, int]]:
    """The holders the pool may stop, least recently used first."""
    return sorted((h for h in holders if evictable(pool, h[0])), key=lambda h: h[0].last_used)


def evictable(pool, o: Model) -> bool:
    """Never a profile with requests in flight, a start or stop under way, TTL=never, or a
    `set` at work on it."""
    if o.inflight or o.admitted or o.start_task or o.stop_task or o.profile.always_on:
        return False
    if pool.ops.changing(o.name):
        # a `set` is changing it: stopping it now would read as its new settings failing
        if o.name not in pool.held:
            pool.held.add(o.name)
            log.info("%s: left running: a change to it is in progress (macserve set)", o.name)
        return False
    pool.held.discard(o.name)
    return True


async def holders(pool, exclude: Model) -> list[tuple[Model, int]]:
    """The other profiles holding memory now (or about to), with their shares (0 for one whose
    share is unknown: found running, started by hand; the free-memory term sees what it holds)."""
    sts = await pool.statuses()
    out = []
    for o in list(pool.models.values()):
        if o is exclude:
            continue
        if o.admitted or sts[o.name].state in IN_MEMORY:
            out.append((o, (await pool.share(o)).share_bytes or 0))
    return out


def figures(sh) -> str:
    """A share's parts, as the refusals and `inspect NAME` say them."""
    if sh.memory_bytes is not None:
        return f"MEMORY={size(sh.memory_bytes)}, set by hand"
    seqs = f"{sh.parallel} sequence" + ("s" if sh.parallel != 1 else "")
    return (
        f"weights {size(sh.weights_bytes)} + KV {size(sh.kv_bytes)} x {seqs} at "
        f"{sh.ctx or 0:,} tokens ({sh.cache_key}) + prompt cache {size(sh.prompt_cache_bytes)} "
        f"+ baseline {size(sh.baseline_bytes)} ({sh.baseline_source}) + reserve "
        f"{size(sh.reserve_bytes)}"
    )


def _never_fits(pool, m: Model, sh, need: int) -> RouteError:
    budget = pool.budget.budget_bytes
    fix = (
        f"give it a smaller context or fewer sequences (macserve set {m.name} -- CTX=N "
        "PARALLEL=1) or raise the limit (macserve doctor)"
        if m.provider.context_args(1)
        else "raise the limit (macserve doctor)"
    )
    return RouteError(
        400,
        f"model {m.name} needs {size(need)} ({figures(sh)}) but the memory budget is "
        f"{size(budget)} ({pool.budget.source}): it cannot fit even alone; {fix}",
        "invalid_request_error",
        code="model_too_large",
    )


def _unknown(m: Model, sh) -> RouteError:
    why = sh.error or sh.note or "its size cannot be read"
    return RouteError(
        400,
        f"model {m.name}: its memory share is unknown ({why}); the router starts only what it "
        f"can count: give it one by hand (macserve set {m.name} -- MEMORY=SIZE)",
        "invalid_request_error",
        code="share_unknown",
    )


def _no_free_memory(pool, m: Model, need: int, pending: int, free: int, held, idle) -> RouteError:
    ours = ", ".join(f"{o.name} {size(b)}" for o, b in sorted(held, key=lambda h: h[0].name))
    top = "; ".join(f"{n} (pid {pid}) {size(rss)}" for n, pid, rss in pool.ops.top_holders())
    wants = f"its share {size(need)}" + (
        f" + {size(pending)} for starts under way" if pending else ""
    )
    return RouteError(
        503,
        f"no room for model {m.name} on this machine: it needs {wants} free, and "
        f"{size(free)} is free now; this router's profiles hold "
        f"{'shares of ' + ours if ours else 'nothing'} (idle ones to stop: "
        f"{size(sum(b for _, b in idle)) if idle else 'none'}); the most memory is "
        f"held by {top or 'unknown'}: another program's memory is not handed to a model: free "
        f"some, or give {m.name} a smaller share (macserve set {m.name} -- CTX=N or MEMORY=SIZE)",
        "unavailable_error",
        retry=True,
        retry_after=10,
        code="insufficient_memory",
    )


async def admit(pool, m: Model) -> None:
    """Count `m` in the budget (`m.admitted`), evicting idle profiles for it; RouteError 400
    if its share is unknown or cannot fit even alone, 503 if busy profiles hold the budget past
    the start timeout or the machine has not its share free."""
    sh = await pool.share(m)
    need, budget = sh.share_bytes, pool.budget.budget_bytes
    if need is None:
        raise _unknown(m, sh)
    if need > budget:
        raise _never_fits(pool, m, sh, need)
    deadline = pool.ops.clock() + pool.settings.start_timeout
    async with pool.admission_lock:
        while True:
            held = await holders(pool, m)
            used = sum(b for _, b in held)
            # admitted, still loading: their shares are counted but not yet taken from free
            pending = sum(b for o, b in held if o.admitted)
            free = await asyncio.to_thread(pool.ops.free_bytes)
            over = used + need - budget  # > 0: the budget is short by this much
            short = need + pending - free  # > 0: the machine is
            if over <= 0 and short <= 0:
                m.admitted = True
                return
            victims = lru(held, pool)
            if over <= 0 and short > sum(b for _, b in victims):
                # stopping every idle one would not free enough: stop none of them
                raise _no_free_memory(pool, m, need, pending, free, held, victims)
            freed = 0
            for v, b in victims:
                if over - freed <= 0 and short - freed <= 0:
                    break
                why = (
                    f"{m.name} needs {size(need)}, {size(used)} of {size(budget)} in use"
                    if over - freed > 0
                    else f"{m.name} needs {size(need)} free, {size(free)} free on this machine"
                )
                await pool.stop(v, f"evicted, least recently used: {why}", "evicted")
                freed += b
            if victims:
                continue  # read the supervisor and free memory again: what runs, what is free
            if over <= 0:
                raise _no_free_memory(pool, m, need, pending, free, held, victims)
            busy = ", ".join(sorted(o.name for o, _ in held))
            left = deadline - pool.ops.clock()
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
            await pool.wait_change(min(left, 1.0))


async def trim(pool) -> None:
    """More in memory than the budget (supervisord starts every installed service when it
    starts itself; someone ran `macserve start`): stop idle ones, least recently used
    first, until it fits. A start under way makes its own room instead."""
    if pool.admission_lock.locked():
        return
    budget = pool.budget.budget_bytes
    held = [
        (m, (await pool.share(m)).share_bytes or 0)
        for m in list(pool.models.values())
        if m.admitted or m.seen in IN_MEMORY
    ]
    used = sum(b for _, b in held)
    victims = lru(held, pool)
    for v, b in victims:
        if used <= budget:
            break
        await pool.stop(
            v,
            f"over the memory budget ({size(used)} of {size(budget)}), least recently used",
            "over_budget",
        )
        used -= b
