"""Several sequences decoded together (SequenceBatch), and caches cloned for reuse: what the
server's prompt cache and batching stand on. The demo model, both caches."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from macserve.engine.batch import SequenceBatch
from macserve.engine.caches import CacheSpec, cache_bytes, clone
from macserve.int2_format import INT2

from .conftest import TINY_MODEL

pytestmark = pytest.mark.model


def _prompt(b, text, n):
    return b.tokenizer.encode(text * 40, add_special_tokens=False)[:n]


def _prefill(b, cs, ids):
    out = b.model(mx.array([ids]), cache=cs)
    mx.eval(out, [c.state for c in cs])
    return int(mx.argmax(out[0, -1]))


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_sequences_decoded_together_equal_each_alone(bundle, kind):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    prompts = [
        _prompt(bundle, "HAMLET.\nTo be, or not to be, that is the question. ", 700),
        _prompt(bundle, "ROMEO.\nBut soft, what light? ", 37),
    ]
    alone = []
    for ids in prompts:
        cs = bundle.caches(spec)
        tok, rows = _prefill(bundle, cs, ids), []
        for _ in range(6):
            logits = bundle.model(mx.array([[tok]]), cache=cs)[0, -1]
            rows.append(np.array(logits))
            tok = int(mx.argmax(logits))
        alone.append(rows)
    per_seq = [bundle.caches(spec) for _ in prompts]
    toks = [_prefill(bundle, cs, ids) for cs, ids in zip(per_seq, prompts)]
    batch = [SequenceBatch([cs[i] for cs in per_seq]) for i in range(len(per_seq[0]))]
    for step in range(6):
        logits = bundle.model(mx.array([[t] for t in toks]), cache=batch)[:, -1]
        for s in range(len(prompts)):
            np.testing.assert_allclose(np.array(logits[s]), alone[s][step], rtol=1e-4, atol=1e-4)
        toks = [int(t) for t in mx.argmax(logits, axis=-1)]
    assert [cs[0].offset for cs in per_seq] == [len(p) + 6 for p in prompts]
    assert len(prompts[0]) > INT2.window_tokens()  # the INT2 cache has codes, not only windows


def _values(caches):
    arrays = [a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)]
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in arrays]


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_clone_continues_independently_and_shares_memory_until_written(bundle, kind):
    spec = CacheSpec.for_model(TINY_MODEL, kind)
    ids = _prompt(bundle, "VIOLA.\nWhat country, friends, is this? ", 360)
    base = bundle.caches(spec)
    _prefill(bundle, base, ids)
    before = _values(base)
    gc.collect()
    held = mx.get_active_memory()
    twin = [clone(c) for c in base]
    mx.eval([c.state for c in twin])
    gc.collect()
    assert mx.get_active_memory() - held < 4096  # no buffer copied yet
    assert sum(cache_bytes(c) for c in twin) == sum(cache_bytes(c) for c in base)
    a = bundle.model(mx.array([[5]]), cache=twin)[0, -1]
    fresh = bundle.caches(spec)
    _prefill(bundle, fresh, ids)
    b = bundle.model(mx.array([[5]]), cache=fresh)[0, -1]
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    after = _values(base)
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    assert base[0].offset == len(ids) and twin[0].offset == len(ids) + 1
