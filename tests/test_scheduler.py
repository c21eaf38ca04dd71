"""The worker's scheduler on the demo model, in process: sequences decoded together give the
greedy tokens each gives alone (bf16 and INT2 caches, sequences joining and leaving mid-way),
a lone drafting sequence runs beside the batch that forms after it, and a stopped sequence
leaves the others untouched. The scheduler is driven step by step; the jobs only record what
they are handed (the HTTP side has its own tests)."""

from dataclasses import dataclass, field

import pytest

from macserve.engine.caches import CacheSpec, EngineOptions
from macserve.engine.generate import Step
from macserve.server.prompt_cache import PromptCache
from macserve.server.scheduler import Scheduler

from .conftest import TINY_MODEL

pytestmark = pytest.mark.model


@dataclass
class Job:
    """What the scheduler reads of the worker's Job, and a record of what it delivers."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    constraint: object = None
    top_logprobs: int | None = None
    mtp: str | None = None
    seeded: bool = False
    cached_tokens: int = 0
    disconnected: bool = False
    ended_by: str | None = None
    steps: list = field(default_factory=list)
    outcome: str | None = None
    stopped: bool = False

    def deliver(self, item):
        assert self.outcome is None, "nothing may follow the end"
        if isinstance(item, Exception):
            raise item
        self.steps.append(item)

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.steps if isinstance(s, Step)]


def _scheduler(bundle, options, cache_bytes=0):
    def done(job, outcome):
        job.outcome = outcome

    return Scheduler(bundle, options, PromptCache(cache_bytes), lambda job: None, done)


def _run(sched, jobs, joins=None, alone=True):
    """Admit jobs[0] (and the rest at once, or at the step numbers in `joins`), step until
    every job has ended."""
    joins = joins or {}
    pending = {i: joins.get(i, 0) for i in range(len(jobs))}
    step = 0
    while True:
        now = [i for i, at in pending.items() if at <= step]
        for i in now:
            del pending[i]
            # `alone`: nothing else arrives with it (the worker: the queue is empty).
            sched.admit(jobs[i], lambda j=jobs[i]: j.stopped, alone=alone and len(now) == 1)
        if not pending and all(j.outcome for j in jobs):
            return
        sched.step()
        step += 1
        assert step < 10_000


def _prompts(b):
    texts = [
        # past the INT2 cache's bf16 rows (sink 64 + recent 512): it holds codes
        ("HAMLET.\nTo be, or not to be, that is the question. ", 700),
        ("ROMEO.\nBut soft, what light? ", 37),
        ("VIOLA.\nWhat country, friends, is this? ", 120),
        ("PUCK.\nIf we shadows have offended, ", 9),
    ]
    return [b.tokenizer.encode(t * 50, add_special_tokens=False)[:n] for t, n in texts]


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_batched_sequences_equal_each_alone(bundle, kind):
    options = EngineOptions(CacheSpec.for_model(TINY_MODEL, kind))
    prompts = _prompts(bundle)
    lengths = [12, 20, 7, 16]  # they end at different steps: the batch shrinks as it goes
    alone = []
    for p, n in zip(prompts, lengths):
        j = Job(p, n)
        _run(_scheduler(bundle, options), [j])
        alone.append(j.tokens)
        assert j.outcome == "served" and j.steps[-1].finish_reason in ("stop", "length")
    jobs = [Job(p, n) for p, n in zip(prompts, lengths)]
    # Two start together, one joins after 3 steps, one after 9 (prefilled while others decode).
    _run(_scheduler(bundle, options), jobs, joins={2: 3, 3: 9}, alone=False)
    assert [j.tokens for j in jobs] == alone
    assert all(j.outcome == "served" for j in jobs)
    assert [j.steps[-1].stats["completion_tokens"] for j in jobs] == [
        len([t for t in toks if t not in bundle.eos_ids]) for toks in alone
    ]


def test_a_lone_request_drafts_and_the_batch_forms_beside_it(bundle):
    """mtp_k 1: the first request is alone and drafts; two that arrive while it runs are
    decoded together beside it, without drafting. Greedy drafting is token-identical to
    plain decoding, so every answer equals its plain answer alone."""
    prompts = _prompts(bundle)[:3]
    plain = EngineOptions(CacheSpec.for_model(TINY_MODEL, "bf16"))
    alone = []
    for p in prompts:
        j = Job(p, 24)
        _run(_scheduler(bundle, plain), [j])
        alone.append(j.tokens)
    sched = _scheduler(bundle, EngineOptions(plain.cache, mtp_k=1), cache_bytes=2**30)
    jobs = [Job(p, 24) for p in prompts]
    _run(sched, jobs, joins={1: 2, 2: 2})
    assert [j.tokens for j in jobs] == alone
    drafts = [j.steps[-1].stats["draft_tokens"] for j in jobs]
    assert drafts[0] > 0 and drafts[1:] == [0, 0]
    # The drafting request left its prompt with the MTP layer's cache: asking again reuses it.
    again = Job(prompts[0], 24)
    _run(sched, [again])
    assert again.cached_tokens == len(prompts[0]) - 2  # all but the last, less one re-fed
    assert again.tokens == alone[0] and again.steps[-1].stats["draft_tokens"] > 0


def test_a_stopped_sequence_leaves_and_the_others_go_on(bundle):
    options = EngineOptions(CacheSpec.for_model(TINY_MODEL, "int2"))
    prompts = _prompts(bundle)[:3]
    alone = []
    for p in prompts:
        j = Job(p, 16)
        _run(_scheduler(bundle, options), [j])
        alone.append(j.tokens)
    jobs = [Job(p, 16) for p in prompts]
    sched = _scheduler(bundle, options, cache_bytes=2**30)
    for j in jobs:
        sched.admit(j, lambda j=j: j.stopped, alone=False)
    while len(jobs[1].steps) < 3:
        sched.step()
    jobs[1].stopped = jobs[1].disconnected = True  # its client went away
    while not all(j.outcome for j in jobs):
        sched.step()
    assert jobs[1].outcome == "disconnected" and 3 <= len(jobs[1].steps) < 16
    assert jobs[1].tokens == alone[1][: len(jobs[1].tokens)]
    assert [jobs[0].tokens, jobs[2].tokens] == [alone[0], alone[2]]
    # Its caches were kept: the tokens it had when it left are a prefix for the next request.
    follow = Job(prompts[1] + jobs[1].tokens, 4)
    _run(sched, [follow])
    assert follow.cached_tokens == len(prompts[1]) + len(jobs[1].tokens) - 1


def test_auto_measures_on_a_cold_prompt_but_keeps_a_cached_prefix_plain(bundle):
    """--mtp auto wants a first measurement, yet a prompt whose prefix the cache holds without
    the MTP layer's rows decodes plainly (a drafting request would prefill it again); a cold
    prompt then drafts to measure. Greedy tokens are the plain ones either way."""
    prompts = _prompts(bundle)
    plain = EngineOptions(CacheSpec.for_model(TINY_MODEL, "bf16"))
    alone = []
    for p in (prompts[0] + prompts[1][:5], prompts[2]):
        j = Job(p, 30)
        _run(_scheduler(bundle, plain), [j])
        alone.append(j.tokens)
    sched = _scheduler(bundle, EngineOptions(plain.cache, mtp_k=1, mtp="auto"), 2**30)
    first = Job(prompts[0], 1, mtp="off")  # leaves prompts[0] in the cache, no MTP rows
    _run(sched, [first])
    assert first.steps[-1].stats["mtp"]["why"] == "the request asked for mtp off"
    warm = Job(prompts[0] + prompts[1][:5], 30)
    _run(sched, [warm])
    st = warm.steps[-1].stats
    assert warm.tokens == alone[0] and warm.cached_tokens == len(prompts[0])
    assert st["draft_tokens"] == 0 and st["mtp"]["drafting"] is False
    assert st["mtp"]["why"] == "auto: the prompt cache holds this prefix without MTP rows"
    cold = Job(prompts[2], 30)
    _run(sched, [cold])
    assert cold.tokens == alone[1] and cold.steps[-1].stats["draft_tokens"] > 0
    assert sched.auto.pairs and cold.steps[-1].stats["mtp"]["mode"] == "auto"  # it measured
