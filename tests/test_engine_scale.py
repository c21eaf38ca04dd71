"""The engine at DeepSeek-V3's cache width (latent 512, rope 64, nope 128, v 128, q_lora
1536; DSA's 64 indexer heads, top-2048): a synthetic model made here with random weights
(engine/bench/synthetic.py), in bf16, one layer.

Quality needs trained weights (the demo model's tests measure it); these check what width
changes: no float32 creeping into a bf16 model, chunked prefill that equals single steps,
memory that is bounded per chunk and held as the layout says, and DSA's selection.

At the smallest shape that shows them: 16 query heads (of 128) and hidden 1024 (of 7168).
A cache row is latent + rope wide whatever the heads and the hidden size, the absorbed /
expanded switch reads only the latent, nope and v dims (mla_attention.expanded_from), DSA
selects with the indexer's own heads, and dtypes do not depend on a width; the one figure
that scales with the heads (a prefill block's scores, heads x chunk x block) is scaled with
them (test_prefill_memory_is_bounded_by_the_chunk). The full width (128 heads, hidden 7168,
contexts to 32K) runs in `macserve bench engine --synthetic deepseek-v3` (its report's
figures and docs/int2-latent-cache.md), the 1-layer form of which test_engine_cli.py runs
narrowed the same way."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from macserve.engine import mla_attention
from macserve.engine.bench import engine as bench
from macserve.engine.bench import setup as bench_setup
from macserve.engine.bench.decode_read import read_per_step
from macserve.engine.caches import make_caches
from macserve.engine.rows import CODE_STEP
from macserve.int2_format import INT2

pytestmark = pytest.mark.model

# Small windows: a short prompt then crosses the sink, the codes and the window.
SMALL = replace(INT2, sink=8, recent=32, slack=4)
# Narrower than DeepSeek-V3 where no property here depends on it (the module's docstring).
HEADS, HIDDEN = 16, 1024


@pytest.fixture(scope="module")
def v3():
    s = bench_setup.setup_synthetic("deepseek-v3", 1, heads=HEADS, hidden=HIDDEN)
    s.quant = SMALL
    return s


def test_a_bf16_decode_step_stays_bf16(v3):
    """The rotation and clip are in the model's dtype: reading the INT2 cache adds no
    conversion to a bf16 decode step (as mlx-lm's own cache adds none), and logits stay bf16."""
    r = bench.upcasts(v3, ctx=200)
    assert r["attention_read"] == {"int2": 0, "bf16": 0}
    assert r["whole_step"]["int2"] == r["whole_step"]["bf16"]
    assert r["logits_dtype"] == {"int2": "bfloat16", "bf16": "bfloat16"}
    # the check can fail: a float32 rotation (what the engine used to keep) shows up
    v3.rotations = [x.astype(mx.float32) for x in v3.rotations]
    try:
        cs = make_caches(v3.model, SMALL, v3.rotations, [None])
        v3.model.set_dtype(mx.bfloat16)
        bench_setup.fill(cs, 200, v3)
        x = mx.zeros((1, 1, v3.model.args.hidden_size), mx.bfloat16)
        assert bench._conversions(v3.attn(x, None, cs[0])) > 0
    finally:
        v3.rotations = [x.astype(mx.bfloat16) for x in v3.rotations]


def _greedy(model, cs, prompt, chunk, n=3):
    for s in range(0, len(prompt), chunk):
        logits = model(mx.array([prompt[s : s + chunk]]), cache=cs)
        mx.eval(logits, [c.state for c in cs])
    rows, out = [logits[0, -1]], []
    for _ in range(n):
        out.append(int(mx.argmax(rows[-1])))
        rows.append(model(mx.array([[out[-1]]]), cache=cs)[0, -1])
    return out, [np.array(r.astype(mx.float32)) for r in rows[:-1]]


def test_greedy_tokens_equal_across_prefill_chunk_sizes_in_bf16(v3):
    """Chunks of 1 (single steps), 64 (the absorbed path) and the whole 180-token prompt (the
    expanded, block-tiled path) give the same greedy tokens, with both caches, in bf16. A
    token may differ only where the reference's top two logits are within bf16 rounding."""
    v3.model.set_dtype(mx.bfloat16)
    prompt = np.random.default_rng(0).integers(0, 1024, size=180).tolist()
    assert len(prompt) >= mla_attention.expanded_from(v3.attn)
    for which in ("int2", "bf16"):
        ref, rows = _greedy(v3.model, bench_setup.caches(v3, which), prompt, 1)
        for chunk in (64, 2048):
            got, _ = _greedy(v3.model, bench_setup.caches(v3, which), prompt, chunk)
            for i, (a, b) in enumerate(zip(got, ref)):
                if a != b:
                    top2 = np.sort(rows[i])[-2:]
                    assert top2[1] - top2[0] < 0.05 * max(1.0, abs(top2[1])), (which, chunk, i)
                    break


def test_prefill_memory_is_bounded_by_the_chunk(v3, monkeypatch):
    """The transient memory of a last prefill chunk does not grow with the context (blocks
    of keys, merged softmaxes), with the INT2 cache and with mlx-lm's plain cache alike (read
    by mla_attention.blocked_prefill; mlx-lm's own attention materialized heads x chunk x
    context scores, so its grew in proportion: test_engine_memory.py shows a chunk that is
    not bounded overrunning a reserve)."""
    # A block of scores is heads x chunk x keys under BLOCK_BYTES: with 16 heads of 128 the
    # budget is cut by the same factor, so a block holds the keys it holds at full width and
    # the 4K context spans the same blocks (at 256 MB for 16 heads, one block would hold it).
    full = mla_attention.BLOCK_BYTES
    monkeypatch.setattr(mla_attention, "BLOCK_BYTES", full * v3.attn.num_heads // 128)
    v3.model.set_dtype(mx.float32)
    chunk = 512
    small, big = (bench.prefill_memory(v3, n, chunk) for n in (1024, 4096))
    for kind in ("int2", "bf16"):
        t_small, t_big = small[kind][1], big[kind][1]
        assert t_big <= 1.25 * t_small, (kind, t_small, t_big)


def test_held_bytes_per_token_follow_the_layout(v3):
    """At DeepSeek-V3's dims (and the shipped windows), after a prefill in 2,048-token chunks:
    codes for tokens past the window (allocated in blocks of CODE_STEP rows), bf16 for the
    64 + 512 (+ 16 slack) window rows."""
    s = bench_setup.Setup(v3.model, v3.mtp, v3.name, v3.rotations, INT2)
    s.model.set_dtype(mx.bfloat16)
    at4k = bench.held_bytes_per_token_per_layer(s, 4096, ("int2", "bf16"))["nbytes"]
    at32k = bench.held_bytes_per_token_per_layer(s, 32768, ("int2", "bf16"))["nbytes"]
    assert at4k["bf16"] == at32k["bf16"] == 1152

    def layout(n):  # per token and layer: 366.0 at 4K, 245.3 at 32K
        codes = -(-(n - INT2.window_tokens()) // CODE_STEP) * CODE_STEP
        return (codes * INT2.row_bytes(512, 64) + INT2.bf16_rows() * 1152) / n

    # the bench rounds to 0.1 B (245.25 prints as 245.2)
    assert at4k["int2"] == pytest.approx(layout(4096), abs=0.1)
    assert at32k["int2"] == pytest.approx(layout(32768), abs=0.1)
    assert at32k["int2"] >= INT2.row_bytes(512, 64)


def test_the_allocator_holds_what_nbytes_says_after_a_chunked_prefill(v3):
    """After a 4K prefill in 2,048-token chunks at DeepSeek-V3's width in bf16, MLX's allocator
    holds what each cache's `nbytes` says (within 5 %, and a few KB of allocator rounding):
    no buffer is a slice keeping a whole chunk alive. It used to: the 64-row bf16 sink was
    the first chunk's rows themselves, 866 B/token/layer held for 308 reported."""
    s = bench_setup.Setup(v3.model, v3.mtp, v3.name, v3.rotations, INT2)
    s.model.set_dtype(mx.bfloat16)
    m = bench.held_memory(s, 4096)
    for which, (held, nbytes, _) in m.items():
        assert abs(held - nbytes) <= max(0.05 * nbytes, 16384), (which, held, nbytes)
    assert m["int2"][2] == 512 * 512 * 2  # the rotation, counted apart
    assert m["int2"][1] < m["bf16_latent"][1] / 3


def test_the_projection_counts_the_rows_a_decode_step_reads(v3):
    """The bytes counted for one decode step come from the segments the kernel is handed: for
    INT2, the codes of every token past the sink and the window, the 64 sink rows, the last
    512 window rows (not the 16 of slack) and the rotation; for mlx-lm's cache its rows up to
    its offset (not its 256-row headroom). Every cache does the same products."""
    s = bench_setup.Setup(v3.model, v3.mtp, v3.name, v3.rotations, INT2)
    s.model.set_dtype(mx.bfloat16)
    n = 4100
    got = {}
    for w in ("int2", "bf16"):
        cs = bench_setup.caches(s, w)
        bench_setup.fill(cs, n, s)
        got[w] = read_per_step(cs, 128)
    bf16_rows, rot = INT2.window_tokens(), 512 * 512 * 2  # sink + recent
    codes = n - bf16_rows
    assert got["int2"]["bytes_once"] == codes * 228 + bf16_rows * 1152 + rot
    assert got["int2"]["bytes_per_product"] == (
        2 * codes * 160 + codes * 68 + bf16_rows * (2 * 1024 + 128) + 2 * rot
    )
    assert got["bf16"]["bytes_once"] == n * 1152
    assert got["int2"]["flops"] == got["bf16"]["flops"] == 2 * 128 * n * (576 + 512)


def _held_after(fill_fn) -> tuple[int, object]:
    before = bench._active()
    cache = fill_fn()
    return bench._active() - before, cache


@pytest.mark.parametrize("chunk", [INT2.bf16_rows(), 512, 2048])
def test_every_buffer_owns_its_rows_when_the_chunk_is_a_slice(chunk):
    """The MTP layer's cache (unrotated) written from slices of one projection output, as
    mlx-lm's kv_a split makes them, in bf16: what stays held is what nbytes counts, whatever
    the chunk (592 tokens: the window is exactly sink + recent + slack rows of the chunk)."""
    from macserve.engine.latent_cache import RotatedLatentCache

    def fill():
        c = RotatedLatentCache(INT2)
        for _ in range(4096 // chunk):
            kv = mx.random.normal((1, 1, chunk, 576)).astype(mx.bfloat16)
            c.append(kv[..., :512], kv[..., 512:])
            c.compact()
            mx.eval(c.state)
        return c

    held, c = _held_after(fill)
    assert abs(held - c.nbytes) <= 16384, (held, c.nbytes)


@pytest.fixture(scope="module")
def v32():
    s = bench_setup.setup_synthetic("deepseek-v3.2", 1, heads=HEADS, hidden=HIDDEN)
    s.quant = SMALL
    s.model.set_dtype(mx.float32)
    return s


def test_dsa_at_real_width_selects_top_k_and_sparse_equals_masked(v32):
    """Past index_topk (2,048) a decode step reads only the selected rows of the codes, and
    gets the attention the dense, masked path gets; below it, the indexer cache is evaluated
    step by step (tied into the output), not left as a growing graph."""
    cs = bench_setup.caches(v32, "int2")
    bench_setup.fill(cs, 2100, v32)
    tok = mx.array([[5]])
    outs = {}
    for sparse in (True, False):
        mla_attention.SPARSE_DECODE = sparse
        try:
            outs[sparse] = v32.model(tok, cache=cs)[0, -1]
            mx.eval(outs[sparse], [c.state for c in cs])
        finally:
            mla_attention.SPARSE_DECODE = True
        assert all(c.trim(1) == 1 for c in cs)
    np.testing.assert_allclose(np.array(outs[True]), np.array(outs[False]), rtol=2e-3, atol=2e-3)
    idx = cs[0][1]
    assert idx.offset == 2100 and idx.keys_rows.length == 2100
    fresh = bench_setup.caches(v32, "int2")
    bench_setup.fill(fresh, 100, v32)
    for _ in range(5):
        mx.eval(v32.model(tok, cache=fresh))  # only the logits, as a decode loop does
    assert fresh[0][1].offset == 105
    # nothing left pending in the caches: no primitive between their arrays and evaluated data
    assert bench._conversions(fresh[0][1].arrays()) == 0
    assert _pending(fresh[0][1].arrays() + fresh[0][0].arrays()) == 0


def test_indexer_key_cache_holds_what_it_reports(v32):
    """The DSA layer's CacheList (latent codes and 8-bit indexer key), filled in 2,048-token
    chunks in bf16: the allocator holds its nbytes."""
    v32.model.set_dtype(mx.bfloat16)
    try:
        m = bench.held_memory(v32, 4096, ("int2",))
    finally:
        v32.model.set_dtype(mx.float32)
    held, nbytes, _ = m["int2"]
    assert abs(held - nbytes) <= max(0.05 * nbytes, 16384), (held, nbytes)


def _pending(arrays) -> int:
    """Primitives still to run to produce `arrays` (0: all evaluated)."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, arrays)
        return len(re.findall(r"shape=rectangle", open(f.name).read()))


def test_mlx_lm_bf16_cache_is_the_baseline_it_claims(v3):
    """mlx-lm's own cache for an MLA model holds the latent and the rope key per token."""
    v3.model.set_dtype(mx.bfloat16)
    cs = make_prompt_cache(v3.model)
    bench_setup.fill(cs, 300, v3)
    assert cs[0].keys.shape[-1] == 512 and cs[0].values.shape[-1] == 64
