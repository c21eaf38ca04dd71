"""MTP speculative decoding on the project's own model: exactness and the sampling rule."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from macserve.dev.tiny.data import training_text
from macserve.engine.calibration import caches_for
from macserve.engine.mtp_accept import verify_sampled
from macserve.engine.mtp_decode import MTPDecoder
from macserve.int2_format import LatentQuant

from .conftest import TINY_MODEL

PROMPTS = [
    "HAMLET.\nTo be, or not to be",
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "<|user|>Tell me of the king.<|assistant|>",
    "VIOLA.\nWhat country, friends, is this?\n\nCAPTAIN.\n",
    "PROSPERO.\nOur revels now are ended.",
]


def plain_greedy(b, ids, n, cache):
    return [
        int(t)
        for (t, _), _ in zip(
            generate_step(mx.array(ids), b.model, max_tokens=n, prompt_cache=cache), range(n)
        )
    ]


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_is_token_identical(bundle, k):
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=k, probe_rounds=10**9)
    for text in PROMPTS:
        ids = bundle.tokenizer.encode(text, add_special_tokens=False)
        ref = plain_greedy(bundle, ids, 40, bundle.caches())
        assert list(dec.generate(ids, 40, caches=bundle.caches())) == ref
        st = dec.stats
        assert st.proposed[0] == st.rounds and st.accepted_tokens <= st.draft_tokens
        assert all(p is None or 0 <= p <= 1 for p in st.per_position())


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 3])  # k = 1 runs the pipelined loop, k = 3 the chained one
def test_greedy_with_mtp_is_identical_on_the_int2_cache(bundle, k):
    from macserve.engine.calibration import calibration_windows, collect, fit

    cal = fit(
        collect(bundle.model, calibration_windows(bundle.tokenizer, training_text(2), 1, 256)),
        LatentQuant(bits=2),
    )
    # small windows: the rollback has to cross the bf16/INT2 boundary
    q = LatentQuant(bits=2, sink=4, recent=16, slack=4)
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=k, probe_rounds=10**9)
    for text in PROMPTS[:3]:
        ids = bundle.tokenizer.encode(text, add_special_tokens=False)
        ref = plain_greedy(bundle, ids, 40, caches_for(bundle.model, q, cal, "eigen"))
        out = list(dec.generate(ids, 40, caches=caches_for(bundle.model, q, cal, "eigen")))
        assert out == ref


@pytest.mark.model
def test_drafting_switches_itself_off_below_break_even(bundle):
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, min_accept_per_round=1.01, probe_rounds=4)
    ids = bundle.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    out = list(dec.generate(ids, 30, caches=bundle.caches()))
    assert dec.stats.disabled_after == 4 and dec.stats.rounds == 4
    assert out == plain_greedy(bundle, ids, 30, bundle.caches())


def _tv(counts, p):
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


def test_speculative_sampling_matches_the_target_distribution():
    """Two chained drafts on a 5-token Markov chain: what comes out is distributed as p."""
    rng = np.random.default_rng(0)
    V = 5
    p1 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q1 = np.array([0.1, 0.1, 0.2, 0.3, 0.3])  # a poor drafter
    p2 = rng.dirichlet(np.ones(V), size=V)  # p(x2 | x1)
    q2 = rng.dirichlet(np.ones(V), size=V)
    p3 = rng.dirichlet(np.ones(V), size=V)
    first, second = np.zeros(V), np.zeros((V, V))
    for _ in range(60000):
        d1 = rng.choice(V, p=q1)
        d2 = rng.choice(V, p=q2[d1])
        a, tok = verify_sampled([p1, p2[d1]], [q1, q2[d1]], [d1, d2], p3[d2], rng)
        x1 = d1 if a >= 1 else tok
        first[x1] += 1
        if a >= 1:
            second[x1, d2 if a >= 2 else tok] += 1
    assert _tv(first, p1) < 0.01
    for x1 in range(V):
        if second[x1].sum() > 3000:
            assert _tv(second[x1], p2[x1]) < 0.03
    # the test has power: the drafter's own distribution is far from the target
    assert _tv(q1 * 60000, p1) > 0.3


@pytest.mark.model
def test_sampled_generation_runs_and_counts(bundle):
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=2, probe_rounds=10**9)
    ids = bundle.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    a = list(dec.generate(ids, 30, caches=bundle.caches(), temperature=1.0, seed=7))
    b = list(dec.generate(ids, 30, caches=bundle.caches(), temperature=1.0, seed=7))
    assert a == b and len(a) == 30  # seeded: reproducible
    assert dec.stats.draft_tokens >= dec.stats.rounds


@pytest.mark.model
def test_bad_draft_length_is_refused(bundle):
    with pytest.raises(ValueError, match="1..3"):
        MTPDecoder(bundle.model, bundle.mtp(), k=4)


@pytest.mark.model
def test_mtp_prefill_in_chunks_equals_one_pass_and_heads_only_the_last_row(bundle):
    """The prompt goes through the trunk and the MTP layer chunk by chunk (progress after
    each); the drafts and the output come out as from one pass; the vocabulary head scores
    only the prompt's last row (not every prompt row, twice)."""
    text = "HAMLET.\nTo be, or not to be, that is the question:\n" * 6
    ids = bundle.tokenizer.encode(text, add_special_tokens=False)[:150]
    head = bundle.model.lm_head
    rows = []

    class Counting:
        def __call__(self, h):
            rows.append(h.shape[1])
            return head(h)

    outs, stats = [], []
    bundle.model.lm_head = Counting()
    try:
        for step in (2048, 16):
            dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, probe_rounds=10**9, prefill_step=step)
            seen, rows[:] = [], []
            out = dec.generate(
                ids, 24, caches=bundle.caches(), progress=lambda d, n, s=seen: s.append(d)
            )
            outs.append(list(out))
            stats.append((dec.stats.proposed, dec.stats.accepted))
            assert seen[-1] == len(ids) and len(seen) == -(-len(ids) // step)
            assert rows[0] == 1 and max(rows) <= 2  # prompt: last row; rounds: t and the draft
    finally:
        bundle.model.lm_head = head
    assert outs[0] == outs[1] and stats[0] == stats[1]


@pytest.mark.model
def test_greedy_with_mtp_on_an_int2_mtp_cache(bundle):
    """With --kv int2 the MTP layer's own cache is INT2 too (unrotated): drafts may change,
    the output may not (the trunk verifies every token)."""
    from macserve.engine.caches import CacheSpec
    from macserve.engine.latent_cache import RotatedLatentCache

    spec = CacheSpec.for_model(TINY_MODEL, "int2")
    q = LatentQuant(bits=2, sink=4, recent=16, slack=4)
    dec = MTPDecoder(
        bundle.model, bundle.mtp(), k=1, probe_rounds=10**9, mtp_cache=lambda: RotatedLatentCache(q)
    )
    for text in PROMPTS[:3]:
        ids = bundle.tokenizer.encode(text, add_special_tokens=False)
        ref = plain_greedy(bundle, ids, 40, bundle.caches(spec))
        assert list(dec.generate(ids, 40, caches=bundle.caches(spec))) == ref
    assert isinstance(bundle.mtp_cache_factory(spec)(), RotatedLatentCache)
