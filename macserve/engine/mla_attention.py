"""MLA attention that reads a `RotatedLatentCache`: its codes are never dequantized whole.

mlx-lm's DeepSeek-V3-family attention (deepseek_v3, kimi_k2, glm4_moe_lite, ...) projects
q_nope into latent space (`embed_q`), scores it against the cached latent and maps the
attended latent back (`unembed_out`). With a rotated cache u = c R the same holds in rotated
coordinates: q~ . c = (q~ R) . u, and sum_t p_t c_t = (sum_t p_t u_t) R^T. So the query is
rotated once, the codes are scored and attended as they are stored, and the output is
rotated back once per step ("absorbed"). A prefill chunk of L tokens instead expands each
block of keys to per-head K and V, as mlx-lm does for L > 1 ("expanded"): past
L = r (nope + v) / (2 r - nope - v) queries (171 at DeepSeek-V3's dims) that costs fewer
multiply-adds than scoring every query against the 512-wide latent.

Keys are read segment by segment (bf16 sink, codes, bf16 window) and, in a prefill chunk, in
blocks of keys, each with its own softmax; the partial results are merged with their maxima
and sums (online softmax), so the transient memory is bounded by heads x queries x block, not
by the context. How a segment's rows are read (codes by `quantized_matmul` on a GPU,
dequantized elsewhere) and a decode step's one-softmax read are segment_read.py's.

DSA models (deepseek_v32, glm_moe_dsa) cache CacheList(latent, indexer key); the indexer's
top-k selection (`dsa_indexer.py`) becomes a mask over the same scores, and a decode step
reads only the selected rows of the codes.

A prefill chunk through mlx-lm's own plain cache is read in blocks of keys the same way
(`blocked_prefill`): mlx-lm's form scores every query against every key at once and expands
the whole cache to per-head keys and values, scratch that grows with the context.

`install(model)` swaps each MLA attention module's class for a subclass whose `__call__`
takes this path when its cache is a RotatedLatentCache and defers to mlx-lm otherwise, so
mlx-lm's model code, weights and `generate` are used unchanged.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import CacheList, KVCache

from . import dsa_indexer, segment_read
from .batch import SequenceBatch
from .latent_cache import RotatedLatentCache
from .online_softmax import Merge, masked, tiled

# Transient bytes one block of scores may take (heads x queries x keys); a prefill chunk's
# keys are read in blocks this size, so its memory does not grow with the context.
BLOCK_BYTES = DEFAULT_BLOCK_BYTES = 256 * 2**20
# DSA decode scores only the selected rows of the codes (False: all rows, masked; the bench
# flips it to measure the difference, tests check both give the same attention).
SPARSE_DECODE = True
# A decode step (one query, no DSA selection) reads its segments with one softmax
# (`decode_read`); False: as a prefill chunk's blocks are read, merged by online softmax (the
# bench flips it to measure what that saves; tests check both give the same attention).
DECODE_READ = True


def project(attn, x):
    """(q_nope, q_pe, latent, k_pe, qr): qr is the query's low-rank code (DSA's indexer reads it)."""
    B, L, _ = x.shape
    if getattr(attn, "q_lora_rank", None) is None:
        qr = None
        q = attn.q_proj(x)
    else:
        qr = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(qr)
    q = q.reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    ckv = attn.kv_a_proj_with_mqa(x)
    ckv, k_pe = mx.split(ckv, [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(ckv), axis=1)
    return q_nope, q_pe, latent, k_pe, qr


def expanded_from(attn) -> int:
    """Queries from which the expanded form costs fewer multiply-adds than the absorbed one."""
    r, nope, v = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    return max(2, -(-r * (nope + v) // max(1, 2 * r - nope - v)))


def block_keys(heads: int, L: int, itemsize: int, row_bytes: int = 0) -> int:
    """Keys per block for L queries: its scores (heads x L x keys) and the bytes each key's
    rows take once read (`row_bytes`: dense, and expanded to per-head K and V in the expanded
    form) within BLOCK_BYTES; at least 64."""
    return max(64, BLOCK_BYTES // max(1, heads * L * itemsize + row_bytes))


def row_bytes(attn, L: int, itemsize: int) -> int:
    """What one key of a block costs beside its scores, for L queries (`block_keys`)."""
    dense = 2 * (attn.kv_lora_rank + attn.qk_rope_head_dim) * itemsize
    if L < expanded_from(attn):
        return dense
    return dense + 2 * attn.num_heads * (attn.qk_nope_head_dim + attn.v_head_dim) * itemsize


def blocks(
    cache: RotatedLatentCache, L: int, heads: int, itemsize: int, chosen=None, row: int = 0
) -> list:
    """[(kind, first token, latent parts, rope parts, visible)] per block of keys the last L
    queries read; blocks none of them can see are left out. A decode step (and a
    verification of a few tokens) gets each segment whole. `visible` is True (every query
    sees every row) or a (.., L, rows) bool mask; `chosen` (B, 1, L, tokens): the DSA
    selection, applied on top."""
    bk = block_keys(heads, L, itemsize, row) if L > 1 else 1 << 62
    out = []
    for kind, start, lat, pe in cache.segments(L):
        n = lat[0].shape[2]
        for a in range(0, n, bk):
            b = min(n, a + bk)
            vis = cache.visible(kind, start + a, b - a, L)
            if vis is False:
                continue
            if chosen is not None:
                sel = chosen[..., start + a : start + b]
                vis = sel if vis is True else vis & sel
            bl, bp = lat, pe
            if a > 0 or b < n:
                bl, bp = tuple(x[..., a:b, :] for x in lat), tuple(x[..., a:b, :] for x in pe)
            out.append((kind, start + a, bl, bp, vis))
    return out


def absorbed(cache: RotatedLatentCache, q_lat, q_pe, blks, L: int):
    """Attention in latent space: q_lat (B, H, L, r) rotated and scaled -> (B, H, L, r)."""
    B, H = q_lat.shape[:2]
    gpu = segment_read.read_with_qmm()
    dtype = q_lat.dtype
    qr = q_lat.reshape(B, 1, H * L, -1)
    qp = q_pe.reshape(B, 1, H * L, -1)
    merge = Merge()
    for kind, _, lat, pe, vis in blks:
        s, values = segment_read.segment(cache, kind, lat, pe, qr, qp, dtype, gpu)
        s = s.reshape(B, H, L, -1)
        if L > 1:  # a prefill chunk: softmax statistics in float32 across many blocks
            s = s.astype(mx.float32)
        s = masked(s, vis)

        def flat_values(p, values=values):
            p = p.astype(dtype).reshape(B, 1, H * L, -1)
            return values(p).reshape(B, H, L, -1)

        merge.add(s, flat_values)
        if L > 1 and tiled(blks):
            merge.settle()
    return merge.result().astype(dtype)


def _expanded(attn, cache: RotatedLatentCache, q_nope, q_pe, blks):
    """mlx-lm's L > 1 form, block by block: each block of cached latents (codes dequantized)
    is rotated back and expanded to per-head keys and values. -> (B, H, L, v_head_dim)."""
    dtype = q_nope.dtype
    rot = cache.rotation
    merge = Merge()
    for kind, _, lat, pe, vis in blks:
        k_lat, k_pe = segment_read.dense_rows(cache, kind, lat, pe, dtype)
        c = k_lat if rot is None else k_lat @ rot.swapaxes(-1, -2)
        k = attn.embed_q(c, transpose=False)  # (B, H, n, nope)
        v = attn.unembed_out(c)  # (B, H, n, v)
        s = (q_nope @ k.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)).astype(mx.float32)
        s = masked(s, vis)
        merge.add(s, lambda p, v=v: (p.astype(dtype) @ v).astype(mx.float32))
        if tiled(blks):
            merge.settle()
    return merge.result().astype(dtype)


def quantized_attention(
    attn, x, mask, cache: RotatedLatentCache, observer=None, indexer_cache=None
):
    """Attention of x's tokens through `cache`. With `indexer_cache` (a DSA model) each query
    attends only to the tokens its lightning indexer selects, as mlx-lm's deepseek_v32 does."""
    q_nope, q_pe, latent, k_pe, qr = project(attn, x)
    q_pe = attn.rope(q_pe, cache.offset)
    k_pe = attn.rope(k_pe, cache.offset)
    out = _quantized_core(attn, x, cache, q_nope, q_pe, latent, k_pe, qr, observer, indexer_cache)
    return attn.o_proj(out)


def _quantized_core(attn, x, cache, q_nope, q_pe, latent, k_pe, qr, observer, indexer_cache):
    """quantized_attention after the projections and RoPE, before the output projection."""
    B, L, _ = x.shape
    H = attn.num_heads
    if observer is not None:
        observer(attn.embed_q(q_nope), latent)
    cache.append(latent, k_pe)
    chosen = top = None
    if indexer_cache is not None:
        picked = dsa_indexer.select_tokens(attn.indexer, x, qr, indexer_cache)
        if picked is not None:
            chosen, top = picked
    q_pe = q_pe * attn.scale
    if L >= expanded_from(attn):
        blks = blocks(cache, L, H, 4, chosen, row_bytes(attn, L, 4))
        out = _expanded(attn, cache, q_nope * attn.scale, q_pe, blks)
    else:
        q_lat = cache.rotate(attn.embed_q(q_nope) * attn.scale)
        if L == 1 and chosen is None and DECODE_READ:
            out = segment_read.decode_read(cache, q_lat, q_pe)
        else:
            blks = blocks(
                cache, L, H, 4 if L > 1 else q_lat.dtype.size, chosen, row_bytes(attn, L, 4)
            )
            if top is not None and L == 1 and SPARSE_DECODE:
                blks = dsa_indexer.gather_selected(cache, blks, top)
            out = absorbed(cache, q_lat, q_pe, blks, L)
        if cache.rotation is not None:
            out = out @ cache.rotation.swapaxes(-1, -2)
        out = attn.unembed_out(out)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    if L > 1:
        cache.compact()
    held = cache.arrays() + (indexer_cache.arrays() if indexer_cache is not None else [])
    # The cache's own updates (codes of tokens leaving the window, the compacted window, an
    # indexer key not read yet) are evaluated with the output, step by step, not left to grow.
    return mx.depends(out, held) if held else out


def batched_decode(attn, x, caches: list):
    """One token per sequence (x: (B, 1, D)), sequence b through caches[b] at its own offset:
    the projections, RoPE (with per-row offsets) and the output projection run once for the
    B rows; each row's cache update and attention on its own. Rotated latent caches take the
    quantized path row by row; mlx-lm's plain caches its absorbed L == 1 path, with the
    latent-space maps (embed_q, unembed_out) once for all rows."""
    q_nope, q_pe, latent, k_pe, qr = project(attn, x)
    offsets = mx.array([c.offset for c in caches])
    q_pe = attn.rope(q_pe, offsets)
    k_pe = attn.rope(k_pe, offsets)
    rows = []
    if isinstance(caches[0], RotatedLatentCache):
        for b, c in enumerate(caches):
            r = slice(b, b + 1)
            q_r = None if qr is None else qr[r]
            rows.append(
                _quantized_core(
                    attn, x[r], c, q_nope[r], q_pe[r], latent[r], k_pe[r], q_r, None, None
                )
            )
        return attn.o_proj(mx.concatenate(rows, axis=0))
    q_lat, q_pe = attn.embed_q(q_nope), q_pe * attn.scale
    for b, c in enumerate(caches):
        r = slice(b, b + 1)
        lat, pe = c.update_and_fetch(latent[r], k_pe[r])
        scores = q_pe[r] @ pe.swapaxes(-1, -2)
        rows.append(
            scaled_dot_product_attention(q_lat[r], lat, lat, cache=c, scale=attn.scale, mask=scores)
        )
    out = attn.unembed_out(mx.concatenate(rows, axis=0))
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(len(caches), 1, -1))


class _Plain:
    """mlx-lm's plain cache seen as one unrotated bf16 segment (what `dense_rows`, `absorbed`
    and `_expanded` read of a cache)."""

    rotation = None


def plain_blocks(latent, pe, L: int, heads: int, row: int) -> list:
    """`blocks` for rows of a plain cache (latent, pe: (B, 1, N, .)) read by its last L
    queries: every key before the chunk is seen by all of them, the chunk's own causally."""
    n = latent.shape[2]
    first = n - L  # the chunk's first position
    bk = block_keys(heads, L, 4, row)
    out = []
    for a in range(0, n, bk):
        b = min(n, a + bk)
        vis = True
        if b - 1 > first:  # the block reaches into the chunk: key j seen by query i iff j <= i
            vis = mx.arange(a, b)[None] <= (first + mx.arange(L))[:, None]
        out.append(("plain", a, (latent[..., a:b, :],), (pe[..., a:b, :],), vis))
    return out


def blocked_prefill(attn, x, cache):
    """A prefill chunk through mlx-lm's plain cache, its keys read in blocks as the INT2 path
    reads them. mlx-lm's own L > 1 form expands the whole cached latent to per-head keys and
    values (heads x context x (nope + v)) and scores every query against every key at once:
    at DeepSeek-V3's 128 heads near 128K, 8 GiB and 64 GiB of scratch for a 2,048-token chunk;
    here a chunk holds one block of each. The causal mask is the chunk's own (a plain cache
    has no window)."""
    B, L, _ = x.shape
    q_nope, q_pe, latent, k_pe, _ = project(attn, x)
    q_pe = attn.rope(q_pe, cache.offset)
    k_pe = attn.rope(k_pe, cache.offset)
    latent, k_pe = cache.update_and_fetch(latent, k_pe)
    blks = plain_blocks(latent, k_pe, L, attn.num_heads, row_bytes(attn, L, 4))
    q_pe = q_pe * attn.scale
    if L >= expanded_from(attn):
        out = _expanded(attn, _Plain, q_nope * attn.scale, q_pe, blks)
    else:
        q_lat = attn.embed_q(q_nope) * attn.scale
        out = attn.unembed_out(absorbed(_Plain, q_lat, q_pe, blks, L))
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def set_block_bytes(n: int | None) -> None:
    """The bytes one block of scores may take (the server sets it from its share's reserve;
    None: the default)."""
    global BLOCK_BYTES
    BLOCK_BYTES = DEFAULT_BLOCK_BYTES if n is None else max(1, int(n))


# Up to this many queries, attention over an ordinary cache stays in latent space as well.
# mlx-lm expands the whole cached latent into per-head keys and values for any L > 1, which
# made a 2-token speculative verification cost 5.6x a 1-token step (measured on the tiny model).
ABSORBED_MAX_QUERIES = 16


def absorbed_attention(attn, x, mask, cache):
    """mlx-lm's own L == 1 path (absorbed MLA), for a few queries at once."""
    B, L, _ = x.shape
    q_nope, q_pe, latent, k_pe, _ = project(attn, x)
    q_pe = attn.rope(q_pe, cache.offset)
    k_pe = attn.rope(k_pe, cache.offset)
    latent, k_pe = cache.update_and_fetch(latent, k_pe)
    pe_scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:
        pe_scores = mx.where(
            mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
        )
    out = scaled_dot_product_attention(
        attn.embed_q(q_nope), latent, latent, cache=cache, scale=attn.scale, mask=pe_scores
    )
    out = attn.unembed_out(out).transpose(0, 2, 1, 3).reshape(B, L, -1)
    return attn.o_proj(out)


_patched: dict[type, type] = {}


def _patched_class(base: type) -> type:
    if base not in _patched:

        def __call__(self, x, mask=None, cache=None):
            if isinstance(cache, SequenceBatch):
                # One decode token per sequence: the rows share the projections' weights
                # (read once for all), each attends through its own cache and offset.
                if x.shape[1] != 1:
                    raise ValueError("a SequenceBatch decodes one token per sequence")
                kinds = {isinstance(c, RotatedLatentCache) for c in cache.caches}
                if len(kinds) == 1 and not isinstance(cache.caches[0], CacheList):
                    return batched_decode(self, x, cache.caches)
                # DSA layers (CacheList: latent + indexer key): each row on its own.
                rows = [self(x[b : b + 1], None, c) for b, c in enumerate(cache.caches)]
                return mx.concatenate(rows, axis=0)
            if isinstance(cache, RotatedLatentCache):
                return quantized_attention(self, x, mask, cache, getattr(self, "_observer", None))
            if isinstance(cache, CacheList) and isinstance(cache[0], RotatedLatentCache):
                return quantized_attention(
                    self,
                    x,
                    mask,
                    cache[0],
                    getattr(self, "_observer", None),
                    indexer_cache=cache[1],
                )
            if type(cache) is KVCache and x.shape[1] > ABSORBED_MAX_QUERIES:
                return blocked_prefill(self, x, cache)
            if (
                cache is not None
                and 1 < x.shape[1] <= ABSORBED_MAX_QUERIES
                and hasattr(cache, "update_and_fetch")
                and mask is not None
                and not isinstance(mask, str)
            ):
                return absorbed_attention(self, x, mask, cache)
            return base.__call__(self, x, mask=mask, cache=cache)

        _patched[base] = type(base.__name__ + "Quantized", (base,), {"__call__": __call__})
    return _patched[base]


def mla_attentions(model) -> list:
    """The MLA attention modules of the trunk, in layer order."""
    layers = getattr(model, "layers", None) or model.model.layers
    return [l.self_attn for l in layers if hasattr(l.self_attn, "embed_q")]


def install(model, extra=()) -> int:
    """Let every MLA layer read RotatedLatentCache; returns how many layers were patched.
    `extra`: more attention modules (an MTP layer's)."""
    attns = mla_attentions(model) + list(extra)
    for a in attns:
        if type(a) not in _patched.values():
            a.__class__ = _patched_class(type(a))
    return len(attns)


def uninstall(model) -> None:
    """Back to mlx-lm's own classes (tests compare the two paths)."""
    for a in mla_attentions(model):
        for base, patched in _patched.items():
            if type(a) is patched:
                a.__class__ = base
