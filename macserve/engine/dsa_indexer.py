"""DeepSeek Sparse Attention's indexer key, cached at 8 bits, and its token selection.

DSA models (deepseek_v32, glm_moe_dsa) cache, next to the MLA latent, one indexer key per
token (index_head_dim, 128 dims). mlx-lm keeps it in a second KVCache at full precision (and
a zero-filled values array as large) and lets each query attend only to the `index_topk`
tokens its lightning indexer scores highest. Here the key is stored with `mx.quantize` (8
bits, groups of 64: 136 B per token at 128 dims) and scored on the codes (`quantized_matmul`
on a GPU, dequantized blocks on the CPU); the selection itself is mlx-lm's (ReLU scores,
per-head weights, sum over heads, top-k), so the chosen tokens only change when 8-bit rounding
reorders two nearly equal scores. A prefill chunk scores its keys in blocks, summing the heads
block by block, so the indexer's memory is queries x tokens, not heads x queries x tokens.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import CacheList, _BaseCache

from .latent_cache import RotatedLatentCache
from .rows import CODE_STEP, Rows, TokenRows

# Transient bytes of one block of indexer scores (heads x queries x keys).
BLOCK_BYTES = DEFAULT_BLOCK_BYTES = 256 * 2**20


class IndexerKeyCache(_BaseCache):
    """One DSA layer's indexer keys, (B, 1, T, D) quantized per token, exact `trim`."""

    def __init__(self, bits: int | None = 8, group_size: int = 64):
        self.keys_rows = Rows(bits, group_size, CODE_STEP)
        self.offset = 0
        self.dims = 0

    def append(self, keys: mx.array) -> None:
        self.dims = keys.shape[-1]
        self.keys_rows.append(keys, exact=keys.shape[2] > 1)
        self.offset += keys.shape[2]

    def parts(self, start: int = 0, stop: int | None = None) -> tuple[mx.array, ...]:
        return self.keys_rows.view(start, self.offset if stop is None else stop)

    def scores(self, q: mx.array, start: int = 0, stop: int | None = None) -> mx.array:
        """q (B, 1, M, D) against the cached keys [start, stop) -> (B, 1, M, stop - start)."""
        st, parts = self.keys_rows, self.parts(start, stop)
        if st.bits is None:
            return q @ parts[0].astype(q.dtype).swapaxes(-1, -2)
        if mx.default_device().type == mx.DeviceType.cpu:
            # MLX's CPU quantized matmul is ~50x slower than dequantize + BLAS (see
            # mla_attention.py).
            return q @ st.decode(parts, self.dims, q.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(
            q, *parts, transpose=True, group_size=st.group(self.dims), bits=st.bits
        )

    def dequantized(self) -> mx.array:
        return self.keys_rows.decode(self.parts(), self.dims)

    def arrays(self) -> list[mx.array]:
        return self.keys_rows.arrays()

    def clone(self) -> IndexerKeyCache:
        new = IndexerKeyCache(self.keys_rows.bits, self.keys_rows.group_size)
        new.keys_rows, new.offset, new.dims = self.keys_rows.clone(), self.offset, self.dims
        return new

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
        self.keys_rows.drop_last(n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return self.keys_rows.nbytes()

    @property
    def state(self):
        """Its stored form: bits, group size, offset, key dims, the key rows in use.
        Evaluated by mlx-lm's generate_step after each prefill chunk (see latent_cache)."""
        st = self.keys_rows
        return (st.bits, st.group_size, self.offset, self.dims, st.stored())

    @state.setter
    def state(self, v):
        bits, group_size, offset, dims, parts = v
        if (bits, group_size) != (self.keys_rows.bits, self.keys_rows.group_size):
            raise ValueError(
                f"stored: {bits or 16}-bit keys in groups of {group_size}; this cache: "
                f"{self.keys_rows.bits or 16}-bit in groups of {self.keys_rows.group_size}"
            )
        self.keys_rows.restore(parts)
        self.offset, self.dims = offset, dims

    @classmethod
    def from_state(cls, state):
        obj = cls(state[0], state[1])
        obj.state = state
        return obj

    def stored_rows(self) -> TokenRows:
        """Every key row: no later token changes one. Not cuttable: it sits beside a latent
        cache, which is not."""
        n = self.keys_rows.length
        return TokenRows({f"4.{j}": (0, n) for j in range(len(self.keys_rows.parts or ()))}, n)


class DsaCaches(CacheList):
    """One DSA layer's caches in mlx-lm's layout, CacheList(latent, indexer key), restored in
    place: mlx-lm's CacheList makes new caches from its state by class name, among its own
    classes, and a fresh latent cache holds the calibration's rotation, which no state does."""

    @property
    def state(self):
        return [(c.state, type(c).__name__) for c in self.caches]

    @state.setter
    def state(self, v):
        if [n for _, n in v] != [type(c).__name__ for c in self.caches]:
            raise ValueError(f"stored {[n for _, n in v]}, this layer holds other caches")
        for c, (s, _) in zip(self.caches, v):
            c.state = s

    @classmethod
    def from_state(cls, state, rotation=None, clip=None):
        (lat, _), (keys, _) = state
        return cls(
            RotatedLatentCache.from_state(lat, rotation, clip), IndexerKeyCache.from_state(keys)
        )

    def stored_rows(self) -> TokenRows:
        return TokenRows.of_list([c.stored_rows() for c in self.caches])


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
    if T <= indexer.index_topk:
        return None
    w = indexer.weights_proj(x) * (H**-0.5 * indexer.softmax_scale)  # (b, L, H)
    w = w.swapaxes(-1, -2)[..., None]  # (b, H, L, 1)
    qf = q.reshape(b, 1, H * L, D)
    bk = max(256, BLOCK_BYTES // max(1, H * L * 4))
    parts = []
    for a in range(0, T, bk):
        z = min(T, a + bk)
        s = cache.scores(qf, a, z).reshape(b, H, L, z - a)
        s = mx.maximum(s, 0) * w
        # Summed over heads as mlx-lm does (a loop for L > 1, see its ml-explore/mlx#3784
        # note), so the selection matches token for token on the same keys.
        s = sum(s[:, h : h + 1] for h in range(H)) if L > 1 else s.sum(axis=1, keepdims=True)
        if L > 1 and T > bk:
            mx.eval(s)  # block by block (see online_softmax.Merge.settle)
        parts.append(s)
    s = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    causal = mx.arange(T)[None, :] <= mx.arange(offset, T)[:, None]
    s = mx.where(causal, s, -float("inf"))
    top = mx.argpartition(s, kth=-indexer.index_topk, axis=-1)[..., -indexer.index_topk :]
    chosen = mx.put_along_axis(mx.zeros(s.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
    return chosen & causal, top


def gather_selected(cache, blocks: list, top: mx.array) -> list:
    """One decode query: each codes block cut down to the `top` tokens it may select, so the
    codes of only index_topk rows are read (DSA's point) instead of every row under a mask.
    Rows are gathered as they are stored: codes, scales and biases of a row stay together."""
    k = top.shape[-1]
    out = []
    for kind, start, lat, pe, vis in blocks:
        n = lat[0].shape[2]
        if kind != "codes" or n <= k:
            out.append((kind, start, lat, pe, vis))
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

        full = vis if vis is not True else mx.ones((1, 1, 1, n), dtype=mx.bool_)
        seen = mx.take_along_axis(mx.broadcast_to(full, (*local.shape[:3], n)), local, axis=-1)
        out.append((kind, start, take(lat), take(pe), seen & inside))
    return out
