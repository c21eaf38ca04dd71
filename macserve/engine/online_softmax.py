"""Attention over blocks of keys, each with its own softmax, merged with their maxima and sums
(online softmax), so a prefill chunk's transient memory is bounded by heads x queries x block,
not by the context. mla_attention.py reads the INT2 latent cache's segments and mlx-lm's plain
caches through it."""

from __future__ import annotations

import mlx.core as mx


class Merge:
    """Online softmax: per query, the running max, sum of exponentials and weighted sum of
    values, merged block by block (Milakov & Gimelshein; FlashAttention's recurrence)."""

    def __init__(self):
        self.m = self.l = self.acc = None

    def add(self, s: mx.array, values) -> None:
        """s: scores (..., keys), masked entries at the dtype's minimum; values(p) -> p @ V."""
        m_b = s.max(axis=-1, keepdims=True)
        if self.m is None:
            p = mx.exp(s - m_b)
            self.m, self.l, self.acc = m_b, p.sum(axis=-1, keepdims=True), values(p)
            return
        m = mx.maximum(self.m, m_b)
        keep = mx.exp(self.m - m)
        p = mx.exp(s - m)
        self.l = self.l * keep + p.sum(axis=-1, keepdims=True)
        self.acc = self.acc * keep + values(p)
        self.m = m

    def settle(self) -> None:
        """Evaluate the running state now. Left lazy, MLX computes every block's scores
        before merging any (its graph order follows the running max's chain), so a prefill
        chunk's memory would grow with the context again: measured 932 MB against 193 MB
        for 16 blocks of 64 MB."""
        mx.eval(self.m, self.l, self.acc)

    def result(self) -> mx.array:
        return self.acc / self.l


def tiled(blks) -> bool:
    """A segment was cut into blocks: the running state must be evaluated block by block
    (`Merge.settle`). Without tiling (decode, a few-token verification) it stays lazy, so
    MTP rounds can be built ahead while the previous one computes."""
    kinds = [b[0] for b in blks]
    return len(kinds) != len(set(kinds))


def masked(s: mx.array, vis) -> mx.array:
    if vis is True:
        return s
    return mx.where(vis, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
