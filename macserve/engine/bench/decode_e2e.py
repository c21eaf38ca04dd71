"""Decode speed as a user sees it: tokens/s of a whole generation after a real prompt, per
cache, the caches taking turns in the same process (`bench kv`'s end-to-end rows).

Each run is what `macserve generate` does with that cache: a fresh cache, the prompt
prefilled by mlx-lm's `generate_step`, then greedy decode; the rate is the decode alone (first
token to last). Runs are interleaved (every cache once per round), so a busy moment of a
shared machine weighs on all of them; a cache's figure is the median of its rounds, and its
ratio the median of its per-round ratios to the first cache's run in the same round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import mlx.core as mx
from mlx_lm.generate import generate_step

from .. import latent_cache, mla_attention, rows, segment_read
from ..caches import latent_caches
from ..latent_cache import RotatedLatentCache


def decode_rate(model, caches: list, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """Decode tokens/s of one greedy generation of `tokens` tokens after `prompt` by the wall
    clock, and each token's CPU time (the process's, every thread's: MLX's and BLAS's),
    which a shared machine's other work inflates less than the wall clock."""
    t0 = c = None
    steps = []
    for _tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=tokens, prompt_cache=caches, sampler=_greedy
    ):
        now = time.process_time()
        if t0 is None:  # the prompt is prefilled: decode starts here
            t0 = time.perf_counter()
        else:
            steps.append(now - c)
        c = now
    return len(steps) / (time.perf_counter() - t0), steps


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@contextmanager
def previous_read():
    """The decode step as it was before issue 45 (segments merged by online softmax, codes
    dequantized by unfused ops, each step quantizing the row that leaves the window), to
    measure the change in the same process."""
    old = mla_attention.DECODE_READ, rows.FUSED_DEQUANTIZE, latent_cache.STAGE
    mla_attention.DECODE_READ, rows.FUSED_DEQUANTIZE, latent_cache.STAGE = False, False, 0
    try:
        yield
    finally:
        mla_attention.DECODE_READ, rows.FUSED_DEQUANTIZE, latent_cache.STAGE = old


@contextmanager
def query_first():
    """The decode read as it was before its rows-first products and grouped code views
    (`segment_read.ROWS_FIRST_HEADS`, `rows.GROUPED_VIEWS`), to measure them in the same
    process."""
    old = segment_read.ROWS_FIRST_HEADS, rows.GROUPED_VIEWS
    segment_read.ROWS_FIRST_HEADS, rows.GROUPED_VIEWS = 0, False
    try:
        yield
    finally:
        segment_read.ROWS_FIRST_HEADS, rows.GROUPED_VIEWS = old


@contextmanager
def whole_segments():
    """The decode read with every segment read whole, not in pieces (`segment_read.PIECE`),
    to measure what the pieces save in the same process."""
    old = segment_read.PIECE
    segment_read.PIECE = 0
    try:
        yield
    finally:
        segment_read.PIECE = old


def code_rows(caches: list) -> int | None:
    """Code rows the first latent layer holds (None: not a latent cache): > 0 means the
    decode read codes, not only bf16 windows."""
    lat = [c for c in latent_caches(caches) if isinstance(c, RotatedLatentCache)]
    return lat[0].codes_lat.length if lat else None


def run(
    model,
    makers: dict[str, Callable[[], list]],
    prompt: list[int],
    tokens: int = 128,
    rounds: int = 5,
    modes: dict | None = None,
) -> dict:
    """{cache: {tok_s, ratio, cpu_tok_s, cpu_ratio, runs, code_rows}}: `ratio` is against the
    first cache of `makers` (the baseline), the median of the rounds' ratios; cpu_*: by the
    CPU time of a step (the 20th percentile of every step of every round: on a machine other
    work shares, the steady cost of a step). `modes`: a cache's run inside
    that context (e.g. `previous_read`)."""
    modes = modes or {}
    runs: dict[str, list[float]] = {name: [] for name in makers}
    cpu: dict[str, list[float]] = {name: [] for name in makers}
    codes: dict[str, int | None] = {}
    base = next(iter(makers))
    decode_rate(model, makers[base](), prompt, 4)  # warm-up (first-call costs)
    for _ in range(rounds):
        for name, make in makers.items():
            cs = make()
            with modes.get(name, nullcontext)():
                wall, steps = decode_rate(model, cs, prompt, tokens)
            runs[name].append(wall)
            cpu[name] += steps
            codes[name] = code_rows(cs)
            del cs

    def low(v):  # a step's CPU time when nothing else got in its way
        return sorted(v)[len(v) // 5]

    return {
        name: {
            "tok_s": statistics.median(runs[name]),
            "ratio": statistics.median(x / y for x, y in zip(runs[name], runs[base])),
            "cpu_tok_s": 1 / low(cpu[name]),
            "cpu_ratio": low(cpu[base]) / low(cpu[name]),
            "runs": [round(x, 1) for x in runs[name]],
            "code_rows": codes[name],
        }
        for name in makers
    }
