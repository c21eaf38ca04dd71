"""The rotated latent cache on the project's own MLA model: calibration, layout, exactness."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from macserve.dev.tiny.data import training_text
from macserve.engine import mla_attention, segment_read
from macserve.engine.calibration import (
    METHODS,
    Calibration,
    caches_for,
    calibration_windows,
    collect,
    fit,
)
from macserve.engine.latent_cache import RotatedLatentCache
from macserve.engine.rows import CODE_STEP
from macserve.int2_format import LatentQuant

INT2 = LatentQuant(bits=2)
# Small windows so a few hundred tokens exercise sink, int and recent segments at once.
SMALL = LatentQuant(bits=2, sink=8, recent=32, slack=4)


@pytest.fixture(scope="module")
def model(bundle):
    b = bundle.require_mla()  # the run's shared demo model (tests/fixtures.py)
    return b.model, b.tokenizer


@pytest.fixture(scope="module")
def calibration(model):
    m, tok = model
    ws = calibration_windows(tok, training_text(2), 1, 256)
    return fit(collect(m, ws), INT2)


def prompt(tok, n):
    text = (
        "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind " * 20
    )
    ids = tok.encode(text, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def run(model, caches, ids, chunk):
    outs = [model(mx.array([ids[s : s + chunk]]), cache=caches) for s in range(0, len(ids), chunk)]
    return mx.concatenate(outs, axis=1)[0]


@pytest.mark.model
def test_calibration_is_deterministic_and_round_trips(model, calibration, tmp_path):
    m, tok = model
    again = fit(collect(m, calibration_windows(tok, training_text(2), 1, 256)), INT2)
    for meth in METHODS:
        for a, b in zip(calibration.rotations[meth], again.rotations[meth]):
            np.testing.assert_array_equal(a, b)
    f = tmp_path / "cal.safetensors"
    calibration.save(f)
    back = Calibration.load(f)
    assert back.meta["layers"] == 4 and back.meta["calibration_tokens"] == 256
    np.testing.assert_allclose(
        back.rotations["eigen"][2], calibration.rotations["eigen"][2], atol=1e-6
    )


def test_bad_calibration_file_is_a_clear_error(tmp_path):
    f = tmp_path / "junk.safetensors"
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a macserve calibration file"):
        Calibration.load(f)


@pytest.mark.model
@pytest.mark.parametrize("method", METHODS)
def test_rotations_are_orthogonal(calibration, method):
    for r in calibration.rotations[method]:
        np.testing.assert_allclose(r.T @ r, np.eye(r.shape[0]), atol=1e-5)


@pytest.mark.model
def test_eigen_rotation_orders_variance_ascending(calibration, model):
    m, tok = model
    st = collect(m, calibration_windows(tok, training_text(2), 1, 256))[1]
    r = calibration.rotations["eigen"][1]
    var = np.einsum("rd,rs,sd->d", r, st.sigma_c, r)
    assert np.all(np.diff(var) >= -1e-6 * var.max())


@pytest.mark.model
def test_quantize_error_is_bounded_by_the_level_step():
    u = mx.random.normal((1, 1, 200, 128), key=mx.random.key(3)) * mx.linspace(0.01, 4, 128)
    c = RotatedLatentCache(replace(INT2, sink=0, recent=0))
    c.append(u, mx.zeros((1, 1, 200, 32)))
    deq, _ = c.dequantized()
    x = np.array(u.astype(mx.bfloat16).astype(mx.float32)).reshape(200, 2, 64)
    step = (x.max(-1) - x.min(-1)) / 3  # 2 bits: 4 levels over the group's range
    diff = np.abs(np.array(deq).reshape(200, 2, 64) - x)
    err = diff.max(-1)
    # MLX's affine quantizer keeps one edge of the group exact, so the worst case is 3/4 of a
    # level step rather than 1/2 (measured 0.747); plus bf16 rounding of scale and bias.
    assert np.all(err <= step * 0.75 * 1.02 + 1e-2)
    assert diff.mean() < 0.35 * step.mean()  # rounding to the nearest level: about step/4


def test_bytes_per_token_formula():
    # DeepSeek-V3: 512 latent dims at 2 bits + 64 rotary dims at 8 bits, bf16 scale and bias.
    assert INT2.bytes_per_token(512, 64) == 228
    assert LatentQuant(bits=None).bytes_per_token(512, 64) == 1152


@pytest.mark.model
def test_nbytes_is_what_mlx_allocates_and_the_layout(model, calibration):
    """The cache holds what it says: its nbytes equals what MLX's allocator gained by filling
    it, and that is the layout's figure (codes for tokens past the window, bf16 for sink +
    recent + slack) plus at most one growth step of code rows."""
    import gc

    m, tok = model
    ids = prompt(tok, 300)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    caches = caches_for(m, SMALL, calibration, "eigen")
    for s in range(0, 300, 50):
        mx.eval(m(mx.array([ids[s : s + 50]]), cache=caches), [c.state for c in caches])
    gc.collect()
    held = mx.get_active_memory() - before
    total = sum(c.nbytes for c in caches)
    # what else stays allocated: the rotations and clips of the calibration (shared, made once)
    rots, clips = calibration.for_method("eigen", mx.float32)
    shared = sum(a.nbytes for a in rots + clips if a is not None)
    # MLX's allocator keeps a few KB per layer beyond the arrays (measured: 4.6 KB after a
    # buffer's first growth, none after the next): a constant, not per token
    assert 0 <= held - total - shared <= 8192 * len(caches), (held, total, shared)
    c = caches[0]
    bf16_row = 2 * (128 + 32)
    code_row = SMALL.row_bytes(128, 32)
    assert c.codes_lat.length == 300 - SMALL.sink - SMALL.recent
    assert c.win_lat.length == SMALL.recent + SMALL.slack  # the chunk's rows were let go
    layout = (300 - SMALL.sink - SMALL.recent) * code_row + (
        SMALL.sink + SMALL.recent + SMALL.slack
    ) * bf16_row
    assert layout <= c.nbytes <= layout + (CODE_STEP - 1) * code_row
    bf = caches_for(m, LatentQuant(bits=None))
    run(m, bf, ids, 50)
    assert bf[0].nbytes == 300 * bf16_row


@pytest.mark.model
def test_absorbed_attention_on_codes_equals_attention_on_dequantized(model, calibration):
    m, tok = model
    ids = prompt(tok, 200)
    q = replace(INT2, sink=0, recent=0)
    fast = run(m, caches_for(m, q, calibration, "eigen"), ids, 40)
    mla_attention.uninstall(m)
    try:
        # mlx-lm's own attention, reading the dequantized latent through update_and_fetch
        slow = run(m, caches_for(m, q, calibration, "eigen"), ids, 40)
    finally:
        mla_attention.install(m)
    np.testing.assert_allclose(np.array(fast), np.array(slow), atol=2e-3, rtol=2e-3)


@pytest.mark.model
def test_a_chunk_scores_exactly_as_single_steps(model, calibration):
    """Speculative verification feeds k+1 tokens at once; it must see what decode would."""
    m, tok = model
    ids = prompt(tok, 120)
    a = caches_for(m, SMALL, calibration, "eigen")
    b = caches_for(m, SMALL, calibration, "eigen")
    run(m, a, ids[:100], 25)
    run(m, b, ids[:100], 25)
    chunk = run(m, a, ids[100:104], 4)
    single = run(m, b, ids[100:104], 1)
    np.testing.assert_allclose(np.array(chunk), np.array(single), atol=1e-4, rtol=1e-4)


def _same_attention_under(model, calibration, monkeypatch, knob, values, n, first, steps, check):
    """Decode `first` prompt tokens and `steps` more, then the rest of `n` in one step, with
    segment_read's `knob` set to each of `values` in turn; `check(caches, before)` says the
    knob's case was really met. The decode read's variants must give the same attention."""
    m, tok = model
    ids = prompt(tok, n)
    logits = []
    for value in values:
        monkeypatch.setattr(segment_read, knob, value)
        caches = caches_for(m, SMALL, calibration, "eigen")
        run(m, caches, ids[:first], steps)
        before = caches[1].codes_lat.length
        logits.append(run(m, caches, ids[first:], 1))
        check(caches, before)
    np.testing.assert_allclose(np.array(logits[0]), np.array(logits[1]), atol=1e-4, rtol=1e-4)


@pytest.mark.model
def test_a_decode_step_read_in_pieces_equals_the_whole_read(model, calibration, monkeypatch):
    """A long segment is read in pieces merged by online softmax (segment_read.PIECE, 2,048
    rows; 16 here so the demo's segments are cut): the same attention as reading it whole."""

    def cut(caches, _before):
        assert caches[0].codes_lat.length > 16  # the codes are cut into pieces

    _same_attention_under(model, calibration, monkeypatch, "PIECE", (16, 0), 124, 120, 40, cut)


@pytest.mark.model
def test_a_decode_step_read_rows_first_equals_the_query_first_read(model, calibration, monkeypatch):
    """On the CPU a few-head decode step scores rows @ q^T and unpacks codes through aliases
    of their buffers made once per write (segment_read.ROWS_FIRST_HEADS, Rows.dense): the
    same attention as q @ rows^T on freshly sliced codes, over 40 steps that write new codes
    (SMALL: one write per 32 steps) and compact the window between reads."""

    def written(caches, before):
        assert caches[1].codes_lat.length > before + 32  # codes written between reads

    heads = (16, 0)
    _same_attention_under(
        model, calibration, monkeypatch, "ROWS_FIRST_HEADS", heads, 140, 100, 50, written
    )


@pytest.mark.model
def test_a_long_chunk_is_causal(model, calibration):
    """A prefill chunk longer than the windows (mlx-lm prefills 2,048 at a time) must not let
    a query see later tokens through their INT2 copies."""
    m, tok = model
    # 200 tokens: five times SMALL's windows (8 + 32), codes on both sides of the change
    ids = prompt(tok, 200)
    changed = list(ids)
    changed[150] = (changed[150] + 1) % 2048
    a = run(m, caches_for(m, SMALL, calibration, "eigen"), ids, 200)
    b = run(m, caches_for(m, SMALL, calibration, "eigen"), changed, 200)
    np.testing.assert_allclose(np.array(a[:150]), np.array(b[:150]), atol=1e-5)
    assert not np.allclose(np.array(a[150:]), np.array(b[150:]), atol=1e-3)


def visible_rows(c):
    """What the next decode query reads, as values: sink, codes (dequantized), window."""
    return [x for _, _, lat, pe in c.segments(1) for x in (*lat, *pe)]


def filled(q, steps):
    """A cache fed random latents in the given chunk sizes (values do not matter for layout)."""
    c = RotatedLatentCache(q)
    key = mx.random.key(0)
    for n in steps:
        key, k1, k2 = mx.random.split(key, 3)
        c.append(mx.random.normal((1, 1, n, 128), key=k1), mx.random.normal((1, 1, n, 32), key=k2))
        if n > 1:
            c.compact()  # what the attention does after a chunk
        mx.eval(c.arrays())
    return c


@pytest.mark.model
@pytest.mark.parametrize("steps", [[1] * 60, [30, 1, 1, 20], [100], [50, 50, 1, 1, 1], [7, 3]])
def test_trim_is_exact_at_every_boundary_or_refuses(steps):
    """Every (length, trim) pair around the sink, the codes and the window: a trim either
    leaves exactly what a cache fed only the remaining tokens holds for the next query, or
    removes only as many tokens as it can restore and says so (its return value)."""
    total = sum(steps)
    for n in range(0, total + 2):
        c = filled(SMALL, steps)
        want = min(n, c.trimmable())
        assert c.trim(n) == want
        assert c.offset == total - want
        # the same tokens, fed once
        key, rows = mx.random.key(0), []
        for k in steps:
            key, k1, k2 = mx.random.split(key, 3)
            rows.append(
                (mx.random.normal((1, 1, k, 128), key=k1), mx.random.normal((1, 1, k, 32), key=k2))
            )
        lat = mx.concatenate([r[0] for r in rows], axis=2)[..., : total - want, :]
        pe = mx.concatenate([r[1] for r in rows], axis=2)[..., : total - want, :]
        ref = RotatedLatentCache(SMALL)
        if total - want:
            ref.append(lat, pe)
            ref.compact()
        got, exp = visible_rows(c), visible_rows(ref)
        assert len(got) == len(exp), (n, want)
        for x, y in zip(got, exp):
            assert mx.array_equal(x, y), (n, want)
        if want < min(n, total):  # refused beyond the rows it holds: never past the window
            assert c.win_start + SMALL.recent == c.offset
        # and it still appends and trims consistently afterwards
        c.append(mx.zeros((1, 1, 2, 128)), mx.zeros((1, 1, 2, 32)))
        assert c.trim(2) == 2


@pytest.mark.model
@pytest.mark.parametrize("trims", [[3, 5, 2], [20, 1], [2] * 6])
def test_codes_made_ahead_stay_exact_through_trims(trims):
    """Decode steps quantize rows ahead (latent_cache.STAGE); after trims (rejected drafts)
    and more steps, the next query reads exactly what a cache fed only the kept tokens in
    single steps reads."""
    key = mx.random.key(3)
    lat, pe = mx.random.normal((1, 1, 400, 128), key=key), mx.random.normal((1, 1, 400, 32))
    c, kept = RotatedLatentCache(SMALL), []
    pos = 0  # next row of lat/pe to feed; drafts use rows past every kept one
    for n in trims:
        for _ in range(45):
            c.append(lat[..., pos : pos + 1, :], pe[..., pos : pos + 1, :])
            kept.append(pos)
            pos += 1
        drafts = list(range(300 + pos, 300 + pos + n))
        for d in drafts:
            c.append(lat[..., d - 250 : d - 249, :] * 2, pe[..., :1, :] * 2)
        mx.eval(c.arrays())
        assert c.trim(n) == n
    ref = RotatedLatentCache(SMALL)
    for p in kept:
        ref.append(lat[..., p : p + 1, :], pe[..., p : p + 1, :])
    mx.eval(ref.arrays())
    assert c.offset == ref.offset and c.codes_lat.length == ref.codes_lat.length > 0
    for x, y in zip(visible_rows(c), visible_rows(ref), strict=True):
        assert mx.array_equal(x, y)


@pytest.mark.model
def test_trim_restores_exact_state(model, calibration):
    m, tok = model
    ids = prompt(tok, 140)
    a = caches_for(m, SMALL, calibration, "eigen")
    b = caches_for(m, SMALL, calibration, "eigen")
    run(m, a, ids[:130], 26)
    run(m, b, ids[:130], 26)
    run(m, b, ids[130:134], 4)  # four drafts, all rejected
    assert all(c.trim(4) == 4 for c in b)
    assert [c.offset for c in a] == [c.offset for c in b] == [130] * 4
    for ca, cb in zip(a, b):
        for x, y in zip(visible_rows(ca), visible_rows(cb), strict=True):
            assert mx.array_equal(x, y)
    np.testing.assert_array_equal(
        np.array(run(m, a, ids[130:131], 1)), np.array(run(m, b, ids[130:131], 1))
    )


@pytest.mark.model
def test_trim_never_goes_past_what_it_can_restore(model, calibration):
    m, tok = model
    caches = caches_for(m, SMALL, calibration, "eigen")
    run(m, caches, prompt(tok, 400), 50)
    c = caches[0]
    assert c.win_lat.length == SMALL.recent + SMALL.slack  # old bf16 rows were let go
    n = c.trim(300)
    # only as far as the bf16 window can be rebuilt from rows still held
    assert n == SMALL.slack and c.offset == 400 - n
    window = [seg for seg in c.segments(1) if seg[0] == "window"][0]
    assert window[1] == c.offset - SMALL.recent and window[2][0].shape[2] == SMALL.recent


@pytest.mark.model
def test_the_cache_works_inside_mlx_lm_generate(model, calibration):
    from mlx_lm import generate

    m, tok = model
    text = "ROMEO.\nBut soft, what light through yonder window breaks?"
    outs = [
        generate(
            m, tok, text, max_tokens=12, prompt_cache=caches_for(m, INT2, calibration, "eigen")
        )
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) > 0


@pytest.mark.model
def test_quantized_cache_stays_close_to_bf16(model, calibration):
    m, tok = model
    ids = prompt(tok, 256)
    ref = run(m, caches_for(m, LatentQuant(bits=None)), ids, 64)
    out = run(m, caches_for(m, SMALL, calibration, "eigen"), ids, 64)
    lr = ref - mx.logsumexp(ref, -1, keepdims=True)
    lq = out - mx.logsumexp(out, -1, keepdims=True)
    kl = float((mx.exp(lr) * (lr - lq)).sum(-1).mean())
    assert kl < 0.05
    plain = caches_for(m, SMALL)  # no calibration needed for the naive baseline
    assert plain[0].rotation is None
    with pytest.raises(ValueError, match="needs a calibration"):
        caches_for(m, SMALL, None, "eigen")
