"""The one thread that owns the model: it loads it, then runs every request.

MLX work stays on this thread (the model, its caches and mlx-lm's generation stream are not
shared). Requests wait in a FIFO queue.Queue and are taken in arrival order while fewer than
`max_batch` are in flight; the scheduler (scheduler.py) prefills them one at a time and decodes
them together, with the prompt cache (prompt_cache.py) in front. Each job hands its Steps to
the request's event loop through call_soon_threadsafe; a job whose client went away is
skipped if still queued and stopped at its next token if running. A job also stops at its
deadline (`ended_by = "deadline"`) and, once the server drains for shutdown, at the drain's
end (`"shutdown"`); a job still queued when draining starts is refused (`"shutdown"`).

Under mlx.launch (several ranks) jobs run one at a time, without the prompt cache, through
`engine.generate.stream` in lockstep with the other ranks (ranks.py): batching would have to
be mirrored on every rank step by step, which this path does not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
from mlx_lm.generate import generation_stream, wired_limit

from ..engine import generate
from ..engine.caches import EngineOptions, model_dtype
from ..engine.model import load
from ..engine.mtp_auto import load_note
from ..engine.mtp_auto_store import AutoStore, store_key
from . import grammar, ranks
from .capacity import (
    Capacity,
    SharePlan,
    ShareTooSmall,
    fit_share,
    fitted,
    hold_to,
    loaded_baseline,
    size_batch,
)
from .disk_cache import DiskTier
from .disk_identity import identity, open_soon
from .metrics import Metrics
from .prompt_cache import PromptCache
from .ranks import Ranks
from .scheduler import Scheduler

log = logging.getLogger("macserve.server")

KV_EVERY = 0.5  # seconds between refreshes of the KV bytes in use (/metrics)
DEFAULT_PROMPT_CACHE = 4 * 2**30  # without --prompt-cache-bytes nor --memory
DEFAULT_MAX_BATCH = 8  # without a memory budget to size it from (an embedding caller's Settings)
END = object()  # the last item a job delivers, after its Steps (or an Exception)


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    loop: asyncio.AbstractEventLoop
    deadline: float = float("inf")  # time.monotonic() by which the job must be done
    top_k: int = 0
    constraint: Any = None  # grammar.ConstraintSpec
    top_logprobs: int | None = None  # None: no logprobs
    mtp: str | None = None  # auto | on | off asked by the request; None: the server's --mtp
    seeded: bool = field(init=False)  # the client gave the seed (from `seed`, at creation)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # the worker took it
    cancelled: threading.Event = field(default_factory=threading.Event)
    disconnected: bool = False  # cancelled because the client left (vs. a stop string matched)
    t_started: float | None = None  # time.monotonic() when the worker took it
    cached_tokens: int = 0  # prompt tokens the prompt cache gave (set before `started`)
    ended_by: str | None = None  # "deadline" | "shutdown": the server stopped it
    t_arrived: float = field(default_factory=time.monotonic)  # for TTFT with the queue wait
    stats: dict | None = None  # the finished generation's figures (Seq.stats), for /metrics

    def __post_init__(self) -> None:
        self.seeded = self.seed is not None  # before the worker gives an unseeded job one

    def cancel(self) -> None:
        self.cancelled.set()

    def disconnect(self) -> None:
        self.disconnected = True
        self.cancelled.set()

    def deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()

    def mark_started(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.started.set)
        except RuntimeError:
            self.cancel()


def _per_layer(plan: dict) -> str:
    return ", ".join(f"{r['layer']} {r['format']}/{r['rotation']}" for r in plan["layers"])


class Worker(threading.Thread):
    def __init__(
        self,
        model: str,
        options: EngineOptions,
        on_load_failed: Callable[[str], None],
        split=None,
        max_batch: int | None = 8,
        prompt_cache_bytes: int | None = 0,
        memory_budget: int | None = None,
        ctx: int | None = None,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        memory_share: int | None = None,
        kv_window: int | None = None,
    ):
        """`max_batch` None: sized once the model is loaded (capacity.py) from `memory_budget`
        (bytes for weights and caches) and `ctx` (a request's most tokens; None: the model's).
        `memory_share`: every byte this process may hold (`serve --memory`); then the batch,
        the prompt cache (`prompt_cache_bytes` its bound), a prefill chunk's scratch and MLX's
        own limits are all sized inside it (capacity.plan_share), or the load fails.
        `kv_window`: --kv auto's window, given (a profile's share fitted it): not fitted here."""
        super().__init__(name="macserve-engine", daemon=True)
        self.model = model
        self.options = options
        self.split = split
        # None: not given (the default bound: 4 GB, or one whole-context sequence in a share)
        self.prompt_cache_asked = prompt_cache_bytes is not None
        self.prompt_cache = PromptCache(
            DEFAULT_PROMPT_CACHE if prompt_cache_bytes is None else prompt_cache_bytes
        )
        self.scheduler: Scheduler | None = None
        self.on_load_failed = on_load_failed
        self.bundle = None
        self.error: str | None = None
        self.jobs: queue.Queue[Job] = queue.Queue()
        self._running = False  # the ranks path: a job is running
        self.served = 0
        self.disconnected = 0  # jobs stopped or skipped because their client went away
        self.failed = 0
        self.ranks = Ranks()  # one rank, or rank 0 of an mlx.launch group
        # Sequences decoded together; one under mlx.launch (see the module's docstring). Until
        # an automatic size is measured (at load) nothing is admitted anyway: 1 is a placeholder.
        self.max_batch = 1 if self.ranks.distributed else (max_batch or 1)
        self._size_batch = max_batch is None and not self.ranks.distributed
        self.memory_budget = memory_budget
        self.ctx = ctx
        self.capacity: Capacity | None = None
        self.memory_share = memory_share
        self.kv_window = kv_window
        self.share: SharePlan | None = None  # the share's parts, once sized
        self.baseline_bytes = 0  # the process's resident memory before the weights
        self.disk_dir, self.disk_bytes = disk_dir, disk_bytes
        self.drain_until: float | None = None  # set once: the server is shutting down
        self.job_seconds = 0.0  # moving average of a job's run time (Retry-After estimates)
        self.vocab: grammar.Vocab | None = None  # llguidance's view of the tokenizer
        self.draft_tokens = 0  # MTP drafts proposed / accepted, over every finished request
        self.accepted_tokens = 0
        self._kv_bytes = 0  # the in-flight sequences' cache bytes, refreshed every KV_EVERY s
        self.metrics = Metrics(self)
        self.kv_plan: dict | None = None  # what each layer's cache stores (Bundle.kv_plan)

    def kv_bytes_in_use(self) -> int:
        return self._kv_bytes if self.in_flight() else 0

    @property
    def ready(self) -> bool:
        return self.bundle is not None

    def queued(self) -> int:
        return self.jobs.qsize()

    def in_flight(self) -> int:
        """Requests taken from the queue and not finished yet."""
        sched = self.scheduler
        return sched.in_flight() if sched is not None else int(self._running)

    @property
    def busy(self) -> bool:
        return self.in_flight() > 0

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def drain(self, grace: float) -> None:
        """Shutdown: refuse what is queued, let the running job go on for `grace` seconds."""
        self.drain_until = time.monotonic() + grace
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.ended_by = "shutdown"
            job.mark_started()
            job.deliver(END)

    def _stop_check(self, job: Job):
        def stop() -> bool:
            if job.cancelled.is_set():
                return True
            now = time.monotonic()
            if now > job.deadline:
                job.ended_by = "deadline"
                return True
            if self.drain_until is not None and now > self.drain_until:
                job.ended_by = "shutdown"
                return True
            return False

        return stop

    def run(self) -> None:
        try:
            self.baseline_bytes = psutil.Process().memory_info().rss
            log.info("loading %s", self.model)
            bundle = load(self.model, self.split)
            self.vocab = grammar.Vocab(bundle)
            self._check_mtp(bundle)
            # Read from built caches: a setting that resolves to other than what was meant
            # (bf16 for int2, INT2 where the calibration says INT4) shows here and in /health.
            self.kv_plan = bundle.kv_plan(self.options.cache)
            log.info("kv cache: %s", self.kv_plan["summary"])
            log.info("kv cache per layer: %s", _per_layer(self.kv_plan))
            if self.memory_share is not None and self.ranks.distributed:
                # Every rank must prefill in the same chunks; only rank 0 would know the share.
                log.warning("--memory is not applied under mlx.launch: ranks size alike")
            if self.memory_share is not None and not self.ranks.distributed:
                self._fit_share(bundle)
            elif self._size_batch:
                self._set_max_batch(bundle)
            else:  # nothing to size against: a window given (every rank alike) or none
                self._fitted(self.kv_window, self._ctx(bundle))
            self._open_disk_tier(bundle)
            self.bundle = bundle  # last: `ready` is read from other threads
            log.info("model loaded; ready")
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server, with a reason
            self.error = str(e) if isinstance(e, ShareTooSmall) else f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", self.model, self.error)
            self.on_load_failed(self.error)
            return
        if self.ranks.distributed:
            self._run_ranks()
        else:
            self._run_batched()

    def _open_disk_tier(self, bundle) -> None:
        """The prompt cache's disk tier (disk_cache.py), behind the memory tier: not under
        mlx.launch (no prompt cache there), nor with the memory tier off."""
        pc = self.prompt_cache
        if self.ranks.distributed or not self.disk_bytes or not self.disk_dir or not pc.max_bytes:
            return
        spec = self.options.cache
        fresh_mtp = bundle.mtp_cache_factory(spec) if self.mtp_usable(bundle) else None
        dtype = model_dtype(bundle.model)  # here: the model is this thread's

        def tier():
            ident = identity(bundle, spec, self.disk_dir, dtype)
            fresh = lambda: bundle.caches(spec)  # noqa: E731
            return DiskTier(self.disk_dir, self.disk_bytes, ident, fresh, fresh_mtp)

        open_soon(pc, tier)

    def mtp_usable(self, bundle) -> bool:
        return self.options.drafts and bundle.mtp_problem() is None

    def _check_mtp(self, bundle) -> None:
        note = load_note(bundle, self.options)  # loads the MTP layer when there is one
        if note is not None:
            log.warning("%s", note)

    def _mtp_store(self) -> AutoStore | None:
        """--mtp auto's figures live beside the prompt cache's disk tier, when there is one."""
        if not self.disk_dir or not self.mtp_usable(self.bundle):
            return None
        key = store_key(self.bundle.path, self.options.cache.kind, self.options.mtp_k)
        return AutoStore(self.disk_dir, key)

    def mtp_status(self) -> dict | None:
        """--mtp auto's current decision and figures (None: not auto, or no scheduler)."""
        sched = self.scheduler
        if sched is None or sched.auto is None or sched.mode[0] != "auto":
            return None
        return sched.auto.status()

    def _set_max_batch(self, bundle) -> None:
        if self.memory_budget is None:
            self.max_batch = DEFAULT_MAX_BATCH
            self._fitted(self.kv_window, self._ctx(bundle))
            log.info("--max-batch %d (no memory budget given)", self.max_batch)
            return
        ctx = self._ctx(bundle)
        self.capacity = size_batch(
            bundle,
            self.options.cache,
            ctx,
            self.memory_budget,
            self.prompt_cache.max_bytes,
            self.kv_window,
        )
        self.max_batch = self.capacity.max_batch
        self._fitted(self.capacity.window, ctx)
        log.info("%s", self.capacity.describe())
        log.info(
            "sized against this whole machine's memory budget, not a share of it: "
            "--memory SIZE bounds this server (batch, prompt cache, prefill scratch, MLX)"
        )

    def _fit_share(self, bundle) -> None:
        """Everything inside --memory: the plan (or ShareTooSmall), then MLX's own limits."""
        asked = self.prompt_cache.max_bytes if self.prompt_cache_asked else None
        ctx = self._ctx(bundle)
        max_batch = None if self._size_batch else self.max_batch
        plan = fit_share(
            bundle,
            self.options.cache,
            ctx,
            self.memory_share,
            self.baseline_bytes,
            asked,
            max_batch,
            loaded_baseline(bundle),
            self.kv_window,
        )
        self.share, self.max_batch = plan, plan.max_batch
        self.prompt_cache.max_bytes = plan.prompt_cache_bytes
        self._fitted(plan.window, ctx)
        hold_to(plan)
        log.info("%s", plan.describe())

    def _ctx(self, bundle) -> int:
        return self.ctx or bundle.max_context or 4096

    def _fitted(self, window: int | None, ctx: int) -> None:
        """--kv auto: every cache from here on (and the disk tier's identity) at its window."""
        self.options = replace(self.options, cache=fitted(self.options.cache, window, ctx))
        if window is not None and self.kv_plan is not None:
            self.kv_plan["window"] = window  # /health says what auto does

    # -- one process: continuous batching -----------------------------------------------------

    def _run_batched(self) -> None:
        sched = Scheduler(
            self.bundle,
            self.options,
            self.prompt_cache,
            lambda job: ranks.processors(job.constraint, job.top_k, self.vocab),
            self._done,
            self._mtp_store(),
        )
        self.scheduler = sched
        kv_at = 0.0
        # With a share, the wired limit is the share's (_fit_share), not mlx-lm's whole-GPU one.
        wired = (
            contextlib.nullcontext()
            if self.share
            else wired_limit(self.bundle.model, [generation_stream])
        )
        with wired, mx.stream(generation_stream):
            while True:
                while sched.in_flight() < self.max_batch:
                    try:
                        job = self.jobs.get(block=sched.idle())  # waits only when idle
                    except queue.Empty:
                        break
                    self._admit(sched, job)
                try:
                    sched.step()
                except Exception as e:  # noqa: BLE001 - a bug must not stop the thread for good
                    sched.fail_all(e)
                if sched.idle():  # the batch drained: MLX's buffer cache goes back to the system
                    mx.clear_cache()
                now = time.monotonic()
                if now - kv_at > KV_EVERY:  # summing every layer each step would cost a step
                    self._kv_bytes, kv_at = sched.kv_bytes(), now

    def _admit(self, sched: Scheduler, job: Job) -> None:
        if job.cancelled.is_set():
            self.disconnected += job.disconnected
            job.mark_started()
            job.deliver(END)
            return
        if self.drain_until is not None:
            job.ended_by = "shutdown"
            job.mark_started()
            job.deliver(END)
            return
        if job.seed is None:
            job.seed = random.randrange(2**31)  # every job samples from its own seed
        job.t_started = time.monotonic()
        sched.admit(job, self._stop_check(job), alone=self.jobs.empty())  # sets cached_tokens
        job.mark_started()

    def _done(self, job: Job, outcome: str) -> None:
        if outcome == "failed":
            self.failed += 1
        elif outcome == "disconnected":
            self.disconnected += 1
        else:
            self.served += 1
        took = time.monotonic() - (job.t_started or time.monotonic())
        self.job_seconds = 0.8 * self.job_seconds + 0.2 * took
        self._record(job)
        job.deliver(END)

    def _record(self, job: Job) -> None:
        st = job.stats
        if st:
            self.draft_tokens += st.get("draft_tokens", 0)
            self.accepted_tokens += st.get("accepted_tokens", 0)
        self.metrics.job_done((job.t_started or job.t_arrived) - job.t_arrived, st)

    # -- several ranks: one job at a time, in lockstep -----------------------------------------

    def _run_ranks(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=ranks.HEARTBEAT if self.ranks.distributed else None)
            except queue.Empty:
                self.ranks.share(None)  # the other ranks wait on this: "nothing yet"
                continue
            job.mark_started()
            if job.cancelled.is_set():
                self.disconnected += job.disconnected
                job.deliver(END)
                continue
            if self.drain_until is not None:
                job.ended_by = "shutdown"
                job.deliver(END)
                continue
            self._running = True
            t0 = time.monotonic()
            try:
                if job.seed is None:
                    # Every job samples from its own seed (MTP drafting samples with numpy's
                    # generator, which would otherwise start from the same seed every time).
                    job.seed = random.randrange(2**31)
                stop = self._stop_check(job)
                if self.ranks.distributed:
                    self.ranks.share(ranks.job_params(job))
                    stop = self.ranks.synced_stop(stop)
                self._run(job, stop)
            finally:
                self._running = False
                self.job_seconds = 0.8 * self.job_seconds + 0.2 * (time.monotonic() - t0)
                job.deliver(END)

    def _run(self, job: Job, stop) -> None:
        try:
            mx.random.seed(job.seed)
            for step in generate.stream(
                self.bundle,
                job.prompt_ids,
                job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                stop=stop,
                options=self.options,
                seed=job.seed,
                seeded=job.seeded,
                logits_processors=ranks.processors(job.constraint, job.top_k, self.vocab),
                top_logprobs=job.top_logprobs,
            ):
                job.stats = step.stats
                job.deliver(step)
            self._record(job)
            if job.disconnected:
                self.disconnected += 1
            else:
                self.served += 1
        except Exception as e:  # noqa: BLE001 - a bad request must not take the thread down
            self.failed += 1
            log.error("generation failed: %s\n%s", e, traceback.format_exc())
            job.deliver(e)
            if self.ranks.distributed:
                # The other ranks may be mid-step, waiting on collectives this rank will never
                # issue: end the group so mlx.launch exits and the supervisor restarts it.
                self.ranks.abort()
