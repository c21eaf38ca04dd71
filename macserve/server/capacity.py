"""How many sequences the server decodes together when `--max-batch` is not given: as many
whole-context KV caches as fit in the memory budget beside the weights and the prompt cache.

A fixed 8 left a large Mac idle under load (32 clients: 330-554 tok/s at 8 against 831 at 32,
measured on a DeepSeek-class model) and, on a small Mac, could promise caches it cannot hold.
So the footprint is measured on the loaded model, with the cache kind the server runs: one
sequence's caches after a prefill, then after PROBE_TOKENS more; the growth between the two is
the steady bytes per token, and a whole-context sequence is the first measurement plus that
growth to the context. Two points, not one, because the INT2 latent cache is not proportional:
its first sink + recent (+ slack) rows are bf16 and only the tokens after them are 2-bit codes,
so a short prefill (all bf16) would count INT2 at the bf16 latent's bytes and give it a fifth
of the sequences it holds at long contexts. The first probe therefore goes past those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..engine.caches import CacheSpec, cache_bytes

PROBE_TOKENS = 256  # tokens between the two measurements of a sequence's caches
# Past this many rows a decode step's B per-sequence attention calls (engine.batch) cost more
# than the extra rows bring; requests beyond it wait in the queue.
MAX_AUTO_BATCH = 64
RESERVE = 0.10  # of the budget, kept for activations (a 2,048-token prefill chunk) and MLX


@dataclass(frozen=True)
class Capacity:
    max_batch: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: int  # at the whole context
    weights_bytes: int
    budget_bytes: int
    room_bytes: int  # what the budget leaves for running sequences' caches

    def describe(self) -> str:
        gb = 2**30
        return (
            f"--max-batch {self.max_batch}: {self.room_bytes / gb:.1f} GB for caches "
            f"(budget {self.budget_bytes / gb:.1f} GB - weights {self.weights_bytes / gb:.1f} GB "
            f"- prompt cache - {RESERVE:.0%} reserve) / {self.kv_bytes_per_sequence / gb:.3f} GB "
            f"per whole-context sequence ({self.kv_bytes_per_token:.0f} B per token)"
        )


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _probe_tokens(spec: CacheSpec) -> int:
    """The first probe's length: past the bf16 rows of a quantized latent cache."""
    return PROBE_TOKENS + spec.kind.bf16_rows(spec.quant)


def sequence_bytes(bundle, spec: CacheSpec, ctx: int) -> tuple[int, float]:
    """One sequence's cache bytes at `ctx` tokens, as allocated, and the steady bytes per
    token. Measured on fresh caches: after n1 tokens and after n1 + PROBE_TOKENS; the growth
    is rounded up to whole PROBE_TOKENS steps (mlx-lm's caches grow by 256 rows, the INT2
    codes by their block), so the figure is what the allocator holds, not less. A context
    too short for the two probes is filled whole and measured as it is."""
    n1 = _probe_tokens(spec)
    caches = bundle.caches(spec)

    def fill(n: int) -> int:
        bundle.model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
        return sum(cache_bytes(c) for c in caches)

    if ctx <= n1 + PROBE_TOKENS:  # all but one token prefilled, the last one decoded: the
        fill(ctx - 1)  # decode step's growth headroom is held too
        held = fill(1)
        return held, held / ctx
    b1 = fill(n1)
    per_token = (fill(PROBE_TOKENS) - b1) / PROBE_TOKENS
    steps = -(-(ctx - n1) // PROBE_TOKENS)
    return int(b1 + per_token * steps * PROBE_TOKENS), per_token


def size_batch(
    bundle, spec: CacheSpec, ctx: int, budget_bytes: int, prompt_cache_bytes: int
) -> Capacity:
    per_seq, per_token = sequence_bytes(bundle, spec, ctx)
    per_seq = max(1, per_seq)
    w = weights_bytes(bundle.model)
    room = int(budget_bytes * (1 - RESERVE)) - w - prompt_cache_bytes
    n = max(1, min(MAX_AUTO_BATCH, room // per_seq))
    return Capacity(n, per_token, per_seq, w, budget_bytes, max(0, room))
