"""The engine across several hosts (under `mlx.launch`): rank 0 answers HTTP, every rank runs
every generation in lockstep on its share of the layers (mlx-lm's pipeline).

Rank 0's worker hands each job's parameters to the others with `share` (a pickled object
summed over the group, as mlx_lm.server does), and sends `None` as a heartbeat while idle so
the other ranks never block for long and a dead peer surfaces within a second. The other
ranks run `follow`: receive, generate, discard. Cancellation (a client that went away) must
stop every rank at the same token, so the stop callback is a collective too (`synced_stop`).
A planned stop signals every rank at once; the others follow rank 0's drain to its end.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..engine import generate
from ..engine.caches import EngineOptions
from ..engine.model import load
from . import grammar

log = logging.getLogger("macserve.server")

HEARTBEAT = 0.5  # seconds rank 0 waits for a job before telling the others "nothing yet"
FOLLOW_SECS = 10.0  # a rank > 0 outlives rank 0's drain by this much at most (SIGKILL: +20 s)
STOP_EVERY = 8  # tokens between collective stop checks: a cancelled job runs at most this far


class Ranks:
    def __init__(self):
        self.group = mx.distributed.init()
        self.rank, self.size = self.group.rank(), self.group.size()

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def abort(self) -> None:
        """A rank that failed mid-generation leaves the group out of step: exit at once
        (mlx.launch then stops the other ranks and the service's supervisor restarts all)."""
        log.error("rank %d: leaving the group after a failed generation", self.rank)
        time.sleep(0.5)  # let rank 0's error response reach its client
        os._exit(1)

    def share(self, obj):
        """Rank 0's `obj` on every rank (the others pass anything)."""
        if not self.distributed:
            return obj
        if self.rank == 0:
            data = mx.array(bytearray(pickle.dumps(obj)), dtype=mx.uint8)
            mx.eval(mx.distributed.all_sum(data.size, group=self.group))
            mx.eval(mx.distributed.all_sum(data, group=self.group))
            return obj
        size = mx.distributed.all_sum(0, group=self.group).item()
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
        return pickle.loads(bytes(memoryview(data)))

    def synced_stop(self, flag: Callable[[], bool]) -> Callable[[], bool]:
        """A stop callback that answers the same on every rank: rank 0's flag, polled every
        STOP_EVERY calls. Every rank calls it at the same points of the same generation.

        Before the collective, both streams are drained: mlx-lm has already scheduled the next
        step's forward (whose pipeline sends are collectives too), and collectives must be
        issued in the same order on every rank.
        """
        if not self.distributed:
            return flag
        calls = 0

        def stop() -> bool:
            nonlocal calls
            calls += 1
            if calls % STOP_EVERY:
                return False
            mx.synchronize(generation_stream)
            mx.synchronize()
            mine = int(flag()) if self.rank == 0 else 0
            return bool(mx.distributed.all_sum(mine, group=self.group).item())

        return stop


def job_params(job) -> dict:
    """What every rank needs to run the same generation. A job without a seed gets one here:
    sampling must draw the same numbers on every rank, and mask the same tokens."""
    seed = job.seed if job.seed is not None else random.randrange(2**31)
    return {
        "prompt_ids": list(job.prompt_ids),
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "top_p": job.top_p,
        "top_k": job.top_k,
        "constraint": job.constraint,
        "top_logprobs": job.top_logprobs,
        "seed": seed,
        "seeded": job.seeded,
    }


def processors(constraint, top_k: int, vocab) -> list | None:
    """The logits processors of one generation: its grammar's mask, then top-k."""
    out = []
    if constraint is not None:
        out.append(constraint.build(vocab))
    if top_k:
        out.append(grammar.top_k_processor(top_k))
    return out or None


def _follow_stops(rank: int, grace: float) -> threading.Event:
    """A stop signal reaches every rank at once (the supervisor signals mlx.launch's process
    group), but rank 0 drains for up to `grace` and cannot step a generation without the
    others: so here it only arms a deadline, and the rank ends when rank 0 does (`follow`)."""
    stopping = threading.Event()
    limit = grace + FOLLOW_SECS

    def on_signal(*_):
        if stopping.is_set():
            return
        stopping.set()
        log.info(
            "rank %d: stop: following rank 0's drain; ending with it (at most %gs)", rank, limit
        )
        timer = threading.Timer(limit, os._exit, args=(0,))
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return stopping


def follow(
    model: str, options: EngineOptions, ranks: Ranks, split=None, grace: float = 10.0
) -> None:
    """Ranks other than 0: load the model's share, then run whatever rank 0 runs until rank 0
    ends (a stop before the load ends the rank at once: nothing is in flight without it)."""
    log.info("rank %d of %d: loading %s", ranks.rank, ranks.size, model)
    bundle = load(model, split)
    vocab = grammar.Vocab(bundle)
    stopping = _follow_stops(ranks.rank, grace)
    log.info("rank %d: loaded; following rank 0", ranks.rank)
    while True:
        try:
            req = ranks.share(None)
        except Exception as e:
            if not stopping.is_set():
                raise
            log.info("rank %d: stop: rank 0 ended (%s); exiting", ranks.rank, e)
            os._exit(0)
        if req is None:
            continue
        mx.random.seed(req["seed"])
        try:
            for _ in generate.stream(
                bundle,
                req["prompt_ids"],
                req["max_tokens"],
                temperature=req["temperature"],
                top_p=req["top_p"],
                stop=ranks.synced_stop(lambda: False),
                options=options,
                seed=req["seed"],
                seeded=req["seeded"],
                logits_processors=processors(req["constraint"], req["top_k"], vocab),
                top_logprobs=req["top_logprobs"],
            ):
                pass
        except Exception as e:  # noqa: BLE001 - see Ranks.abort
            if stopping.is_set():  # rank 0 cut it at its drain's end and exited
                log.info("rank %d: stop: rank 0 ended (%s); exiting", ranks.rank, e)
                os._exit(0)
            log.error("rank %d: generation failed: %s", ranks.rank, e)
            ranks.abort()
