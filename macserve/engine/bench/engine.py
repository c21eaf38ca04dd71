"""`macserve bench engine`: the INT2 latent cache against mlx-lm's bf16 cache at real width.

One process, both caches side by side, on a real-width model (the synthetic DeepSeek-V3 of
synthetic.py, or a model folder). Every figure is measured but the projections (MTP speedup
for a 61-layer trunk; decode on a Mac from bytes moved), labelled as such, their formulas in
docs/int2-latent-cache.md.

    upcasts_per_decode_step    float32 conversions one decode step's attention adds to a bf16
                               model, reading its cache (graph as MLX builds it for a GPU)
    prefill_peak_bytes         mx.get_peak_memory() over the last 2,048-token chunk of a
                               prefill to that context (the earlier context filled directly)
    prefill_transient_bytes    that peak minus what was held just before the chunk
    held_bytes_per_token_per_layer   what MLX's allocator holds for the caches after a
                               prefill in 2,048-token chunks (gc.collect, mx.clear_cache,
                               mx.get_active_memory before and after), per token and layer;
                               the rotations apart (rotation_bytes_per_layer)
    nbytes_per_token_per_layer what the caches report (`nbytes`), the same fill
    chunk_vs_steps_max_logit_diff    a chunk against the same tokens fed one by one, in
                               log-probabilities (the logits less their logsumexp)
    chunk_vs_steps_bf16_model  the same with the model in bf16, on a float32-computing CPU
                               only (--bf16-chunk-tokens; a Mac's run above already is)
    decode_tok_s               decode steps per second with the caches filled to that context,
                               INT2, bf16-latent and mlx-lm's ("bf16") interleaved, with
                               int2_vs_bf16_latent and int2_vs_mlx_lm
    attention_parts            one layer's attention read at the largest decode context,
                               its parts timed alone (where the ratios come from)
    mac_projection             a projection, not a measurement: decode tokens/s of a 61-layer
                               DeepSeek-V3 at 4-bit on a Mac from bytes moved (and products
                               done), per cache, at 8K / 32K / 128K
    mtp                        costs measured at real width, acceptance from the demo model

The engine computes in the dtype its loader picks (float32 on MLX's CPU backend: its bf16
matmul has no BLAS path, 2-3 GFLOP/s against 70-100 here); the conversion count is taken on
the bf16 model whatever the device.
"""

from __future__ import annotations

import gc
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import psutil
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from ...int2_format import BF16_LATENT, INT2, LatentQuant
from .. import mla_attention
from ..caches import latent_caches, make_caches, model_dtype
from ..dsa_indexer import IndexerKeyCache
from ..latent_cache import RotatedLatentCache
from ..model import load
from .synthetic import synthetic

CHUNK = 2048  # mlx-lm's prefill_step_size: what the prefill figures are measured in
CACHES = ("int2", "bf16")  # "bf16": mlx-lm's own cache
# The INT2 cache, the same class with quantization off, mlx-lm's cache: held memory and
# decode speed are measured on all three, so each ratio has its nearest baseline.
HELD = ("int2", "bf16_latent", "bf16")


@dataclass
class Setup:
    model: object
    mtp: object
    name: str
    rotations: list  # per layer, in the model's dtype (random orthogonal for a synthetic model)
    quant: LatentQuant = INT2

    @property
    def attn(self):
        return mla_attention.mla_attentions(self.model)[0]

    @property
    def layers(self) -> int:
        return len(mla_attention.mla_attentions(self.model))

    @property
    def dsa(self) -> bool:
        return hasattr(self.attn, "indexer")


def _orthogonal(n: int, seed: int) -> mx.array:
    q, _ = mx.linalg.qr(mx.random.normal((n, n), key=mx.random.key(seed)), stream=mx.cpu)
    return q


def engine_dtype():
    """The loader's rule (model.load): float32 on the CPU, the model's own on a GPU."""
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else None


def setup_synthetic(kind: str, layers: int) -> Setup:
    model, mtp = synthetic(kind, layers, mx.bfloat16)
    mla_attention.install(model, extra=[mtp.self_attn])
    r = model.args.kv_lora_rank
    rots = [_orthogonal(r, i) for i in range(layers)]
    return Setup(model, mtp, f"synthetic {kind} ({layers} layers)", rots)


def setup_folder(path: str) -> Setup:
    b = load(path).require_mla()
    n = len(mla_attention.mla_attentions(b.model))
    r = b.model.args.kv_lora_rank
    rots = [_orthogonal(r, i) for i in range(n)]
    try:
        mtp = b.mtp()
    except Exception:  # noqa: BLE001 - a model without an MTP layer still benches its caches
        mtp = None
    return Setup(b.model, mtp, str(path), rots)


def to_dtype(s: Setup, dtype) -> None:
    if dtype is None:
        return
    for m in (s.model, s.mtp):
        if m is not None:
            m.set_dtype(dtype)
    s.rotations = [r.astype(dtype) for r in s.rotations]
    mx.eval(s.rotations)


def caches(s: Setup, which: str) -> list:
    """ "bf16": mlx-lm's own cache; "int2": the rotated INT2 latent cache; "bf16_latent": the
    same class with quantization off (every token stored in bf16, unrotated)."""
    if which == "bf16":
        return make_prompt_cache(s.model)
    if which == "bf16_latent":
        return make_caches(s.model, BF16_LATENT)
    rots = [r.astype(model_dtype(s.model)) for r in s.rotations]
    return make_caches(s.model, s.quant, rots, [None] * s.layers)


def fill(cs: list, n: int, s: Setup, seed: int = 0, step: int = CHUNK) -> None:
    """Fill caches with n tokens of random latents in `step`-token chunks through their own
    append (what the attention does, without the compute: held memory and speed do not
    depend on the values)."""
    a = s.attn
    dtype = model_dtype(s.model)
    key = mx.random.key(seed)
    for t in range(0, n, step):
        m = min(step, n - t)
        for c in cs:
            key, k1, k2, k3 = mx.random.split(key, 4)
            parts = [c[0], c[1]] if hasattr(c, "caches") else [c]
            lat = mx.random.normal((1, 1, m, a.kv_lora_rank), key=k1).astype(dtype)
            pe = mx.random.normal((1, 1, m, a.qk_rope_head_dim), key=k2).astype(dtype)
            main = parts[0]
            if isinstance(main, RotatedLatentCache):
                main.append(lat, pe)
                main.compact()
            else:
                main.update_and_fetch(lat, pe)
            if len(parts) > 1:
                idx = mx.random.normal((1, 1, m, a.indexer.head_dim), key=k3).astype(dtype)
                if isinstance(parts[1], IndexerKeyCache):
                    parts[1].append(idx)
                else:
                    parts[1].update_and_fetch(idx, mx.zeros_like(idx))
        mx.eval([c.state for c in cs])


def _nbytes(c) -> int:
    """What a cache reports: the buffers it holds, as allocated."""
    if isinstance(c, RotatedLatentCache | IndexerKeyCache):
        return c.nbytes
    if hasattr(c, "caches"):
        return sum(_nbytes(x) for x in c.caches)
    return sum(a.nbytes for a in (c.keys, c.values) if a is not None)


def _rotations(cs: list) -> list:
    return [r for c in latent_caches(cs) if (r := getattr(c, "rotation", None)) is not None]


def _active() -> int:
    """What MLX's allocator holds once nothing unreachable is left (Python's garbage
    collected, MLX's buffer cache emptied)."""
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def held_memory(s: Setup, ctx: int, which=HELD) -> dict:
    """{cache: (allocator bytes, nbytes, rotation bytes)} for one sequence of `ctx` tokens,
    all layers, after a prefill in 2,048-token chunks. The allocator's figure is the memory
    the prefill left held; the rotations (the model's, one per layer, shared by every
    sequence) are made before it and counted apart."""
    out = {}
    for w in which:
        cs = caches(s, w)
        rots = _rotations(cs)
        mx.eval(rots)
        before = _active()
        fill(cs, ctx, s)
        held = _active() - before
        out[w] = (held, sum(_nbytes(c) for c in cs), sum(r.nbytes for r in rots))
        del cs, rots
    return out


def held_bytes_per_token_per_layer(s: Setup, ctx: int, which=HELD) -> dict:
    """{"held": allocator bytes, "nbytes": reported bytes} per token and layer, per cache."""
    m = held_memory(s, ctx, which)
    per = ctx * s.layers
    return {
        "held": {w: round(v[0] / per, 1) for w, v in m.items()},
        "nbytes": {w: round(v[1] / per, 1) for w, v in m.items()},
        "rotation_bytes_per_layer": round(m["int2"][2] / s.layers) if "int2" in m else None,
    }


def _conversions(out) -> int:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "g.dot"
        mx.export_to_dot(str(p), out)
        return len(re.findall(r'label ="AsType"', p.read_text()))


def upcasts(s: Setup, ctx: int = 1024) -> dict:
    """Conversions in one decode step of the bf16 model: in the attention's read of its cache
    (everything after the projections and RoPE, which are mlx-lm's and the same for both),
    and in the whole step (which also holds MLX's CPU fallbacks of mx.fast.rms_norm / rope
    and mlx-lm's MoE router, `gates.astype(float32)`, the same for both caches). The graph is
    built, never run; codes are read as on a GPU (quantized_matmul)."""
    prev = model_dtype(s.model)
    to_dtype(s, mx.bfloat16)
    old = mla_attention.READ_CODES
    mla_attention.READ_CODES = "qmm"
    try:
        a = s.attn
        x = mx.random.normal((1, 1, s.model.args.hidden_size)).astype(mx.bfloat16)
        mx.eval(x)
        q_nope, q_pe, latent, k_pe, _ = mla_attention._project(a, x)
        base = _conversions([a.rope(q_pe, ctx), a.rope(k_pe, ctx), q_nope, latent])
        res = {"attention_read": {}, "whole_step": {}, "logits_dtype": {}}
        for which in CACHES:
            cs = caches(s, which)
            fill(cs, ctx, s)
            res["attention_read"][which] = _conversions(a(x, None, cs[0])) - base
            cs = caches(s, which)
            fill(cs, ctx, s)
            logits = s.model(mx.array([[1]]), cache=cs)
            res["whole_step"][which] = _conversions(logits)
            res["logits_dtype"][which] = str(logits.dtype).rsplit(".", 1)[-1]
        return res
    finally:
        mla_attention.READ_CODES = old
        to_dtype(s, prev)


def _available() -> int:
    return psutil.virtual_memory().available


def bf16_prefill_predicted(s: Setup, ctx: int, chunk: int = CHUNK) -> int:
    """mlx-lm's deepseek_v3 attention materializes pe_scores (B, H, chunk, ctx) and, on the
    CPU, the unfused SDPA its scores and softmax of the same shape: a lower bound of its
    transient memory, read off its code (models/deepseek_v3.py)."""
    itemsize = model_dtype(s.model).size
    return 2 * s.attn.num_heads * chunk * ctx * itemsize


def prefill_memory(s: Setup, ctx: int, chunk: int = CHUNK) -> dict:
    """{cache: (peak, transient) or None}: the last chunk of a prefill to ctx."""
    out = {}
    for which in CACHES:
        if which == "bf16" and bf16_prefill_predicted(s, ctx, chunk) > 0.6 * _available():
            out[which] = None  # would not fit this machine's memory: reported, not run
            continue
        cs = caches(s, which)
        fill(cs, ctx - chunk, s)
        toks = mx.random.randint(0, s.model.args.vocab_size, (1, chunk), key=mx.random.key(ctx))
        mx.eval(toks)
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(s.model(toks, cache=cs)[:, -1], [c.state for c in cs])
        peak = mx.get_peak_memory()
        out[which] = (peak, peak - before)
        del cs
        gc.collect()
        mx.clear_cache()
    return out


def chunk_vs_steps(s: Setup, n: int = CHUNK, prefix: int = 0) -> dict:
    """Max |log-probability| difference between n tokens fed as one chunk and fed one by one,
    and the mean KL between the two. "bf16_latent" stores every row in bf16 as the INT2 cache's
    windows do: on a CPU, where the engine computes in float32, mlx-lm's cache holds float32
    and its difference is float32 rounding only, while any bf16-stored cache also shows rows
    whose bf16 rounding flipped between the chunk's and the single step's arithmetic."""
    out, kl = {}, {}
    toks = mx.random.randint(0, s.model.args.vocab_size, (1, prefix + n), key=mx.random.key(7))
    for which in (*CACHES, "bf16_latent"):
        a, b = caches(s, which), caches(s, which)
        if prefix:
            for cs in (a, b):
                mx.eval(s.model(toks[:, :prefix], cache=cs), [c.state for c in cs])
        chunk = s.model(toks[:, prefix:], cache=a)[0].astype(mx.float32)
        chunk = chunk - mx.logsumexp(chunk, axis=-1, keepdims=True)
        mx.eval(chunk, [c.state for c in a])
        diff = total_kl = 0.0
        for i in range(n):
            step = s.model(toks[:, prefix + i : prefix + i + 1], cache=b)[0, 0].astype(mx.float32)
            step = step - mx.logsumexp(step)
            d = mx.abs(step - chunk[i]).max()
            k = (mx.exp(step) * (step - chunk[i])).sum()
            mx.eval(d, k, [c.state for c in b])
            diff, total_kl = max(diff, d.item()), total_kl + k.item()
        out[which], kl[which] = diff, total_kl / n
    out["mean_kl_steps_to_chunk"] = kl
    return out


def decode_speed(s: Setup, ctx: int, steps: int = 4, rounds: int = 2) -> dict:
    """Decode tokens/s with the caches filled to ctx, the three caches interleaved in every
    round, best round each; and the INT2 cache's ratio to its nearest baseline (the same class
    and kernel, quantization off) and to mlx-lm's cache."""
    cs = {w: caches(s, w) for w in HELD}
    for w in HELD:
        fill(cs[w], ctx, s)
    best = dict.fromkeys(HELD, 0.0)
    tok = mx.array([[1]])
    for _ in range(rounds):
        for w in HELD:
            mx.eval(s.model(tok, cache=cs[w]))  # warm-up
            t = time.perf_counter()
            for _ in range(steps):
                mx.eval(s.model(tok, cache=cs[w]))
            best[w] = max(best[w], steps / (time.perf_counter() - t))
            for c in cs[w]:
                c.trim(steps + 1)
    best["int2_vs_bf16_latent"] = best["int2"] / best["bf16_latent"]
    best["int2_vs_mlx_lm"] = best["int2"] / best["bf16"]
    return best


def attention_parts(s: Setup, ctx: int, reps: int = 5) -> dict:
    """Where the decode ratios come from: one layer's attention read of its cache at ctx,
    timed alone (ms, best of `reps`, interleaved), the query (1, heads, 1, latent) as a decode
    step has it:

        mlx_lm_sdpa     mlx-lm's L == 1 read: scaled_dot_product_attention over its cache
                        (128 query heads against one latent "head")
        mlx_lm_folded   the same rows and product with the heads folded into one matrix
                        product, (1, 1, heads, latent) against the rows: what our kernel does
        bf16_latent     the engine's read of the bf16-latent cache (mla_attention._absorbed)
        int2            the engine's read of the INT2 cache, the query rotated as it is there
        int2_unpack     unpacking the INT2 cache's codes alone (latent_cache.dequantize)
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
            out = mla_attention._absorbed(c, c.rotate(q_lat), q_pe, blks, 1)
            return out if c.rotation is None else out @ c.rotation.swapaxes(-1, -2)

        return f

    c2 = latent_caches(cs["int2"])[0]
    seg = [(lat_, pe_) for kind, _, lat_, pe_ in c2.segments(1) if kind == "codes"]

    def unpack():
        return [mla_attention._dense(c2, "codes", lt, pt, dtype) for lt, pt in seg]

    names = ("mlx_lm_sdpa", "mlx_lm_folded", "bf16_latent", "int2", "int2_unpack")
    fns = (sdpa, folded, ours("bf16_latent"), ours("int2"), unpack)
    times = _best_of(fns, reps)
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
    from .synthetic import DEEPSEEK_V3_REST, active_weights_per_token

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


def _best_of(fns, reps: int) -> list[float]:
    """Best time of each function over `reps` rounds, the functions interleaved in every
    round, so a busy moment of the machine weighs on all of them, not on one ratio's side."""
    for fn in fns:
        mx.eval(fn())
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            mx.eval(fn())
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def mtp_costs(
    s: Setup, ctx: int, acceptance: float | None, trunk_layers: int = 61, vocab: int = 129280
) -> dict:
    """Costs at real width with the INT2 cache: a 2-token verification over a 1-token step,
    and the MTP layer over one trunk layer; projected for a `trunk_layers` model with the real
    vocabulary head (timed as one matmul of that size)."""
    if s.mtp is None:
        return {"note": "the model has no MTP layer"}
    m = s.model
    dtype = model_dtype(m)
    hidden = m.args.hidden_size
    cs = caches(s, "int2")
    fill(cs, ctx, s)

    def trunk(n):
        def f():
            h = m.model(mx.ones((1, n), mx.int32), cs)
            for c in cs:
                c.trim(n)
            return h

        return f

    h1, h2 = (mx.random.normal((1, n, hidden)).astype(dtype) for n in (1, 2))
    mcache = RotatedLatentCache(s.quant)
    lat = mx.random.normal((1, 1, ctx, s.attn.kv_lora_rank)).astype(dtype)
    mcache.append(lat, mx.random.normal((1, 1, ctx, s.attn.qk_rope_head_dim)).astype(dtype))
    mcache.compact()
    mx.eval(mcache.arrays())

    def mtp_step():
        z = s.mtp.hidden(h1, mx.ones((1, 1), mx.int32), None, mcache)
        mcache.trim(1)
        return z

    # Ratios of sub-second times on a shared CPU (one busy second moved a ratio by 50%
    # between runs): best of 7, interleaved.
    t1, t2, tm = _best_of([trunk(1), trunk(2), mtp_step], reps=7)
    head = mx.random.normal((vocab, hidden)).astype(dtype) * 0.01
    mx.eval(head)
    th1, th2 = _best_of([lambda: h1 @ head.T, lambda: h2 @ head.T], reps=7)
    head = None  # 3.7 GB in float32 at DeepSeek-V3's vocabulary: let it go now
    per_layer1 = t1 / s.layers  # the synthetic trunk's small head is negligible at this width
    per_layer2 = t2 / s.layers
    step1 = trunk_layers * per_layer1 + th1
    verify2 = trunk_layers * per_layer2 + th2
    out = {
        "context": ctx,
        "verify_cost_ratio": verify2 / step1,
        "mtp_layer_cost_ratio": tm / per_layer1,
        "acceptance": acceptance,
        "trunk_layers": trunk_layers,
        "head_vocab": vocab,
    }
    if acceptance is not None:
        # Per round: one verification of 2 tokens and one MTP step (its layer and the head),
        # for 1 + acceptance tokens; plain decoding pays one step per token.
        out["projected_speedup_k1"] = (1 + acceptance) * step1 / (verify2 + tm + th1)
    return out


def run(
    s: Setup,
    contexts=None,
    acceptance: float | None = None,
    chunk_tokens: int = CHUNK,
    progress=lambda msg: None,
    bf16_chunk_tokens: int = 0,
    mac: dict | None = None,
) -> dict:
    """The whole report (see the module docstring). `mac`: mac_projection's bandwidth and
    flops, if not its defaults."""
    mac = mac or {}
    c = contexts or {"prefill": (8192, 32768), "held": (1024, 4096, 32768), "decode": (4096, 32768)}
    res = {"model": s.name, "layers": s.layers, "dtype_bf16_check": "bfloat16"}
    progress("conversions in a decode step (bf16 model)")
    res["upcasts"] = upcasts(s)
    res["upcasts_per_decode_step"] = res["upcasts"]["attention_read"]
    progress("held bytes")
    # What a Mac holds: the model's bf16 (the INT2 cache stores bf16 rows whatever computes).
    held = {str(n): held_bytes_per_token_per_layer(s, n) for n in c["held"]}
    res["held_bytes_per_token_per_layer"] = {n: h["held"] for n, h in held.items()}
    res["nbytes_per_token_per_layer"] = {n: h["nbytes"] for n, h in held.items()}
    res["rotation_bytes_per_layer"] = next(iter(held.values()))["rotation_bytes_per_layer"]
    progress("Mac projection from bytes moved")
    res["mac_projection"] = mac_projection(s, c.get("projection", (8192, 32768, 131072)), **mac)
    if bf16_chunk_tokens and engine_dtype() is not None:
        # Where the engine computes in float32 (a CPU), mlx-lm's cache holds float32 rows and
        # its chunk-vs-steps difference is float32 rounding; this one is the comparison a
        # Mac makes, every cache and every product in bf16 (slow here: no bf16 BLAS).
        progress(f"a {bf16_chunk_tokens}-token chunk against single steps, the model in bf16")
        res["chunk_vs_steps_bf16_model"] = chunk_vs_steps(s, bf16_chunk_tokens)
    to_dtype(s, engine_dtype())
    res["dtype"] = str(model_dtype(s.model)).rsplit(".", 1)[-1]
    peak, transient, predicted = {}, {}, {}
    for n in c["prefill"]:
        progress(f"prefill memory at {n:,}")
        m = prefill_memory(s, n)
        peak[str(n)] = {w: (v[0] if v else None) for w, v in m.items()}
        transient[str(n)] = {w: (v[1] if v else None) for w, v in m.items()}
        predicted[str(n)] = bf16_prefill_predicted(s, n)
    res["prefill_peak_bytes"] = peak
    res["prefill_transient_bytes"] = transient
    res["bf16_prefill_transient_lower_bound"] = predicted
    progress(f"a {chunk_tokens}-token chunk against single steps")
    res["chunk_vs_steps_max_logit_diff"] = chunk_vs_steps(s, chunk_tokens)
    res["decode_tok_s"] = {}
    for n in c["decode"]:
        progress(f"decode speed at {n:,}")
        res["decode_tok_s"][str(n)] = decode_speed(s, n)
    progress(f"one layer's attention read at {max(c['decode']):,}, its parts timed alone")
    res["attention_parts"] = attention_parts(s, max(c["decode"]))
    progress("MTP costs")
    res["mtp"] = mtp_costs(s, min(c["decode"]), acceptance)
    return res
