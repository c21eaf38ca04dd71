"""What one decode step's attention reads: timed in parts on this CPU (MLX's attention against
the same product with the heads folded, the bf16-latent read, the INT2 read and its unpack),
and the bytes it moves, from which decode on a memory-bound Mac is projected."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from .. import mla_attention, segment_read
from ..caches import latent_caches, model_dtype
from ..latent_cache import RotatedLatentCache
from .setup import HELD, Setup, best_of, caches, fill, to_dtype
from .synthetic import DEEPSEEK_V3_REST, active_weights_per_token


def attention_parts(s: Setup, ctx: int, reps: int = 5) -> dict:
    """Where the decode ratios come from: one layer's attention read of its cache at ctx,
    timed alone (ms, best of `reps`, interleaved), the query (1, heads, 1, latent) as a decode
    step has it:

        mlx_lm_sdpa     mlx-lm's L == 1 read: scaled_dot_product_attention over its cache
                        (128 query heads against one latent "head")
        mlx_lm_folded   the same rows and product with the heads folded into one matrix
                        product, (1, 1, heads, latent) against the rows: what our kernel does
        bf16_latent     the engine's read of the bf16-latent cache (mla_attention.absorbed)
        int2            the engine's read of the INT2 cache, the query rotated as it is there
        int2_unpack     unpacking the INT2 cache's codes alone (rows.dequantize)
    """
    a = s.attn
    dtype = model_dtype(s.model)
    H, r, d = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim
    cs = {w: caches(s, w)[:1] for w in HELD}
    for w in HELD:
        fill(cs[w], ctx, s)
    key = mx.random.key(1)
    q_lat = (mx.random.normal((1, H, 1, r), key=key) * a.scale).astype(dtype)
    q_pe = (mx.random.normal((1, H, 1, d), key=mx.random.split(key)[0]) * a.scale).astype(dtype)
    mx.eval(q_lat, q_pe)
    ml = latent_caches(cs["bf16"])[0]
    lat, pe = ml.keys[..., : ml.offset, :], ml.values[..., : ml.offset, :]

    def sdpa():
        return scaled_dot_product_attention(
            q_lat, lat, lat, cache=ml, scale=1.0, mask=q_pe @ pe.swapaxes(-1, -2)
        )

    def folded():
        sc = q_lat.reshape(1, 1, H, r) @ lat.swapaxes(-1, -2)
        sc = sc + q_pe.reshape(1, 1, H, d) @ pe.swapaxes(-1, -2)
        return (mx.softmax(sc, axis=-1) @ lat).reshape(1, H, 1, r)

    def ours(w):
        c = latent_caches(cs[w])[0]

        def f():
            blks = mla_attention.blocks(c, 1, H, dtype.size)
            out = mla_attention.absorbed(c, c.rotate(q_lat), q_pe, blks, 1)
            return out if c.rotation is None else out @ c.rotation.swapaxes(-1, -2)

        return f

    c2 = latent_caches(cs["int2"])[0]
    seg = [(lat_, pe_) for kind, _, lat_, pe_ in c2.segments(1) if kind == "codes"]

    def unpack():
        return [segment_read.dense_rows(c2, "codes", lt, pt, dtype) for lt, pt in seg]

    names = ("mlx_lm_sdpa", "mlx_lm_folded", "bf16_latent", "int2", "int2_unpack")
    fns = (sdpa, folded, ours("bf16_latent"), ours("int2"), unpack)
    times = best_of(fns, reps)
    ms = {n: round(t * 1e3, 2) for n, t in zip(names, times)}
    check = mx.abs(sdpa() - folded()).max().item()
    return {
        "context": ctx,
        "ms": ms,
        "sdpa_vs_folded": ms["mlx_lm_sdpa"] / ms["mlx_lm_folded"],
        "int2_vs_bf16_latent": ms["int2"] / ms["bf16_latent"],
        "unpack_share_of_int2": ms["int2_unpack"] / ms["int2"],
        "folded_max_abs_diff": check,
    }


# A memory-bound Mac, for the projection: M3 Ultra's memory bandwidth (Apple's figure) and a
# GPU throughput assumed for its matrix products (Apple publishes none; ~28 TFLOPS is the
# figure commonly given for the 80-core GPU in fp32, and fp16 runs at the same rate).
MAC_BANDWIDTH = 819e9
MAC_FLOPS = 28e12
WEIGHT_BITS = 4 + 2 * 16 / 64  # 4-bit, groups of 64 with a bf16 scale and bias


def read_per_step(cs: list, heads: int) -> dict:
    """What one decode step's attention reads from a layer's cache, counted from the arrays
    the step really reads (the segments `mla_attention.blocks` hands the kernel, or mlx-lm's
    keys and values up to its offset): bytes per product they enter (the scores read the
    latent and rope rows, the values read the latent rows again: two products, two passes
    over memory; the rotation twice, query in and output back), bytes counting every array
    once, and the multiply-adds x 2 of the two products."""
    c = cs[0][0] if hasattr(cs[0], "caches") else cs[0]
    if isinstance(c, RotatedLatentCache):
        H = heads
        lat_b = pe_b = rows = 0
        for _, _, lat, pe, _ in mla_attention.blocks(c, 1, H, 2):
            lat_b += sum(p.nbytes for p in lat)
            pe_b += sum(p.nbytes for p in pe)
            rows += lat[0].shape[2]
        rot = c.rotation.nbytes if c.rotation is not None else 0
        r, d = c.latent_dims, c.rope_dims
        per_product, once = 2 * lat_b + pe_b + 2 * rot, lat_b + pe_b + rot
    else:
        lat = c.keys[..., : c.offset, :]
        pe = c.values[..., : c.offset, :]
        rows, r, d = c.offset, lat.shape[-1], pe.shape[-1]
        per_product, once = 2 * lat.nbytes + pe.nbytes, lat.nbytes + pe.nbytes
    flops = 2 * heads * rows * (r + d) + 2 * heads * rows * r
    return {"bytes_per_product": per_product, "bytes_once": once, "flops": flops}


def mac_projection(
    s: Setup,
    contexts=(8192, 32768, 131072),
    bandwidth: float = MAC_BANDWIDTH,
    flops: float = MAC_FLOPS,
) -> dict:
    """Decode tokens/s projected for a 61-layer DeepSeek-V3 at 4-bit on a Mac, from bytes
    moved and multiply-adds, per cache: the weights a token reads (synthetic.py's count of
    the active parameters) and 61 times what one layer's attention reads of its cache (one
    layer of this model filled to the context in bf16, counted by `read_per_step`).

        memory_bound   every byte read at `bandwidth`, nothing else costs time
        roofline       each part takes the longer of its bytes at `bandwidth` and its
                       products at `flops` (weights and attention apart)

    A projection, not a measurement: it ignores kernel launch and dispatch, the INT2
    unpack's arithmetic (the roofline counts the same products for every cache, so where the
    attention is compute-bound it credits INT2 with no cost for its smaller reads and none for
    unpacking: INT2 is at best even there) and any cache reuse between the two products."""
    n = DEEPSEEK_V3_REST["num_hidden_layers"]
    params = active_weights_per_token()
    w_bytes = params * WEIGHT_BITS / 8
    w_time = max(w_bytes / bandwidth, 2 * params / flops)
    prev = model_dtype(s.model)
    to_dtype(s, mx.bfloat16)
    out = {
        "assumptions": {
            "model": "DeepSeek-V3, 61 layers, 4-bit weights (groups of 64, bf16 scale+bias)",
            "active_weights": params,
            "weight_bytes_per_token": round(w_bytes),
            "bandwidth_bytes_per_s": bandwidth,
            "gpu_flops_per_s": flops,
            "attention": "absorbed MLA decode, 128 heads x one 512+64 latent row per token",
        },
        "contexts": {},
    }
    try:
        for ctx in contexts:
            row = {}
            for w in HELD:
                cs = caches(s, w)[:1]
                fill(cs, ctx, s)
                rd = read_per_step(cs, s.attn.num_heads)
                del cs
                mem_t = rd["bytes_per_product"] / bandwidth
                flop_t = rd["flops"] / flops
                row[w] = {
                    **rd,
                    "attention_bound": "compute" if flop_t > mem_t else "memory",
                    "tok_s_memory_bound": 1 / (w_bytes / bandwidth + n * mem_t),
                    "tok_s_memory_bound_bytes_once": 1
                    / (w_bytes / bandwidth + n * rd["bytes_once"] / bandwidth),
                    "tok_s_roofline": 1 / (w_time + n * max(mem_t, flop_t)),
                }
            for k in ("tok_s_memory_bound", "tok_s_memory_bound_bytes_once", "tok_s_roofline"):
                row[f"int2_vs_mlx_lm_{k[6:]}"] = row["int2"][k] / row["bf16"][k]
            out["contexts"][str(ctx)] = row
    finally:
        to_dtype(s, prev)
    return out
