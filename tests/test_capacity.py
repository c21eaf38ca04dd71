"""The default --max-batch, sized on the demo model: as many whole-context caches as the
memory budget holds beside the weights and the prompt cache, INT2 holding more than bf16."""

import mlx.core as mx
import pytest

from macserve.engine.caches import CacheSpec, cache_bytes
from macserve.server.capacity import MAX_AUTO_BATCH, RESERVE, size_batch, weights_bytes

from .conftest import TINY_MODEL

pytestmark = pytest.mark.model


def _budget_for(bundle, per_seq: int, n: float, prompt_cache: int) -> int:
    return int((weights_bytes(bundle.model) + prompt_cache + n * per_seq) / (1 - RESERVE))


def test_the_batch_is_what_the_budget_holds(bundle):
    spec = CacheSpec.for_model(TINY_MODEL, "bf16")
    one = size_batch(bundle, spec, 1024, 2**40, 0)
    assert one.max_batch == MAX_AUTO_BATCH  # a tiny model on a big budget: the cap
    per_seq = one.kv_bytes_per_sequence
    assert per_seq >= 1024 * one.kv_bytes_per_token > 0
    pc = 3 * per_seq
    got = size_batch(bundle, spec, 1024, _budget_for(bundle, per_seq, 5.5, pc), pc)
    assert got.max_batch == 5  # 5.5 sequences' room: 5, the prompt cache's bytes set aside
    assert size_batch(bundle, spec, 1024, _budget_for(bundle, per_seq, 0.2, 0), 0).max_batch == 1
    half = size_batch(bundle, spec, 512, _budget_for(bundle, per_seq, 5.6, 0), 0)
    assert half.max_batch == 11  # half the context each: twice the sequences


def test_int2_fits_more_sequences_than_bf16(bundle):
    bf16 = size_batch(bundle, CacheSpec.for_model(TINY_MODEL, "bf16"), 1024, 2**40, 0)
    int2 = size_batch(bundle, CacheSpec.for_model(TINY_MODEL, "int2"), 1024, 2**40, 0)
    assert int2.kv_bytes_per_token < bf16.kv_bytes_per_token
    budget = _budget_for(bundle, bf16.kv_bytes_per_sequence, 4.5, 0)
    n_bf16 = size_batch(bundle, CacheSpec.for_model(TINY_MODEL, "bf16"), 1024, budget, 0)
    n_int2 = size_batch(bundle, CacheSpec.for_model(TINY_MODEL, "int2"), 1024, budget, 0)
    assert n_bf16.max_batch == 4 and n_int2.max_batch > 4


def _held_after(bundle, spec, prefill: int, decode: int) -> int:
    """A sequence as the server grows it: prefill chunks of 512, then one token a step."""
    caches = bundle.caches(spec)
    for i in range(0, prefill, 512):
        bundle.model(mx.zeros((1, min(512, prefill - i)), dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
    for _ in range(decode):
        bundle.model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
    return sum(cache_bytes(c) for c in caches)


def test_int2_is_sized_by_its_codes_not_its_bf16_window(bundle):
    """The INT2 cache keeps its first sink + recent rows in bf16 and codes after them: a
    sizing from a short prefill would count every token at the bf16 latent's bytes. At 2,048
    tokens (positions past the demo's 1,024 are still computed) the sizing must hold what a
    real sequence's caches allocate, within one growth step, and its steady bytes per token
    must be the codes', a fraction of a bf16 row's."""
    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    cap = size_batch(bundle, spec, 2048, 2**40, 0)
    held = _held_after(bundle, spec, 2048 - 64, 64)
    assert held <= cap.kv_bytes_per_sequence <= held + 256 * cap.kv_bytes_per_token
    window = _held_after(bundle, spec, 256, 0) / 256  # every row bf16
    assert cap.kv_bytes_per_token < window / 2
    # a context the two probes do not fit in is filled whole: the decode step's rows counted
    short = size_batch(bundle, spec, 1024, 2**40, 0)
    assert short.kv_bytes_per_sequence >= _held_after(bundle, spec, 1024 - 32, 32)
