"""`bench engine --scratch`: one prefill chunk's scratch at long positions, by MLX's allocator,
against the reserve of a `serve --memory` share (engine/scratch.py picks the chunk).

For each context n and cache kind ("bf16": mlx-lm's own cache, read in blocks of keys by
mla_attention.blocked_prefill; "int2": the rotated latent cache) the caches are filled to
n - L tokens directly (random latents through their own append: the prefill's compute is
not what is measured), then one chunk of L tokens runs through the model, its output's last
row and its caches evaluated, and

    peak_bytes      mx.get_peak_memory() over that chunk, less what was held just before
                    (weights, caches): the chunk's scratch as the allocator saw it
    modelled_bytes  scratch.chunk_scratch's bound for the same chunk
    budget_bytes    the share's prefill scratch: half its reserve (capacity.SharePlan)

The unbounded figure beside it is not run: mlx-lm's own 2,048-token chunk near the context
materializes heads x 2,048 x n scores (bench.engine.bf16_prefill_predicted, a lower bound)
and the whole cache expanded to per-head keys and values, heads x n x (nope + v).
"""

from __future__ import annotations

import gc

import mlx.core as mx

from .. import scratch
from ..caches import model_dtype
from .setup import Setup, caches, fill

UNBOUNDED_CHUNK = 2048  # mlx-lm's prefill_step_size, the engine's chunk before a share


def _settled() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def chunk_peak(s: Setup, which: str, n: int, L: int) -> int:
    """Bytes the allocator's peak rose over what was held while one chunk of L tokens ran at
    position n - L (its output's last row and the caches evaluated)."""
    mx.eval(s.model.parameters())  # a dtype set lazily (bench.setup.to_dtype) is not scratch
    cs = caches(s, which)
    fill(cs, n - L, s)
    toks = mx.random.randint(0, s.model.args.vocab_size, (1, L), key=mx.random.key(n))
    mx.eval(toks)
    before = _settled()
    mx.reset_peak_memory()
    out = s.model(toks, cache=cs)[:, -1]
    mx.eval(out, [c.state for c in cs])
    peak = mx.get_peak_memory() - before
    del cs, out
    _settled()
    return peak


def unbounded_lower_bound(s: Setup, n: int) -> int:
    """mlx-lm's own chunk of UNBOUNDED_CHUNK tokens at n: its scores and mask-scores
    (heads x chunk x n, twice) and the whole cache expanded to per-head keys and values."""
    a = s.attn
    item = model_dtype(s.model).size
    scores = 2 * a.num_heads * UNBOUNDED_CHUNK * n * item
    return scores + a.num_heads * n * (a.qk_nope_head_dim + a.v_head_dim) * item


def run(s: Setup, contexts, reserve: int, which=("bf16", "int2"), progress=lambda m: None):
    """{context: {cache: {chunk, peak_bytes, modelled_bytes}}, budget, reserve, unbounded}."""
    budget = reserve // 2  # capacity.SharePlan.scratch_bytes: the reserve's half
    w = scratch.model_widths(s.model)
    scratch.set_budget(budget)
    out: dict = {"reserve_bytes": reserve, "budget_bytes": budget, "contexts": {}}
    try:
        for n in contexts:
            L = scratch.chunk(w, n, UNBOUNDED_CHUNK)
            row = {"chunk": L, "unbounded_lower_bound": unbounded_lower_bound(s, n)}
            for kind in which:
                progress(f"scratch: {kind}, a {L}-token chunk at {n:,}")
                row[kind] = chunk_peak(s, kind, n, L)
            row["modelled_bytes"] = scratch.chunk_scratch(w, L, n - L, scratch.block_bytes(budget))
            out["contexts"][str(n)] = row
    finally:
        scratch.set_budget(None)
    return out
