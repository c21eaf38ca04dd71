"""The default --max-batch, sized on the demo model: as many whole-context caches as the
memory budget holds beside the weights and the prompt cache, INT2 holding more than bf16.
`serve --memory S`: the share's arithmetic (capacity.plan_share: baseline, weights, batch,
prompt cache and reserve inside S, or a refusal with the figures), a prefill chunk's
(engine/scratch.py), and a real server refusing a --max-batch its share cannot hold."""

import os
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import pytest

from macserve.engine import scratch
from macserve.engine.caches import CacheSpec, cache_bytes
from macserve.server.capacity import (
    MAX_AUTO_BATCH,
    RESERVE,
    ShareTooSmall,
    plan_share,
    size_batch,
    weights_bytes,
)

from .conftest import REPO, TINY_MODEL
from .fixtures import free_port


def _budget_for(bundle, per_seq: int, n: float, prompt_cache: int) -> int:
    return int((weights_bytes(bundle.model) + prompt_cache + n * per_seq) / (1 - RESERVE))


@pytest.mark.model
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


@pytest.mark.model
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


@pytest.mark.model
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


MB = 2**20


def _parts(p) -> int:
    return p.baseline_bytes + p.weights_bytes + p.kv_bytes + p.prompt_cache_bytes + p.reserve_bytes


def test_a_share_holds_its_parts_and_the_prompt_cache_shrinks_to_what_is_left():
    share, base, w, seq = 1000 * MB, 100 * MB, 300 * MB, 40 * MB
    room = share - int(share * RESERVE) - base - w
    roomy = plan_share(share, base, w, seq, prompt_cache=seq)  # the bound: one sequence
    assert roomy.prompt_cache_bytes == seq
    assert roomy.max_batch == (room - seq) // seq and _parts(roomy) <= share
    greedy = plan_share(share, base, w, seq, prompt_cache=10 * share)  # more than the share
    assert greedy.prompt_cache_bytes == room - seq  # what one sequence leaves
    assert greedy.max_batch == 1 and _parts(greedy) <= share
    assert "shrunk" in greedy.describe() and "shrunk" not in roomy.describe()
    given = plan_share(share, base, w, seq, prompt_cache=10 * share, max_batch=3)
    assert given.max_batch == 3 and given.prompt_cache_bytes == room - 3 * seq
    assert _parts(given) <= share
    # MLX's own limits: what it may allocate, and the reserve split between scratch and cache
    assert given.mlx_limit_bytes == share - base
    assert given.scratch_bytes + given.buffer_cache_bytes == given.reserve_bytes


def test_a_big_share_stops_at_the_batch_cap():
    p = plan_share(2**40, 100 * MB, 300 * MB, MB, prompt_cache=MB)
    assert p.max_batch == MAX_AUTO_BATCH and _parts(p) <= 2**40


def test_a_share_too_small_is_refused_with_its_figures():
    share, base, w, seq = 1000 * MB, 100 * MB, 300 * MB, 40 * MB
    room = share - int(share * RESERVE) - base - w
    n = room // seq
    assert plan_share(share, base, w, seq, 0, max_batch=n).max_batch == n  # exactly fits
    with pytest.raises(ShareTooSmall) as e:
        plan_share(share, base, w, seq, 0, max_batch=n + 1)
    msg = str(e.value)
    assert "\n" not in msg and f"--max-batch {n + 1}" in msg
    for figure in ("1000.0 MB", "100.0 MB", "300.0 MB", "40.0 MB"):
        assert figure in msg
    with pytest.raises(ShareTooSmall, match="too small for one sequence"):
        plan_share(share, base, share, seq, 0)  # the weights alone fill it


def test_the_prefill_chunk_follows_the_budget_the_heads_and_the_position():
    w = scratch.widths(_v3(), 4, mla=True)
    gb = 2**30
    assert scratch.chunk_for(w, 131072, None, 2048) == 2048  # no share: today's chunk
    for budget in (gb // 4, gb, 8 * gb):
        for pos in (0, 8192, 32768, 131072):
            L = scratch.chunk_for(w, pos, budget, 2048)
            assert L & (L - 1) == 0 and scratch.MIN_CHUNK <= L <= 2048
            block = scratch.block_bytes(budget)
            if L > scratch.MIN_CHUNK:  # a chunk above the least fits its budget
                assert scratch.chunk_scratch(w, L, pos, block) <= budget
            if L < 2048:  # and twice it would not
                assert scratch.chunk_scratch(w, 2 * L, pos, block) > budget
    at = {p: scratch.chunk_for(w, p, gb, 2048) for p in (0, 32768, 131072)}
    assert at[0] >= at[32768] >= at[131072]  # the position only ever shrinks it
    fewer = scratch.widths(_v3(num_attention_heads=16), 4, mla=True)
    assert scratch.chunk_for(fewer, 32768, gb, 2048) > at[32768]  # fewer heads, longer chunks
    plain = scratch.widths(_v3(), 4, mla=False)  # mlx-lm's attention: every key at once
    assert scratch.chunk_for(plain, 32768, gb, 2048) <= at[32768]


def _v3(**changed) -> SimpleNamespace:
    """DeepSeek-V3's widths (its config.json) as mlx-lm's ModelArgs names them."""
    return SimpleNamespace(
        **{
            "num_attention_heads": 128,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "kv_lora_rank": 512,
            **changed,
        }
    )


@pytest.mark.e2e
def test_serve_refuses_a_max_batch_its_memory_cannot_hold(tmp_path):
    """Sized at load (the demo model's weights and caches measured), refused before it
    listens for long: exit non-zero, the figures on one line."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MACSERVE_HOME=str(tmp_path))
    args = ["--memory", "150MB", "--max-batch", "256", "--port", str(free_port())]
    r = subprocess.run(
        [sys.executable, "-m", "macserve", "serve", str(TINY_MODEL), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "--memory 150.0 MB is too small for --max-batch 256" in last and "baseline" in last
