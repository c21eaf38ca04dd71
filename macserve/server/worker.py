"""The one thread that owns the model: it loads it, then runs queued jobs one at a time.

MLX work stays on this thread (the model, its caches and mlx-lm's generation stream are not
shared), and a FIFO queue.Queue serves requests in arrival order. Each job hands its Steps to
the request's event loop through call_soon_threadsafe; a job whose client went away is
skipped if still queued and stopped at the next token if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..engine import generate
from ..engine.caches import EngineOptions
from ..engine.model import load
from . import ranks
from .ranks import Ranks

log = logging.getLogger("macserve.server")

END = object()  # the last item a job delivers, after its Steps (or an Exception)


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    disconnected: bool = False  # cancelled because the client left (vs. a stop string matched)

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


class Worker(threading.Thread):
    def __init__(
        self, model: str, options: EngineOptions, on_load_failed: Callable[[str], None], split=None
    ):
        super().__init__(name="macserve-engine", daemon=True)
        self.model = model
        self.options = options
        self.split = split
        self.on_load_failed = on_load_failed
        self.bundle = None
        self.error: str | None = None
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.busy = False
        self.served = 0
        self.disconnected = 0  # jobs stopped or skipped because their client went away
        self.failed = 0
        self.ranks = Ranks()  # one rank, or rank 0 of an mlx.launch group

    @property
    def ready(self) -> bool:
        return self.bundle is not None

    def queued(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def run(self) -> None:
        try:
            log.info("loading %s", self.model)
            self.bundle = load(self.model, self.split)
            log.info("model loaded; ready")
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server, with a reason
            self.error = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", self.model, self.error)
            self.on_load_failed(self.error)
            return
        while True:
            try:
                job = self.jobs.get(timeout=ranks.HEARTBEAT if self.ranks.distributed else None)
            except queue.Empty:
                self.ranks.share(None)  # the other ranks wait on this: "nothing yet"
                continue
            if job.cancelled.is_set():
                self.disconnected += job.disconnected
                job.deliver(END)
                continue
            self.busy = True
            try:
                stop = job.cancelled.is_set
                if self.ranks.distributed:
                    params = ranks.job_params(job)
                    job.seed = params["seed"]
                    self.ranks.share(params)
                    stop = self.ranks.synced_stop(stop)
                self._run(job, stop)
            finally:
                self.busy = False
                job.deliver(END)

    def _run(self, job: Job, stop) -> None:
        try:
            if job.seed is not None:
                mx.random.seed(job.seed)
            for step in generate.stream(
                self.bundle,
                job.prompt_ids,
                job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                stop=stop,
                options=self.options,
            ):
                job.deliver(step)
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
