"""`macserve bench engine`: the INT2 latent cache against mlx-lm's bf16 cache at real width.

One process, both caches side by side, on a real-width model (the synthetic DeepSeek-V3 of
synthetic.py, or a model folder). Every figure is measured but the projections (MTP speedup
for a 61-layer trunk; decode on a Mac from bytes moved), labelled as such, their formulas in
docs/int2-latent-cache.md.

    upcasts_per_decode_step    float32 conversions one decode step's attention adds to a bf16
                               model, reading its cache (graph as MLX builds it for a GPU)
    prefill_peak_bytes         mx.get_peak_memory() over the last 2,048-token chunk of a
                               prefill to that context (the earlier context filled directly;
                               "bf16": mlx-lm's cache as the engine reads it, in blocks)
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
                               INT2, INT2 read as before issue 45, bf16-latent and mlx-lm's
                               ("bf16") interleaved, medians of the rounds, with
                               int2_vs_bf16_latent and int2_vs_mlx_lm (medians of the
                               rounds' ratios)
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
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx

from .. import mla_attention, segment_read
from ..caches import latent_caches, model_dtype
from ..dsa_indexer import IndexerKeyCache
from ..latent_cache import RotatedLatentCache
from .decode_e2e import previous_read, whole_segments
from .decode_read import attention_parts, mac_projection
from .setup import (
    CACHES,
    CHUNK,
    HELD,
    Setup,
    best_of,
    caches,
    engine_dtype,
    fill,
    to_dtype,
)


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
    old = segment_read.READ_CODES
    segment_read.READ_CODES = "qmm"
    try:
        a = s.attn
        x = mx.random.normal((1, 1, s.model.args.hidden_size)).astype(mx.bfloat16)
        mx.eval(x)
        q_nope, q_pe, latent, k_pe, _ = mla_attention.project(a, x)
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
        segment_read.READ_CODES = old
        to_dtype(s, prev)


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
        # mlx-lm's cache too: the engine reads it in blocks of keys (blocked_prefill), so its
        # chunk no longer needs bf16_prefill_predicted's bytes (mlx-lm's own attention's)
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


def decode_speed(s: Setup, ctx: int, steps: int = 4, rounds: int = 3) -> dict:
    """Decode tokens/s with the caches filled to ctx: INT2, INT2 read as before issue 45
    ("int2_previous", decode_e2e.previous_read), the bf16-latent cache and mlx-lm's,
    interleaved in every round; each the median of its rounds, and INT2's ratios the median
    of each round's ratio to its nearest baseline (the same class and kernel, quantization
    off) and to mlx-lm's cache. "int2_whole" / "bf16_latent_whole": the same caches with every
    segment read whole, not in pieces (`decode_e2e.whole_segments`)."""
    names = ("int2", "int2_previous", "bf16_latent", "bf16")
    pieces = 0 < segment_read.PIECE < ctx  # else no segment is cut: "_whole" is the same read
    if pieces:
        names += ("int2_whole", "bf16_latent_whole")
    modes = {"int2_previous": previous_read, "int2_whole": whole_segments}
    modes["bf16_latent_whole"] = whole_segments
    cs = {w: caches(s, w) for w in HELD}
    for w in HELD:
        fill(cs[w], ctx, s)
    runs = {w: [] for w in names}
    cpu = {w: [] for w in names}  # each step's CPU time (every thread's)
    tok = mx.array([[1]])
    for _ in range(rounds):
        for w in names:
            c = cs[w.removesuffix("_previous").removesuffix("_whole")]
            with modes.get(w, nullcontext)():
                mx.eval(s.model(tok, cache=c))  # warm-up
                t = time.perf_counter()
                for _ in range(steps):
                    c0 = time.process_time()
                    mx.eval(s.model(tok, cache=c))
                    cpu[w].append(time.process_time() - c0)
                runs[w].append(steps / (time.perf_counter() - t))
            for x in c:
                x.trim(steps + 1)

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(runs[a], runs[b]))

    def low(w):  # a step's CPU time when nothing else got in its way: 20th percentile
        return sorted(cpu[w])[len(cpu[w]) // 5]

    out = {w: statistics.median(v) for w, v in runs.items()}
    out["int2_vs_bf16_latent"] = ratio("int2", "bf16_latent")
    out["int2_vs_mlx_lm"] = ratio("int2", "bf16")
    out["int2_previous_vs_bf16_latent"] = ratio("int2_previous", "bf16_latent")
    out["cpu_tok_s"] = {w: 1 / low(w) for w in names}
    out["cpu_int2_vs_bf16_latent"] = low("bf16_latent") / low("int2")
    out["cpu_int2_previous_vs_bf16_latent"] = low("bf16_latent") / low("int2_previous")
    if pieces:  # what reading long segments in pieces saves, per cache: > 1 faster than whole
        out["pieces_vs_whole"] = {w: ratio(w, w + "_whole") for w in ("int2", "bf16_latent")}
        out["cpu_pieces_vs_whole"] = {
            w: low(w + "_whole") / low(w) for w in ("int2", "bf16_latent")
        }
        out["cpu_int2_vs_bf16_latent_whole"] = low("bf16_latent_whole") / low("int2_whole")
    out["rounds"] = rounds
    return out


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
    t1, t2, tm = best_of([trunk(1), trunk(2), mtp_step], reps=7)
    head = mx.random.normal((vocab, hidden)).astype(dtype) * 0.01
    mx.eval(head)
    th1, th2 = best_of([lambda: h1 @ head.T, lambda: h2 @ head.T], reps=7)
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
    decode_only: bool = False,
) -> dict:
    """The whole report (see the module docstring). `mac`: mac_projection's bandwidth and
    flops, if not its defaults. `decode_only`: only the decode speed."""
    mac = mac or {}
    c = contexts or {"prefill": (8192, 32768), "held": (1024, 4096, 32768), "decode": (4096, 32768)}
    res = {"model": s.name, "layers": s.layers, "dtype_bf16_check": "bfloat16"}
    if decode_only:
        to_dtype(s, engine_dtype())
        res["dtype"] = str(model_dtype(s.model)).rsplit(".", 1)[-1]
        res["decode_tok_s"] = {}
        for n in c["decode"]:
            progress(f"decode speed at {n:,}")
            res["decode_tok_s"][str(n)] = decode_speed(s, n)
        return res
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
