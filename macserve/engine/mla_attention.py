"""Absorbed MLA attention that reads a `RotatedLatentCache` without dequantizing it.

mlx-lm's DeepSeek-V3-family attention (deepseek_v3, kimi_k2, glm4_moe_lite, ...) projects
q_nope into latent space (`embed_q`), scores it against the cached latent and maps the
attended latent back (`unembed_out`). With a rotated cache u = c R the same holds in rotated
coordinates: q~ . c = (q~ R) . u, and sum_t p_t c_t = (sum_t p_t u_t) R^T. So the query is
rotated once, `mx.quantized_matmul` scores and attends the packed codes, and the output is
rotated back once per step.

DSA models (deepseek_v32, glm_moe_dsa) cache CacheList(latent, indexer key); the indexer's
top-k selection (`dsa_indexer.py`) becomes a mask over the same quantized scores.

`install(model)` swaps each MLA attention module's class for a subclass whose `__call__`
takes this path when its cache is a RotatedLatentCache and defers to mlx-lm otherwise, so
mlx-lm's model code, weights and `generate` are used unchanged.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import CacheList

from . import dsa_indexer
from .latent_cache import RotatedLatentCache


def _project(attn, x):
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


def _scores(x, kind, parts, store, dims):
    """x (B, 1, H*L, D) against one segment's keys -> (B, 1, H*L, T)."""
    if kind != "int" or store.bits is None:
        return x @ parts[0].astype(x.dtype).swapaxes(-1, -2)
    return mx.quantized_matmul(
        x, *parts, transpose=True, group_size=store.group(dims), bits=store.bits
    )


def _attend(p, kind, parts, store, dims):
    """Attention weights p (B, 1, H*L, T) times one segment's latents -> (B, 1, H*L, r)."""
    if kind != "int" or store.bits is None:
        return p @ parts[0].astype(p.dtype)
    return mx.quantized_matmul(
        p, *parts, transpose=False, group_size=store.group(dims), bits=store.bits
    )


# DSA decode scores only the selected rows of the quantized segment (False: all rows, masked;
# the bench flips it to measure the difference, tests check both give the same attention).
SPARSE_DECODE = True


def quantized_attention(
    attn, x, mask, cache: RotatedLatentCache, observer=None, indexer_cache=None
):
    """Attention of x's tokens through `cache`. With `indexer_cache` (a DSA model) each query
    attends only to the tokens its lightning indexer selects, as mlx-lm's deepseek_v32 does."""
    B, L, _ = x.shape
    H = attn.num_heads
    q_nope, q_pe, latent, k_pe, qr = _project(attn, x)
    q_pe = attn.rope(q_pe, cache.offset)
    k_pe = attn.rope(k_pe, cache.offset)
    q_lat = attn.embed_q(q_nope)  # (B, H, L, r): the absorbed query
    if observer is not None:
        observer(q_lat, latent)
    cache.append(latent, k_pe)
    selected = None
    if indexer_cache is not None:
        selected = dsa_indexer.select_tokens(attn.indexer, x, qr, indexer_cache)
    q_rot = cache.rotate(q_lat) * attn.scale
    q_rot = q_rot.reshape(B, 1, H * L, -1)
    q_pe = (q_pe * attn.scale).reshape(B, 1, H * L, -1)
    lat_store, pe_store = cache.stores()
    segs = cache.segments(L)
    # Our own mask, not mlx-lm's: a token may appear twice (int and bf16) near the window edge.
    visible = cache.mask(segs, L)
    if selected is not None:
        chosen, top = selected
        # Selection is per token; map it onto the score columns, segment by segment.
        visible = visible & mx.concatenate(
            [chosen[..., start : start + lat[0].shape[2]] for _, start, lat, _ in segs], axis=-1
        )
        if L == 1 and SPARSE_DECODE:
            segs, visible = dsa_indexer.gather_selected(segs, visible, top, top.shape[-1])
    scores = []
    for kind, _, lat, pe in segs:
        s = _scores(q_rot, kind, lat, lat_store, cache.latent_dims)
        s = s + _scores(q_pe, kind, pe, pe_store, cache.rope_dims)
        scores.append(s)
    s = mx.concatenate(scores, axis=-1).reshape(B, H, L, -1)
    s = mx.where(visible, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(q_rot.dtype).reshape(B, 1, H * L, -1)
    out, start = None, 0
    for kind, _, lat, _ in segs:
        n = lat[0].shape[2]
        o = _attend(p[..., start : start + n], kind, lat, lat_store, cache.latent_dims)
        out = o if out is None else out + o
        start += n
    out = out.reshape(B, H, L, -1)
    if cache.rotation is not None:
        out = out @ cache.rotation.T
    out = attn.unembed_out(out)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return attn.o_proj(out)


# Up to this many queries, attention over an ordinary cache stays in latent space as well.
# mlx-lm expands the whole cached latent into per-head keys and values for any L > 1, which
# made a 2-token speculative verification cost 5.6x a 1-token step (measured on the tiny model).
ABSORBED_MAX_QUERIES = 16


def absorbed_attention(attn, x, mask, cache):
    """mlx-lm's own L == 1 path (absorbed MLA), for a few queries at once."""
    B, L, _ = x.shape
    q_nope, q_pe, latent, k_pe, _ = _project(attn, x)
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
