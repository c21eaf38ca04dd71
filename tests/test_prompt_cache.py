"""The server's prompt cache on the demo model, in process: a reused prefix gives the logits a
cold prefill gives (bf16 and INT2 caches, and the MTP layer's rows for drafting), rollbacks
are exact or refused (the INT2 cache's window), prefix entries are folded, and the byte budget
evicts the least recently used."""

import mlx.core as mx
import numpy as np
import pytest

from macserve.engine.caches import CacheSpec, clone
from macserve.engine.mtp_decode import MTPDecoder
from macserve.server.prompt_cache import PromptCache, offset, trimmable

from .conftest import TINY_MODEL
from .fixtures import prompt_ids

pytestmark = pytest.mark.model

TOL = dict(rtol=2e-4, atol=2e-4)  # float32 on the CPU; chunking changes summation order only


def _feed(b, caches, ids) -> np.ndarray:
    """Prefill `ids` and return the last row's logits."""
    out = b.model(mx.array([ids]), cache=caches)
    mx.eval(out, [c.state for c in caches])
    return np.array(out[0, -1])


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_reused_prefix_gives_the_logits_of_a_cold_prefill(bundle, kind):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    # 700 tokens: past the INT2 cache's bf16 windows (64 + 512), so its entry holds codes
    base = prompt_ids(bundle, "HAMLET.\nTo be, or not to be, that is the question. ", 700)
    more = prompt_ids(bundle, "OPHELIA.\nGood my lord, how does your honour? ", 60)
    pc = PromptCache(2**30)
    cs = bundle.caches(spec)
    _feed(bundle, cs, base)
    pc.insert(base, [clone(c) for c in cs])  # the end of a prompt: a clone, cs goes on
    _feed(bundle, cs, more[:5])  # the running sequence writes: the entry must not change
    hit = pc.fetch(base + more)
    assert hit is not None and hit.cached == len(base)
    assert all(offset(c) == len(base) for c in hit.caches)
    warm = _feed(bundle, hit.caches, more)
    cold = _feed(bundle, bundle.caches(spec), base + more)
    np.testing.assert_allclose(warm, cold, **TOL)
    # The very same prompt again: everything but its last token comes from the cache.
    again = pc.fetch(base)
    assert again.cached == len(base) - 1
    np.testing.assert_allclose(
        _feed(bundle, again.caches, base[-1:]), _feed(bundle, bundle.caches(spec), base), **TOL
    )
    assert pc.stats()["hits"] == 2 and pc.stats()["cached_tokens"] == 2 * len(base) - 1


def test_int2_rollbacks_are_exact_or_not_taken(bundle):
    """An INT2 entry rolls back only within its bf16 window: a request that shares less than
    that with the only entry gets nothing, and one within reach gets an exact rollback."""
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    ids = prompt_ids(bundle, "ROMEO.\nBut soft, what light through yonder window breaks? ", 800)
    cs = bundle.caches(spec)
    _feed(bundle, cs, ids)
    assert cs[0].codes_lat.length > 0  # 800 tokens: codes past the 64 + 512 bf16 rows
    reach = trimmable(cs[0])
    assert 0 < reach < 200  # after a prefill chunk the window holds a little more than 512
    pc = PromptCache(2**30)
    pc.insert(ids, cs)
    other = prompt_ids(bundle, "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo? ", 40)
    assert pc.fetch(ids[: len(ids) - 250] + other) is None  # 250 tokens back: out of reach
    keep = len(ids) - reach
    hit = pc.fetch(ids[:keep] + other)
    assert hit is not None and hit.cached == keep
    np.testing.assert_allclose(
        _feed(bundle, hit.caches, other),
        _feed(bundle, bundle.caches(spec), ids[:keep] + other),
        **TOL,
    )
    assert pc.fetch(ids[: keep - 1] + other) is None  # one token further: refused, not drifted


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_drafting_request_reuses_the_mtp_rows_too(bundle, kind):
    """Entries made by a drafting request keep the MTP layer's cache; a hit gives one token
    less than shared (re-fed for its hidden state) and the drafter then computes what it
    computes from a cold prefill: the trunk's last hidden state and the MTP layer's draft."""
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    mtp = bundle.mtp()
    dec = MTPDecoder(bundle.model, mtp, k=1, mtp_cache=bundle.mtp_cache_factory(spec))
    first = prompt_ids(bundle, "VIOLA.\nWhat country, friends, is this? ", 700)
    follow = first + prompt_ids(bundle, "CAPTAIN.\nThis is Illyria, lady. ", 50)
    pc = PromptCache(2**30)
    caches, mcache = bundle.caches(spec), dec.mtp_cache()
    dec.prefill(first, caches, mcache)
    pc.insert(first, [clone(c) for c in caches], clone(mcache))
    assert pc.fetch(follow, mtp=False).cached == len(first)  # a plain request: all of it
    hit = pc.fetch(follow, mtp=True)
    assert hit.cached == len(first) - 1 and offset(hit.mtp) == len(first) - 1

    def draft(caches, mcache, ids):
        h = dec.prefill(ids, caches, mcache)
        t = int(mx.argmax(bundle.model.lm_head(h)[0, -1]).item())
        logits, _ = dec.mtp_forward(h, [t], mcache)
        return np.array(h[0, -1]), np.array(logits[0, -1]), offset(mcache)

    warm = draft(hit.caches, hit.mtp, follow[hit.cached :])
    cold = draft(bundle.caches(spec), dec.mtp_cache(), follow)
    np.testing.assert_allclose(warm[0], cold[0], **TOL)
    np.testing.assert_allclose(warm[1], cold[1], **TOL)
    assert warm[2] == cold[2] == len(follow)


def test_prefix_entries_are_folded_and_the_budget_evicts_the_oldest(bundle):
    spec = CacheSpec.for_model(TINY_MODEL, "bf16")
    a = prompt_ids(bundle, "KING.\nNow is the winter of our discontent. ", 300)
    b = prompt_ids(bundle, "PUCK.\nIf we shadows have offended. ", 300)
    pc = PromptCache(2**30)
    cs = bundle.caches(spec)
    _feed(bundle, cs, a[:200])
    pc.insert(a[:200], [clone(c) for c in cs])
    _feed(bundle, cs, a[200:])
    pc.insert(a, cs)  # covers a[:200] (bf16 rolls back anything): one entry is left
    assert pc.stats()["entries"] == 1
    one = pc.nbytes
    pc.max_bytes = int(1.5 * one)  # room for one entry of this size
    cb = bundle.caches(spec)
    _feed(bundle, cb, b)
    pc.insert(b, cb)
    assert pc.stats()["entries"] == 1 and pc.nbytes <= pc.max_bytes
    assert pc.fetch(a + b[:3]) is None  # a was the least recently used: gone
    assert pc.fetch(b + a[:3]).cached == len(b)
    pc.insert(a, [clone(c) for c in bundle.caches(spec)])  # not a snapshot of `a`: refused
    assert pc.stats()["entries"] == 1
