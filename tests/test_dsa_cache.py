"""The INT2 latent cache on a DSA model (mlx-lm's deepseek_v32): latent + 8-bit indexer key.

No trained DSA model exists here, so these tests use a small random one: they check that
attention and the indexer's selection on the codes are mlx-lm's own on the dequantized
cache, that selection really happens, and that trim and nbytes hold. Quality is measured on
the trained tiny-mla (a V3 model; the latent path is the same code).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import deepseek_v32
from mlx_lm.models.cache import CacheList

from macserve.engine import mla_attention
from macserve.engine.caches import latent_caches
from macserve.engine.calibration import caches_for
from macserve.engine.dsa_indexer import IndexerKeyCache
from macserve.engine.rows import CODE_STEP
from macserve.int2_format import LatentQuant

pytestmark = pytest.mark.model

SMALL = LatentQuant(bits=2, sink=8, recent=32, slack=4)
TOPK = 24


@pytest.fixture(scope="module")
def model():
    args = deepseek_v32.ModelArgs(
        model_type="deepseek_v32",
        vocab_size=97,
        hidden_size=64,
        index_head_dim=64,
        index_n_heads=4,
        index_topk=TOPK,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        kv_lora_rank=128,
        q_lora_rank=64,
        qk_rope_head_dim=32,
        v_head_dim=32,
        qk_nope_head_dim=32,
        max_position_embeddings=4096,
    )
    mx.random.seed(3)
    m = deepseek_v32.Model(args)
    m.set_dtype(mx.float32)
    assert mla_attention.install(m) == 2
    return m


def ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 97, size=n).tolist()


def run(model, caches, toks, chunk):
    outs = [
        model(mx.array([toks[s : s + chunk]]), cache=caches) for s in range(0, len(toks), chunk)
    ]
    return mx.concatenate(outs, axis=1)[0]


class Replay:
    """Hands mlx-lm's attention the contents of our cache instead of storing anything."""

    def __init__(self, offset, keys, values):
        self.offset, self.keys, self.values = offset, keys, values

    def update_and_fetch(self, k, v):
        return self.keys, self.values


def test_dsa_models_get_a_latent_and_an_indexer_cache(model):
    caches = caches_for(model, SMALL)
    assert all(isinstance(c, CacheList) and isinstance(c[1], IndexerKeyCache) for c in caches)
    assert [c[1].keys_rows.bits for c in caches] == [8, 8]
    bf16 = caches_for(model, LatentQuant(bits=None))
    assert bf16[0][1].keys_rows.bits is None  # the bf16 baseline keeps the indexer in bf16 too


def test_attention_and_selection_on_codes_equal_mlx_lm_on_the_dequantized_cache(model):
    caches = caches_for(model, SMALL)
    run(model, caches, ids(150), 50)
    attn = model.layers[0].self_attn
    x = mx.random.normal((1, 1, 64), key=mx.random.key(7))
    ours = attn(x, None, caches[0])
    lat, idx = caches[0][0], caches[0][1]
    c, k_pe = lat.dequantized()
    stock = CacheList(
        Replay(lat.offset - 1, c, k_pe), Replay(idx.offset - 1, idx.dequantized(), None)
    )
    theirs = type(attn).__bases__[0].__call__(attn, x, None, stock)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-4, atol=2e-5)


def test_the_indexer_really_selects(model):
    """Past index_topk tokens each query sees exactly index_topk of the tokens before it, and
    the output differs from dense attention over all of them."""
    from macserve.engine.dsa_indexer import select_tokens

    caches = caches_for(model, SMALL)
    run(model, caches, ids(120), 60)
    attn = model.layers[1].self_attn
    x = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    _, _, _, _, qr = mla_attention.project(attn, x)
    chosen = np.array(select_tokens(attn.indexer, x, qr, caches[1][1])[0])
    assert chosen.shape == (1, 1, 3, 123)
    assert chosen.sum(-1).ravel().tolist() == [TOPK] * 3
    assert not chosen[0, 0, 0, 121:].any() and not chosen[0, 0, 1, 122]

    sparse = run(model, caches_for(model, SMALL), ids(120), 60)
    attn.indexer.index_topk = 10_000
    try:
        dense = run(model, caches_for(model, SMALL), ids(120), 60)
    finally:
        attn.indexer.index_topk = TOPK
    assert np.allclose(np.array(sparse[:TOPK]), np.array(dense[:TOPK]), atol=1e-5)
    assert not np.allclose(np.array(sparse[TOPK + 8 :]), np.array(dense[TOPK + 8 :]), atol=1e-3)


def test_a_chunk_scores_exactly_as_single_steps(model):
    toks = ids(140, seed=2)
    a = run(model, caches_for(model, SMALL), toks, 70)
    b = run(model, caches_for(model, SMALL), toks, 1)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=1e-3)


def test_trim_restores_exact_state(model):
    toks = ids(130, seed=4)
    a, b = caches_for(model, SMALL), caches_for(model, SMALL)
    run(model, a, toks[:120], 40)
    run(model, b, toks[:120], 40)
    run(model, b, toks[120:123], 3)  # a rejected 3-token draft
    for c in b:
        assert c.trim(3) == 3
    nxt = toks[120:130]
    np.testing.assert_array_equal(np.array(run(model, a, nxt, 1)), np.array(run(model, b, nxt, 1)))


def test_nbytes_adds_the_8bit_indexer_key(model):
    caches = caches_for(model, SMALL)
    run(model, caches, ids(100), 50)
    idx = caches[0][1]
    row = 64 + 4 * 64 // 64  # 8-bit codes + bf16 scale and bias per group
    rows = idx.keys_rows
    assert rows.length == 100 and 100 <= rows.capacity < 100 + CODE_STEP
    assert idx.nbytes == rows.capacity * row  # every row allocated is counted
    # DeepSeek-V3.2 / GLM-5 dims: 228 B latent + 136 B indexer key per token per layer.
    assert SMALL.bytes_per_token(512, 64) + 128 * 8 / 8 + 4 * 128 / 64 == 364


def test_the_cache_works_inside_mlx_lm_generate(model):
    from mlx_lm.generate import generate_step

    caches = caches_for(model, SMALL)
    out = []
    for tok, _ in generate_step(mx.array(ids(60)), model, max_tokens=12, prompt_cache=caches):
        out.append(int(tok))
    mine, cs = [], caches_for(model, SMALL)
    logits = run(model, cs, ids(60), 60)[-1]
    for _ in range(12):
        mine.append(int(mx.argmax(logits)))
        logits = model(mx.array([[mine[-1]]]), cache=cs)[0, -1]
    assert out == mine
    lat = latent_caches(caches)
    assert [c.offset for c in lat] == [c[1].offset for c in caches]


def test_calibration_and_the_speed_bench_run_on_a_dsa_model(model):
    from macserve.engine.bench.kv import decode_speed
    from macserve.engine.calibration import collect, fit

    cal = fit(collect(model, [np.array(ids(200, seed=s)) for s in range(2)], chunk=64), SMALL)
    assert len(cal.rotations["upproj"]) == 2
    caches = caches_for(model, SMALL, cal, "upproj")
    assert caches[1][0].rotation.shape == (128, 128)
    speed = decode_speed(
        model,
        {"bf16": LatentQuant(bits=None), "int2": SMALL},
        cal,
        "upproj",
        contexts=(64,),
        steps=2,
        rounds=1,
    )
    assert speed["int2"][64] > 0 and speed["bf16"][64] > 0


def test_sparse_decode_reads_only_the_selected_rows_and_matches_the_masked_path(model):
    """Decode past index_topk gathers the chosen rows of the INT2 segment (DSA's compute
    saving) and gives the attention the dense, masked path gives."""
    toks = ids(160, seed=6)
    outs = {}
    for sparse in (True, False):
        mla_attention.SPARSE_DECODE = sparse
        try:
            caches = caches_for(model, SMALL)
            run(model, caches, toks[:120], 60)
            outs[sparse] = run(model, caches, toks[120:], 1)
        finally:
            mla_attention.SPARSE_DECODE = True
    np.testing.assert_allclose(np.array(outs[True]), np.array(outs[False]), rtol=1e-4, atol=1e-5)

    from macserve.engine.dsa_indexer import gather_selected, select_tokens

    caches = caches_for(model, SMALL)
    run(model, caches, toks[:120], 60)
    attn = model.layers[0].self_attn
    x = mx.random.normal((1, 1, 64), key=mx.random.key(2))
    _, _, latent, k_pe, qr = mla_attention.project(attn, x)
    lat = caches[0][0]
    lat.append(latent, attn.rope(k_pe, lat.offset))
    chosen, top = select_tokens(attn.indexer, x, qr, caches[0][1])
    blks = mla_attention.blocks(lat, 1, attn.num_heads, 4, chosen)
    cut = gather_selected(lat, blks, top)
    rows = {k: parts[0].shape[2] for k, _, parts, _, _ in cut}
    assert rows["codes"] == TOPK < {k: p[0].shape[2] for k, _, p, _, _ in blks}["codes"]
    assert all(v is True or v.shape[-1] == rows[k] for k, _, _, _, v in cut)
