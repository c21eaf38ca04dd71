"""DeepSeek Sparse Attention's indexer key, cached at 8 bits, and its token selection.

DSA models (deepseek_v32, glm_moe_dsa) cache, next to the MLA latent, one indexer key per
token (index_head_dim, 128 dims). mlx-lm keeps it in a second KVCache at full precision and
lets each query attend only to the `index_topk` tokens its lightning indexer scores highest.
Here the key is stored with `mx.quantize` (8 bits, groups of 64: 136 B per token at 128 dims)
and scored on the codes with `mx.quantized_matmul`; the selection itself is mlx-lm's
(ReLU scores, per-head weights, sum over heads, top-k), so the chosen tokens only change when
8-bit rounding reorders two nearly equal scores.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .latent_cache import _Store


class IndexerKeyCache(_BaseCache):
    """One DSA layer's indexer keys, (B, 1, T, D) quantized per token, exact `trim`."""

    def __init__(self, bits: int | None = 8, group_size: int = 64):
        self._keys = _Store(bits, group_size)
        self.offset = 0
        self.dims = 0

    def append(self, keys: mx.array) -> None:
        self.dims = keys.shape[-1]
        self._keys.append(keys)
        self.offset += keys.shape[2]

    def parts(self) -> tuple[mx.array, ...]:
        return self._keys.view(0, self.offset)

    def scores(self, q: mx.array) -> mx.array:
        """q (B, 1, M, D) against every cached key -> (B, 1, M, T)."""
        st = self._keys
        if st.bits is None:
            return q @ self.parts()[0].astype(q.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(
            q, *self.parts(), transpose=True, group_size=st.group(self.dims), bits=st.bits
        )

    def dequantized(self) -> mx.array:
        return self._keys.decode(self.parts(), self.dims).astype(mx.float32)

    def arrays(self) -> list[mx.array]:
        return list(self._keys.parts or ())

    def update_and_fetch(self, keys, values):
        """For attention code that is not ours."""
        self.append(keys)
        k = self.dequantized()
        return k, k

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self._keys.drop_last(n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes()

    @property
    def state(self):
        return []

    @state.setter
    def state(self, v):
        raise ValueError("IndexerKeyCache cannot be restored from a saved prompt cache")


def select_tokens(indexer, x: mx.array, qr: mx.array, cache: IndexerKeyCache):
    """Append x's indexer keys; then (chosen, top): chosen (B, 1, L, T) True where a query
    attends, top (B, 1, L, index_topk) those token indices; or None when every cached token
    fits in `index_topk` (DSA then attends densely, as mlx-lm does)."""
    b, L, _ = x.shape
    H, D = indexer.n_heads, indexer.head_dim
    offset = cache.offset
    q = indexer.wq_b(qr).reshape(b, L, H, D).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(b, 1, L, D)
    q = indexer.rope(q, offset=offset)
    k = indexer.rope(k, offset=offset)
    cache.append(k)
    T = cache.offset
    if indexer.index_topk >= T:
        return None
    s = cache.scores(q.reshape(b, 1, H * L, D)).reshape(b, H, L, T)
    s = mx.maximum(s, 0)
    w = indexer.weights_proj(x) * (H**-0.5 * indexer.softmax_scale)  # (b, L, H)
    s = s * w.swapaxes(-1, -2)[..., None]
    # Summed over heads exactly as mlx-lm does (a loop for L > 1, see its ml-explore/mlx#3784
    # note), so the selection matches token for token on the same keys.
    s = sum(s[:, h : h + 1] for h in range(H)) if L > 1 else s.sum(axis=1, keepdims=True)
    causal = mx.arange(T)[None, :] <= mx.arange(offset, T)[:, None]
    s = mx.where(causal, s, -float("inf"))
    top = mx.argpartition(s, kth=-indexer.index_topk, axis=-1)[..., -indexer.index_topk :]
    chosen = mx.put_along_axis(mx.zeros(s.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
    return chosen & causal, top


def gather_selected(segments, visible: mx.array, top: mx.array, keep: int):
    """One decode query: the quantized segment cut down to the `top` tokens it may select, so
    the codes of only index_topk rows are scored and attended (DSA's point) instead of every
    row under a mask. visible (B, 1, 1, columns) is the dense visibility, selection included.
    Rows are gathered as they are stored: codes, scales and biases of a row stay together."""
    out, cols, c = [], [], 0
    for kind, start, lat, pe in segments:
        n = lat[0].shape[2]
        vis = visible[..., c : c + n]
        c += n
        if kind != "int" or n <= keep:
            out.append((kind, start, lat, pe))
            cols.append(vis)
            continue
        local = top - start  # (B, 1, 1, k)
        inside = (local >= 0) & (local < n)
        local = mx.clip(local, 0, n - 1)
        rows = local.reshape(*local.shape[:2], -1, 1)  # (B, 1, k, 1)

        def take(parts, rows=rows):
            return tuple(
                mx.take_along_axis(p, mx.broadcast_to(rows, (*rows.shape[:3], p.shape[-1])), axis=2)
                for p in parts
            )

        out.append((kind, start, take(lat), take(pe)))
        cols.append(
            mx.take_along_axis(mx.broadcast_to(vis, (*local.shape[:3], n)), local, axis=-1) & inside
        )
    return out, mx.concatenate(cols, axis=-1)
