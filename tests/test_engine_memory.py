"""A prefill chunk's scratch within a `serve --memory` share's reserve, by MLX's allocator.

One layer of the synthetic DeepSeek-V3 (engine/bench/synthetic.py) at the smallest shape
that shows it: 16 of its 128 heads, hidden 1,024, a 4K position. The scratch that grows
with a position (scores, heads x chunk x context) is what the bound is about; at 16 heads
it is an eighth of the full width's, so the reserve here is small enough that today's
2,048-token chunk overruns it (the contrast: the test can fail) while the chunk
engine/scratch.py picks stays inside, for both cache kinds. The full width (128 heads) at
32K and 128K runs in `macserve bench engine --synthetic deepseek-v3 --layers 1 --scratch`.
Also: mlx-lm's plain cache read in blocks of keys (mla_attention.blocked_prefill) gives
mlx-lm's own attention, so bounding it changes no answer."""

import functools
import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache

from macserve.cli import main
from macserve.engine import mla_attention, scratch
from macserve.engine.bench import prefill_scratch
from macserve.engine.bench import setup as bench_setup

pytestmark = pytest.mark.model

HEADS, HIDDEN = 16, 1024
POSITION = 4096
RESERVE = 192 * 2**20  # the share's reserve; a prefill chunk's scratch gets half of it


@pytest.fixture(scope="module")
def v3():
    s = bench_setup.setup_synthetic("deepseek-v3", 1, heads=HEADS, hidden=HIDDEN)
    s.model.set_dtype(mx.float32)  # what the engine computes in on this CPU
    return s


@pytest.fixture
def unbudgeted():
    yield
    scratch.set_budget(None)


@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_a_chunk_at_a_long_position_stays_within_the_reserve(v3, kind, unbudgeted):
    budget = RESERVE // 2
    w = scratch.model_widths(v3.model)
    # Today's chunk (2,048 tokens, 256 MB blocks of scores) overruns the reserve...
    scratch.set_budget(None)
    assert scratch.chunk(w, POSITION, 2048) == 2048
    unbounded = prefill_scratch.chunk_peak(v3, kind, POSITION + 2048, 2048)
    assert unbounded > RESERVE, unbounded
    # ... the chunk picked for the budget at that position stays inside its half.
    scratch.set_budget(budget)
    L = scratch.chunk(w, POSITION, 2048)
    assert L < 2048
    peak = prefill_scratch.chunk_peak(v3, kind, POSITION + L, L)
    assert peak <= budget, (L, peak, budget)
    # and under the modelled bound the chunk was picked by
    assert peak <= scratch.chunk_scratch(w, L, POSITION, scratch.block_bytes(budget))


def _prefill(model, toks, chunks) -> mx.array:
    cs, outs, p = make_prompt_cache(model), [], 0
    for c in chunks:
        outs.append(model(toks[:, p : p + c], cache=cs))
        mx.eval(outs[-1])
        p += c
    return mx.concatenate(outs, axis=1)


def test_blocked_keys_give_mlx_lms_attention(v3, monkeypatch):
    """Chunks on both sides of the absorbed / expanded switch (expanded_from), blocks of
    keys cut inside and across the chunk: the same logits as mlx-lm's own attention."""
    monkeypatch.setattr(mla_attention, "BLOCK_BYTES", HEADS * 100 * 4 * 70)  # ~70-key blocks
    toks = mx.array(np.random.default_rng(0).integers(0, 1024, size=(1, 600)))
    assert 64 < mla_attention.expanded_from(v3.attn) < 400
    chunks = [64, 64, 400, 72]
    ours = _prefill(v3.model, toks, chunks)
    mla_attention.uninstall(v3.model)
    try:
        theirs = _prefill(v3.model, toks, chunks)
    finally:
        mla_attention.install(v3.model, extra=[v3.mtp.self_attn])
    scale = float(mx.abs(theirs).max())
    assert float(mx.abs(ours - theirs).max()) < 1e-4 * scale


def test_bench_engine_scratch_prints_the_chunk_against_the_budget(monkeypatch):
    """`bench engine --scratch` end to end at the narrowed width (the full width is the
    command unpatched: docs/server.md's table)."""
    narrow = functools.partial(bench_setup.setup_synthetic, heads=HEADS, hidden=HIDDEN)
    monkeypatch.setattr(bench_setup, "setup_synthetic", narrow)
    args = ["bench", "engine", "--synthetic", "deepseek-v3", "--layers", "1", "--scratch"]
    args += ["--scratch-contexts", "1024", "--scratch-reserve", "96MB", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["reserve_bytes"] == 96 * 2**20 and d["budget_bytes"] == 48 * 2**20
    row = d["contexts"]["1024"]
    assert row["chunk"] < 2048 and 0 < max(row["bf16"], row["int2"]) <= d["budget_bytes"]
    assert row["unbounded_lower_bound"] > d["reserve_bytes"]
    assert scratch.budget() is None  # the process is left as it was
