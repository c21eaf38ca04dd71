"""How many sequences the server decodes together when `--max-batch` is not given: as many
whole-context KV caches as fit in the memory budget beside the weights and the prompt cache.

A fixed 8 left a large Mac idle under load (32 clients: 330-554 tok/s at 8 against 831 at 32,
measured on a DeepSeek-class model) and, on a small Mac, could promise caches it cannot hold.
So the footprint is measured on the loaded model, with the cache kind the server runs: one
sequence's caches after a short prefill, per token, times the context a request may reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..engine.caches import CacheSpec, cache_bytes

PROBE_TOKENS = 256  # tokens prefilled to measure a sequence's cache bytes per token
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


def kv_bytes_per_token(bundle, spec: CacheSpec) -> float:
    """One sequence's cache bytes per token, as allocated, after a PROBE_TOKENS prefill (the
    growth steps' headroom included, so a little more than the steady state: the safe side)."""
    caches = bundle.caches(spec)
    ids = mx.zeros((1, PROBE_TOKENS), dtype=mx.int32)
    bundle.model(ids, cache=caches)
    mx.eval([c.state for c in caches])
    return sum(cache_bytes(c) for c in caches) / PROBE_TOKENS


def size_batch(
    bundle, spec: CacheSpec, ctx: int, budget_bytes: int, prompt_cache_bytes: int
) -> Capacity:
    per_token = kv_bytes_per_token(bundle, spec)
    per_seq = max(1, int(per_token * ctx))
    w = weights_bytes(bundle.model)
    room = int(budget_bytes * (1 - RESERVE)) - w - prompt_cache_bytes
    n = max(1, min(MAX_AUTO_BATCH, room // per_seq))
    return Capacity(n, per_token, per_seq, w, budget_bytes, max(0, room))
