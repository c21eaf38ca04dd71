"""The memory budget: which profiles may be in memory together, and who makes room.

Admission: one at a time. The footprints of the profiles in memory (running, starting or
stopping per the supervisor, or admitted and not yet started) plus this one must fit the
budget (the GPU wired limit, `sizing.budget.machine_budget`); if not, idle profiles are
stopped, least recently used first. A profile with requests in flight, a start under way, or
TTL=never is never evicted: if only such profiles stand in the way, the start waits for them
to finish (up to the start timeout). A profile bigger than the whole budget is refused at once.

Eviction order (`lru`): the idle ones, least recently used first, as many as the room needs.
The reaper's `trim` uses the same order when more runs than the budget holds.
"""

from __future__ import annotations

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
    """The other profiles holding memory now (or about to), with their footprints."""
    sts = await pool.statuses()
    out = []
    for o in list(pool.models.values()):
        if o is exclude:
            continue
        if o.admitted or sts[o.name].state in IN_MEMORY:
            fp = await pool.footprint(o)
            out.append((o, fp.share_bytes or 0))
    return out


async def admit(pool, m: Model) -> None:
    """Count `m` in the budget (`m.admitted`), evicting idle profiles for it; RouteError 400
    if it cannot fit even alone, 503 if the busy ones hold the room past the start timeout."""
    fp = await pool.footprint(m)
    need, budget = fp.share_bytes, pool.budget.budget_bytes
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
            f"{size(fp.kv_total_bytes)} at {fp.ctx or 0:,} tokens, {fp.cache_key}) but the "
            f"memory budget is {size(budget)} ({pool.budget.source}): it cannot fit even "
            f"alone; {fix}",
            "invalid_request_error",
            code="model_too_large",
        )
    deadline = pool.ops.clock() + pool.settings.start_timeout
    async with pool.admission_lock:
        while True:
            held = await holders(pool, m)
            used = sum(b for _, b in held)
            if used + need <= budget:
                m.admitted = True
                return
            victims = lru(held, pool)
            freed = 0
            for v, b in victims:
                if used - freed + need <= budget:
                    break
                await pool.stop(
                    v,
                    f"evicted, least recently used: {m.name} needs {size(need)}, "
                    f"{size(used)} of {size(budget)} in use",
                    "evicted",
                )
                freed += b
            if victims:
                continue  # read the supervisor again: what runs now
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
        (m, (await pool.footprint(m)).share_bytes or 0)
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
