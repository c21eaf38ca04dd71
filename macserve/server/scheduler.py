"""Continuous batching: every sequence in flight advances one token per model call.

The worker thread runs `Scheduler.step` in a loop. One step does, in order:

1. one prefill chunk of the oldest admitted request still prefilling (the rest of its prompt
   after the prompt cache's hit; 2,048 tokens when nothing decodes, BUSY_CHUNK while others
   do, so decodes in flight keep moving; fewer where the chunk's scratch at its position
   would not fit the share's budget, engine/scratch.py). When all but the prompt's last token are in, it
   joins the decode batch: the next decode step feeds that token as one of its rows, samples
   the first token from it, and the caches, now holding the whole prompt, are snapshotted
   into the prompt cache (a whole chunk's end inside the prompt goes to its disk tier:
   PromptCache.keep_on_disk);
2. one token of the drafting sequence, if there is one (below);
3. one decode step of the batch: the model reads one token per sequence, shape (B, 1), each
   layer's caches wrapped in a `SequenceBatch` (projections and MLPs once for all rows, the
   MLA attention row by row through each sequence's own cache), and every row is sampled
   with its own settings: temperature, top_p, a seeded key, logits processors (a grammar's
   `Constraint` keeps per-sequence state: one instance each) and logprobs.

Decoding is pipelined as mlx-lm's `generate_step` is: step n+1 is built from step n's tokens
before they are read, so graph building overlaps the computation. A sequence that ends at
step n has had its last token fed by step n+1 (its caches hold every token it produced);
its caches then go to the prompt cache as its end-of-generation snapshot.

MTP drafting runs one sequence (`MTPDecoder`). A request drafts only if it could (mtp_k > 0,
--mtp on, or auto while its AutoMTP measures that drafting pays or wants a new measurement;
top_p off, no logits processors, no logprobs) and it is alone: nothing else decoding,
prefilling or queued. Each request's stats say whether it drafted and why (`mtp`). It keeps drafting to its end, one token per step, while requests that
arrive meanwhile are prefilled and decoded in the batch beside it without drafting:
drafting steps aside whenever more than one sequence is decoding when a request starts. A
drafting request reuses only prompt-cache entries that hold the MTP layer's cache and leaves
one, at the end of its prompt; the state it ends in (a speculative round in flight) is not
kept.

Stopping is per sequence (a client gone, its deadline, the server's shutdown), checked before
each of its tokens is delivered and between prefill chunks. A failure in one sequence's
sampling or prefill fails that request; a failure of a batched model call fails the
sequences in it. Not thread-safe: the worker thread alone calls it.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from ..engine import scratch
from ..engine.batch import SequenceBatch
from ..engine.caches import EngineOptions, cache_bytes, clone
from ..engine.generate import Step, cut_text
from ..engine.mtp_auto import AutoMTP, drafting_mode, may_draft_with, mtp_status
from ..engine.mtp_auto_store import AutoStore
from ..engine.mtp_decode import MTPDecoder
from .capacity import code_rows
from .prompt_cache import PromptCache, offset

log = logging.getLogger("macserve.server")

PREFILL_CHUNK = 2048  # prompt tokens per model call when nothing else decodes (mlx-lm's step)
BUSY_CHUNK = 256  # ... while other sequences decode: each chunk is followed by a decode step


class _Cancelled(Exception):
    pass


@dataclass
class Seq:
    """One request in flight."""

    job: Any  # worker.Job
    prompt: list[int]
    stop: Callable[[], bool]
    detok: Any
    caches: list | None = None
    cached: int = 0  # prompt tokens the prompt cache gave
    pos: int = 0  # prompt tokens in the caches
    processors: list | None = None
    key: mx.array | None = None  # sampling key (temperature > 0)
    tokens: list[int] = field(default_factory=list)  # prompt + tokens produced
    y: mx.array | None = None  # the next token, sampled, not yet delivered: shape (1,)
    in_prompt: bool = False  # y is the prompt's last token (to feed, not to deliver)
    lp: mx.array | None = None  # its log-probabilities, for logprobs
    n: int = 0  # completion tokens delivered (EOS not counted)
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    gen: Any = None  # drafting: MTPDecoder.generate's iterator
    dec: Any = None  # drafting: the MTPDecoder
    mtp: dict = field(default_factory=dict)  # drafting or not, and why (mtp_auto.mtp_status)

    def stats(self) -> dict:
        now = time.perf_counter()
        prompt_s = (self.t_first or now) - self.t0
        gen_s = now - self.t_first if self.t_first else 0.0
        st = self.dec.stats if self.dec is not None and hasattr(self.dec, "stats") else None
        n_prompt = len(self.prompt)
        return {
            "prompt_tokens": n_prompt,
            "cached_tokens": self.cached,
            "completion_tokens": self.n,
            "prompt_tps": (n_prompt - self.cached) / prompt_s if prompt_s > 0 else 0.0,
            "generation_tps": self.n / gen_s if gen_s > 0 else 0.0,
            "prompt_seconds": prompt_s,
            "generation_seconds": gen_s,
            "draft_tokens": st.draft_tokens if st else 0,
            "accepted_tokens": st.accepted_tokens if st else 0,
            "mtp": self.dec.auto_status() if self.dec and self.dec.auto else self.mtp,
        }


def _top(lp: mx.array, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A token's log-probability and the n most likely tokens, most likely first."""
    lp = lp.reshape(-1)
    if n <= 0:
        return float(lp[token].item()), ()
    ids = mx.argpartition(-lp, n - 1)[:n]
    top = sorted(zip(ids.tolist(), lp[ids].tolist()), key=lambda x: -x[1])
    return float(lp[token].item()), tuple((int(i), float(v)) for i, v in top)


class Scheduler:
    def __init__(
        self,
        bundle,
        options: EngineOptions,
        prompt_cache: PromptCache,
        processors: Callable[[Any], list | None],
        on_done: Callable[[Any, str], None],
        mtp_store: AutoStore | None = None,
    ):
        """`processors(job)`: the job's logits processors (a fresh set per sequence);
        `on_done(job, outcome)`: outcome is served | disconnected | failed; it is called
        after the job's last Step (or its Exception). `mtp_store`: where --mtp auto's
        figures are kept across restarts (beside the prompt cache)."""
        self.bundle = bundle
        self.options = options
        self.pc = prompt_cache
        self.processors = processors
        self.on_done = on_done
        self.eos = bundle.eos_ids
        self.prefilling: deque[Seq] = deque()
        self.active: list[Seq] = []
        self.drafter: Seq | None = None
        self.mode = drafting_mode(bundle, options)  # (on | auto | off, why)
        # Kept for --mtp auto, and for requests that ask for auto on an --mtp on server.
        self.auto = AutoMTP(options.mtp_k, store=mtp_store) if self.mode[0] != "off" else None
        self.widths = scratch.model_widths(bundle.model)  # what a prefill chunk's scratch takes
        self.code_rows = 0  # code rows finished sequences held (/metrics; --kv auto's tests)

    # -- admission ---------------------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.prefilling) + len(self.active) + (self.drafter is not None)

    def idle(self) -> bool:
        return self.in_flight() == 0

    def kv_bytes(self) -> int:
        """Cache bytes the sequences in flight hold, as allocated (shared buffers counted once
        per holder: an upper bound)."""
        seqs = list(self.prefilling) + self.active + ([self.drafter] if self.drafter else [])
        return sum(cache_bytes(c) for s in seqs if s.caches for c in s.caches)

    def _mtp_for(self, job, procs, alone: bool) -> dict:
        """Whether `job` drafts, and why: mtp_auto.mtp_status's answer, or AutoMTP's."""
        mode = self.mode
        if job.mtp is not None and mode[0] != "off" and job.mtp != mode[0]:
            mode = (job.mtp, f"the request asked for mtp {job.mtp}")
        plain_only = bool(procs) or job.top_logprobs is not None
        seeded = job.seeded and mode[0] == "auto"
        draftable = may_draft_with(job.top_p, plain_only, job.temperature, seeded)
        st = mtp_status(mode, draftable)
        if mode[0] == "off" or not draftable:
            return st
        if not (alone and self.idle()):
            return {**st, "drafting": False, "why": "drafting runs alone; others were in flight"}
        if mode[0] == "auto" and self.auto is not None:
            st = self.auto.status()
            if not (self.auto.drafting or self.auto.probe_due()):
                return st
            # A drafting request reuses only cache entries that hold MTP rows: auto does not
            # trade a prefix the plain path would reuse for a draft that may not pay.
            if self.pc.reusable(job.prompt_ids, mtp=True) + 1 < self.pc.reusable(job.prompt_ids):
                why = "auto: the prompt cache holds this prefix without MTP rows"
                return {**st, "drafting": False, "why": why}
            return {**st, "drafting": True}
        return st

    def admit(self, job, stop: Callable[[], bool], alone: bool) -> None:
        """Start `job`. `alone`: nothing else is queued (a lone request may draft)."""
        s = Seq(job, list(job.prompt_ids), stop, self.bundle.tokenizer.detokenizer)
        s.tokens = list(s.prompt)
        try:
            s.processors = self.processors(job)
            if job.temperature > 0:
                s.key = mx.random.key(job.seed)
            s.mtp = self._mtp_for(job, s.processors, alone)
            if s.mtp["drafting"]:
                self._start_drafting(s)
                return
            hit = self.pc.fetch(s.prompt)
            if hit is not None:
                s.caches, s.cached, s.pos = hit.caches, hit.cached, hit.cached
            else:
                s.caches = self.bundle.caches(self.options.cache)
            job.cached_tokens = s.cached
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
            self._fail(s, e)
            return
        self.prefilling.append(s)

    def _start_drafting(self, s: Seq) -> None:
        b, opts = self.bundle, self.options
        s.dec = MTPDecoder(
            b.model,
            b.mtp(),
            k=opts.mtp_k,
            mtp_cache=b.mtp_cache_factory(opts.cache),
            auto=self.auto if s.mtp.get("mode") == "auto" else None,
        )
        hit = self.pc.fetch(s.prompt, mtp=True)
        caches, mtp_cache = (hit.caches, hit.mtp) if hit else (b.caches(opts.cache), None)
        s.cached = s.job.cached_tokens = hit.cached if hit else 0
        s.caches = caches

        def progress(done, total):
            if s.stop():
                raise _Cancelled  # the only way out of a prefill

        def snapshot(caches, mtp_cache):
            self.pc.insert(s.prompt, [clone(c) for c in caches], clone(mtp_cache))

        s.gen = s.dec.generate(
            s.prompt,
            s.job.max_tokens,
            caches=caches,
            temperature=s.job.temperature,
            eos=self.eos,
            seed=s.job.seed,
            progress=progress,
            mtp_cache=mtp_cache,
            cached=s.cached,
            on_prefilled=snapshot,
        )
        self.drafter = s

    # -- one round of work -------------------------------------------------------------------

    def step(self) -> None:
        if self.prefilling:
            self._prefill(self.prefilling[0])
        if self.drafter is not None:
            self._draft(self.drafter)
        if self.active:
            self._decode()

    def _prefill(self, s: Seq) -> None:
        """One chunk of the prompt, all but its last token; that one is fed by the next
        decode step, as a row of the batch. As in mlx-lm's generate_step, only the caches of a
        chunk are evaluated, so its last layer's MLP and the vocabulary head never run over
        the chunk's rows (measured: a 615-token prompt in 0.58 s instead of 0.81 s here)."""
        if s.stop():
            self.prefilling.popleft()
            self._end(s)
            return
        busy = bool(self.active) or self.drafter is not None
        # At most the server's chunk, less where its scratch would not fit the budget at
        # this position (engine/scratch.py); chunks stay powers of two, so 2,048 boundaries
        # are still met for the disk tier.
        most = scratch.chunk(self.widths, s.pos, BUSY_CHUNK if busy else PREFILL_CHUNK)
        end = min(len(s.prompt) - 1, s.pos + most)
        if s.pos < end:
            try:
                self.bundle.model(mx.array([s.prompt[s.pos : end]]), cache=s.caches)
                mx.eval([c.state for c in s.caches])
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.prefilling.popleft()
                self._fail(s, e)
                return
            whole = not busy and (end - s.cached) % PREFILL_CHUNK == 0
            s.pos = end
            if whole and end < len(s.prompt) - 1:  # mid-prompt: the disk tier's boundary
                self.pc.keep_on_disk(s.prompt[:end], [clone(c) for c in s.caches])
        if s.pos == len(s.prompt) - 1:
            self.prefilling.popleft()
            s.y, s.in_prompt = mx.array(s.prompt[-1:]), True
            self.active.append(s)

    def _sample(self, s: Seq, logits: mx.array, tokens: mx.array | None):
        """(token of shape (1,), log-probabilities or None) for one row of logits (1, V)."""
        if s.processors:
            for p in s.processors:
                logits = p(tokens, logits)
        want_lp = s.job.top_logprobs is not None
        lp = (
            logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if want_lp or s.key is not None
            else None
        )
        if s.key is None:
            return mx.argmax(logits, axis=-1), lp
        x = lp
        if 0 < s.job.top_p < 1.0:
            x = apply_top_p(x, s.job.top_p)
        s.key, sub = mx.random.split(s.key)
        return mx.random.categorical(x * (1.0 / s.job.temperature), key=sub), lp

    def _decode(self) -> None:
        act = list(self.active)
        ys = mx.concatenate([s.y for s in act])[:, None]
        if len(act) == 1:
            cache = act[0].caches
        else:
            cache = [SequenceBatch([s.caches[i] for s in act]) for i in range(len(act[0].caches))]
        try:
            logits = self.bundle.model(ys, cache=cache)[:, -1, :]
            greedy = mx.argmax(logits, axis=-1)
        except Exception as e:  # noqa: BLE001 - the batch's model call failed: all of it fails
            for s in act:
                self.active.remove(s)
                self._fail(s, e)
            return
        nxt: list = []
        failed: dict[int, Exception] = {}
        for i, s in enumerate(act):
            try:
                if s.processors or s.key is not None or s.job.top_logprobs is not None:
                    toks = None
                    if (
                        s.processors
                    ):  # every token so far, y included (s.tokens has it if in_prompt)
                        toks = mx.array(s.tokens)
                        toks = toks if s.in_prompt else mx.concatenate([toks, s.y])
                    nxt.append(self._sample(s, logits[i : i + 1], toks))
                else:
                    nxt.append((greedy[i : i + 1], None))
            except Exception as e:  # noqa: BLE001 - this row's request fails
                failed[i] = e
                nxt.append((None, None))
        mx.async_eval([y for y, _ in nxt if y is not None])
        # Step n's tokens were computed while step n+1 was being built.
        now = mx.concatenate([s.y for s in act]).tolist()
        for i, s in enumerate(act):
            if i in failed:
                self.active.remove(s)
                self._fail(s, failed[i])
                continue
            if s.in_prompt:
                # The prompt is in: snapshot it, and its first token comes next step.
                s.in_prompt = False
                self.pc.insert(s.prompt, [clone(c) for c in s.caches])
                if s.stop():
                    self.active.remove(s)
                    self._end(s)
                else:
                    s.y, s.lp = nxt[i]
                continue
            s.tokens.append(now[i])
            done = self._deliver(s, now[i], s.lp)
            if done:
                self.active.remove(s)
                self._end(s)
            else:
                s.y, s.lp = nxt[i]

    def _draft(self, s: Seq) -> None:
        if s.stop():
            self._end_drafting(s)
            return
        try:
            tok = next(s.gen)
        except (_Cancelled, StopIteration):
            self._end_drafting(s)
            return
        except Exception as e:  # noqa: BLE001 - this request fails
            self.drafter = None
            s.gen.close()
            self._fail(s, e)
            return
        s.tokens.append(tok)
        if self._deliver(s, tok, None):
            self._end_drafting(s)

    def _end_drafting(self, s: Seq) -> None:
        self.drafter = None
        s.gen.close()
        s.caches = None  # a speculative round may be in flight: not a snapshot to keep
        self._end(s)

    # -- delivering and ending ---------------------------------------------------------------

    def _deliver(self, s: Seq, token: int, lp) -> bool:
        """Hand one token to the request; True when the sequence is finished."""
        if s.t_first is None:
            s.t_first = time.perf_counter()
        if s.stop():
            return True
        if token in self.eos:
            s.detok.finalize()
            s.job.deliver(Step(token, s.detok.last_segment, "stop", s.stats()))
            return True
        s.n += 1
        s.detok.add_token(token)
        logprob, top = (None, ())
        if lp is not None and s.job.top_logprobs is not None:
            logprob, top = _top(lp, token, s.job.top_logprobs)
        if s.n >= s.job.max_tokens:
            s.job.deliver(Step(token, cut_text(s.detok), "length", s.stats(), logprob, top))
            return True
        s.job.deliver(Step(token, s.detok.last_segment, None, s.stats(), logprob, top))
        return False

    def _end(self, s: Seq) -> None:
        """A sequence that ran to its end or was stopped: its caches become an entry."""
        self.code_rows += code_rows(s.caches or [])
        if s.caches is not None and offset(s.caches[0]) <= len(s.tokens):
            try:
                self.pc.insert(s.tokens[: offset(s.caches[0])], s.caches)
            except Exception:  # noqa: BLE001 - a cache not kept costs speed, never an answer
                log.warning("prompt cache: snapshot not kept\n%s", traceback.format_exc())
        s.caches = None
        if self.auto is not None and s.dec is None:
            self.auto.tokens(s.n)  # plain tokens count towards the next probe
        s.job.stats = s.stats()
        self.on_done(s.job, "disconnected" if s.job.disconnected else "served")

    def fail_all(self, e: Exception) -> None:
        """Every request in flight fails (the step itself raised: their state is unknown)."""
        seqs = list(self.prefilling) + self.active + ([self.drafter] if self.drafter else [])
        self.prefilling.clear()
        self.active.clear()
        self.drafter = None
        for s in seqs:
            if s.gen is not None:
                s.gen.close()
            self._fail(s, e)

    def _fail(self, s: Seq, e: Exception) -> None:
        log.error("generation failed: %s\n%s", e, "".join(traceback.format_exception(e)))
        s.caches = None
        s.job.deliver(e)
        self.on_done(s.job, "failed")
