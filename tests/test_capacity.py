"""The default --max-batch, sized on the demo model: as many whole-context caches as the
memory budget holds beside the weights and the prompt cache, INT2 holding more than bf16."""

from macserve.engine.caches import CacheSpec
from macserve.server.capacity import MAX_AUTO_BATCH, RESERVE, size_batch, weights_bytes

from .conftest import TINY_MODEL


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
