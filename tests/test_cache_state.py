"""Every cache kind restores itself from its stored form (mlx-lm's protocol: `state`,
`from_state`), and through the disk tier's flattening (engine/stored_form.py) and a
safetensors file: the same arrays, the same positions, and the same next decode step.

The smallest shapes that show it: random one-layer MLA models (deepseek_v3, and deepseek_v32
for DSA's latent + indexer key), a prompt long enough that the INT2 cache holds a sink, codes
and a window at once (small windows: 8 sink, 16 recent, 4 slack).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3, deepseek_v32
from mlx_lm.models.cache import make_prompt_cache

from macserve.cache_kinds import KIND_NAMES, CacheKind
from macserve.engine import mla_attention
from macserve.engine.caches import clone, make_caches
from macserve.engine.dsa_indexer import DsaCaches
from macserve.engine.latent_cache import RotatedLatentCache
from macserve.engine.stored_form import restore, to_stored
from macserve.int2_format import LatentQuant

SMALL = LatentQuant(bits=2, sink=8, recent=16, slack=4)
SMALL_BF16 = LatentQuant(bits=None, sink=8, recent=16, slack=4)
PROMPT = 61  # > sink + recent + slack: codes, a window past them, and an odd row count
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=128,
    q_lora_rank=64,
    qk_rope_head_dim=32,
    v_head_dim=32,
    qk_nope_head_dim=32,
    max_position_embeddings=1024,
)


def _model(module, **extra):
    mx.random.seed(5)
    m = module.Model(
        module.ModelArgs(model_type=module.__name__.rsplit(".")[-1], **COMMON, **extra)
    )
    m.set_dtype(mx.float32)
    assert mla_attention.install(m) == 1
    return m


@pytest.fixture(scope="module")
def v3():
    return _model(deepseek_v3)


@pytest.fixture(scope="module")
def v32():
    return _model(deepseek_v32, index_head_dim=64, index_n_heads=2, index_topk=24)


def _rotation(seed=1):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((128, 128)))
    return mx.array(q.astype(np.float32))


# kind -> (model fixture, a fresh cache list for it, the `from_state` extras it needs back)
KINDS = {
    "bf16": ("v3", lambda m: make_prompt_cache(m), {}),
    "int2": ("v3", lambda m: [RotatedLatentCache(SMALL, _rotation())], {"rotation": _rotation()}),
    "int2-unrotated": ("v3", lambda m: [RotatedLatentCache(SMALL)], {}),
    "bf16-latent": ("v3", lambda m: [RotatedLatentCache(SMALL_BF16)], {}),
    "dsa-int2": ("v32", lambda m: make_caches(m, SMALL), {}),
    "dsa-bf16": ("v32", lambda m: make_prompt_cache(m), {}),
}


def _prefilled(request, kind):
    which, fresh, extra = KINDS[kind]
    m = request.getfixturevalue(which)
    caches = fresh(m)
    ids = np.random.default_rng(0).integers(0, 97, size=PROMPT).tolist()
    for s in range(0, PROMPT, 24):  # prefill chunks, then the cache's rows settle
        m(mx.array([ids[s : s + 24]]), cache=caches)
    mx.eval([c.state for c in caches])
    return m, caches, lambda: fresh(m), extra


def _same_state(a, b):
    fa, fb = tree_flatten(a.state), tree_flatten(b.state)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb):
        if isinstance(x, mx.array):
            assert x.shape == y.shape and x.dtype == y.dtype, k
            assert mx.array_equal(x, y).item(), k
        else:
            assert x == y, k


def _next_step(m, caches):
    return np.array(m(mx.array([[7]]), cache=caches)[0, -1])


def _from_state(cache, extra):
    if isinstance(cache, RotatedLatentCache | DsaCaches):
        return type(cache).from_state(cache.state, **extra)
    return type(cache).from_state(cache.state)  # mlx-lm's classes: the state alone


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_from_state_gives_the_same_cache_and_the_same_next_step(request, kind):
    m, caches, _, extra = _prefilled(request, kind)
    back = [_from_state(c, extra) for c in caches]
    for a, b in zip(caches, back):
        assert type(a) is type(b)
        _same_state(a, b)
        if isinstance(a, RotatedLatentCache):  # the same keys and values, dequantized
            for x, y in zip(a.dequantized(), b.dequantized()):
                np.testing.assert_array_equal(np.array(x), np.array(y))
    if kind.startswith("int2"):
        c = caches[0]
        assert c.sink_lat.length and c.codes_lat.length and c.win_lat.length
    assert np.array_equal(_next_step(m, back), _next_step(m, caches))


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_the_stored_form_restores_through_a_file(request, kind, tmp_path):
    m, caches, fresh, _ = _prefilled(request, kind)
    arrays, meta = {}, {}
    for i, c in enumerate(caches):  # as the prompt cache stores them: its clones
        to_stored(clone(c), f"L{i}", arrays, meta)
    f = tmp_path / "stored.safetensors"
    mx.save_safetensors(str(f), arrays, meta)
    arrays, meta = mx.load(str(f), return_metadata=True)
    back = [restore(c, f"L{i}", arrays, meta) for i, c in enumerate(fresh())]
    for a, b in zip(caches, back):
        _same_state(a, b)
    assert np.array_equal(_next_step(m, back), _next_step(m, caches))


@pytest.mark.model
def test_a_stored_form_of_another_kind_or_format_is_refused(request):
    _, caches, _, _ = _prefilled(request, "int2-unrotated")
    arrays, meta = {}, {}
    to_stored(caches[0], "L0", arrays, meta)
    with pytest.raises(ValueError, match="the model's cache is KVCache"):
        restore(make_prompt_cache(request.getfixturevalue("v3"))[0], "L0", arrays, meta)
    with pytest.raises(ValueError, match="stored: int2-g64 .*; this cache: bf16 "):
        restore(RotatedLatentCache(SMALL_BF16), "L0", arrays, meta)
    with pytest.raises(ValueError, match="this cache: int2-g64 sink 8 recent 16 rotated"):
        restore(RotatedLatentCache(SMALL, _rotation()), "L0", arrays, meta)
    with pytest.raises(ValueError, match="needs its rotation back"):
        RotatedLatentCache.from_state(RotatedLatentCache(SMALL, _rotation()).state)


def test_every_kind_is_named_once_with_its_facts():
    assert KIND_NAMES == ("bf16", "int2", "auto")
    assert CacheKind.parse("int2") is CacheKind.INT2 and CacheKind.INT2 == "int2"
    with pytest.raises(ValueError, match="kv must be one of bf16, int2, auto, not 'q4'"):
        CacheKind.parse("q4")
    assert CacheKind.INT2.calibrated and not CacheKind.BF16.calibrated
    assert CacheKind.INT2.latent and not CacheKind.BF16.latent
    assert CacheKind.INT2.bf16_rows(SMALL) == 8 + 16 + 4 and CacheKind.BF16.bf16_rows() == 0
    assert CacheKind.INT2.bytes_per_token(512, 64) == LatentQuant().row_bytes(512, 64)
    assert CacheKind.BF16.bytes_per_token(512, 64) is None
