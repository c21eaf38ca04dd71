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

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..caches import latent_caches
from ..latent_cache import RotatedLatentCache


def decode_rate(model, caches: list, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one greedy generation of `tokens` tokens after `prompt`."""
    t0, n = None, 0
    for _tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=tokens, prompt_cache=caches, sampler=_greedy
    ):
        n += 1
        if t0 is None:
            t0 = time.perf_counter()  # the prompt is prefilled: decode starts here
    return (n - 1) / (time.perf_counter() - t0)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


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
) -> dict:
    """{cache: {tok_s, runs, ratio, code_rows}}; `ratio` is against the first cache of
    `makers` (the baseline), the median of the rounds' ratios."""
    runs: dict[str, list[float]] = {name: [] for name in makers}
    codes: dict[str, int | None] = {}
    base = next(iter(makers))
    decode_rate(model, makers[base](), prompt, 4)  # warm-up (first-call costs)
    for _ in range(rounds):
        for name, make in makers.items():
            cs = make()
            runs[name].append(decode_rate(model, cs, prompt, tokens))
            codes[name] = code_rows(cs)
            del cs
    out = {}
    for name, v in runs.items():
        ratios = [a / b for a, b in zip(v, runs[base])]
        out[name] = {
            "tok_s": statistics.median(v),
            "runs": [round(x, 1) for x in v],
            "ratio": statistics.median(ratios),
            "code_rows": codes[name],
        }
    return out
