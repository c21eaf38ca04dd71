"""`macserve bench kv`: every latent-cache variant against the bf16 latent cache, one run.

Quality is teacher-forced: each window goes through the cache in chunks, so every token is
scored by queries attending through the quantized cache (not a bf16 prefill quantized
afterwards). With a calibration whose gate chose a format per layer, the "gated" variant is
that plan as serve builds it; every variant's per-layer functional error on the held-out text
is measured from its real caches (stored_error.py) and set against the gate's target. Speed is decode tokens/s with the cache pre-filled to each context length,
as a ratio to the bf16 latent cache (the same class with quantization off) timed in the
same process, variant and baseline interleaved. Free greedy generations from held-out prompts,
against bf16's, are generation.py's (what teacher forcing cannot see: a flipped argmax that
sends a long generation elsewhere); `--variants windows` sets the window sizes against them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList

from ...int2_format import BF16_LATENT as BF16
from ...int2_format import INT2, LatentQuant
from ..calibration import DEFAULT_METHOD, METHODS, Calibration, caches_for
from . import generation
from .stored_error import StoredError

NO_WINDOWS = dict(sink=0, recent=0)


@dataclass(frozen=True)
class Variant:
    name: str
    quant: LatentQuant
    method: str | None
    default: bool = False

    @property
    def windows(self) -> bool:
        return self.quant.bits is not None and (self.quant.sink > 0 or self.quant.recent > 0)

    def bytes_per_token_per_layer(self, rank: int, rope: int, calibration) -> float:
        if self.method != "gate":
            return self.quant.bytes_per_token(rank, rope)
        qs = calibration.quants("gate", self.quant)
        return sum(q.row_bytes(rank, rope) for q in qs) / len(qs)

    @property
    def speed_key(self) -> str:
        """Which decode-speed measurement stands for this variant."""
        return "gated" if self.method == "gate" else "int4" if self.quant.bits == 4 else "int2"


GATED = "gated (the calibration's plan)"
SETS = ("all", "gate", "windows")  # `bench kv --variants`
WINDOWS = [(sink, recent) for sink in (64, 128) for recent in (256, 512)]  # --variants windows
# The windows set's control: a window longer than any context here, so no token becomes a code.
# What it diverges from bf16 by (the rotation, rows rounded to bf16 in the rotated basis), no
# window setting can remove: a greedy near-tie flips on it as on the codes.
NO_CODES = 1 << 20


def gate_variants(calibration: Calibration) -> list[Variant]:
    """The gate's comparison: uniform INT2 and INT4 with the file's one method, and the plan."""
    m = calibration.meta.get("default", DEFAULT_METHOD)
    return [
        Variant(f"int2 {m} (uniform)", INT2, m),
        Variant(f"int4 {m} (uniform)", replace(INT2, bits=4), m),
        Variant(GATED, INT2, "gate", default=True),
    ]


def window_variants(calibration: Calibration) -> list[Variant]:
    """The cache that `--kv int2` serves from this file (the plan if it has one, else its default
    method at INT2), at each sink/recent window setting of WINDOWS, then with no codes."""
    m = calibration.default_method
    label = GATED.split(" (")[0] if m == "gate" else f"int2 {m}"
    return [
        Variant(
            f"{label} sink {sink} recent {recent}",
            replace(INT2, sink=sink, recent=recent),
            m,
            default=(sink, recent) == (INT2.sink, INT2.recent),
        )
        for sink, recent in WINDOWS
    ] + [Variant(f"{label} no codes (control)", replace(INT2, recent=NO_CODES), m)]


def variants(default_method: str = DEFAULT_METHOD, gated: bool = False) -> list[Variant]:
    # With a plan, the plan is what --kv int2 serves: it is the default row.
    out = [Variant(GATED, INT2, "gate", default=True)] if gated else []
    for windows in (True, False):
        q = INT2 if windows else replace(INT2, **NO_WINDOWS)
        tag = "" if windows else " no-windows"
        for m in METHODS:
            default = windows and m == default_method and not gated
            out.append(Variant(f"int2 {m}{tag}", q, m, default=default))
        out.append(
            Variant(
                f"int2 {default_method} row-quantile{tag}",
                replace(q, row_quantile=0.96),
                default_method,
            )
        )
        out.append(
            Variant(
                f"int2 {default_method} rope-bf16{tag}", replace(q, rope_bits=None), default_method
            )
        )
        out.append(Variant(f"int4 {default_method}{tag}", replace(q, bits=4), default_method))
    return out


def _logprobs(model, caches, ids: np.ndarray, chunk: int) -> mx.array:
    outs = []
    for s in range(0, len(ids), chunk):
        out = model(mx.array(ids[None, s : s + chunk]), cache=caches)
        lp = out[0].astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        mx.eval(lp)
        outs.append(lp)
    return mx.concatenate(outs, axis=0)


def _log_normalized64(lp: mx.array) -> np.ndarray:
    x = np.array(lp, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def _greedy(model, caches, prompt: np.ndarray, n: int, chunk: int) -> list[int]:
    lp = _logprobs(model, caches, prompt, chunk)
    tok = int(mx.argmax(lp[-1]).item())
    out = [tok]
    for _ in range(n - 1):
        logits = model(mx.array([[tok]]), cache=caches)
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
    return out


def quality(
    model,
    variant_list,
    windows,
    calibration,
    chunk=64,
    gen_tokens=256,
    prompt_tokens=256,
    progress=None,
) -> dict[str, dict]:
    """Per variant: nll, KL and top-1 agreement vs bf16 logits, greedy agreement."""
    res = {
        v.name: dict(nll=0.0, kl=0.0, top1=0.0, n=0, gen_agree=0.0, gen_n=0) for v in variant_list
    }
    stored = {v.name: StoredError(model) for v in variant_list}
    ref_nll = 0.0
    ref_n = 0
    steps = len(windows) * (len(variant_list) + 1)
    done = 0
    for w in windows:
        x, y = w[:-1], mx.array(w[1:])
        ref = _logprobs(model, caches_for(model, BF16), x, chunk)
        ref_nll += -float(mx.take_along_axis(ref, y[:, None], axis=-1).sum())
        ref_n += len(x)
        ref64 = _log_normalized64(ref)
        p_ref = np.exp(ref64)
        ref_gen = _greedy(model, caches_for(model, BF16), w[:prompt_tokens], gen_tokens, chunk)
        done += 1
        for v in variant_list:
            caches = caches_for(model, v.quant, calibration, v.method)
            with stored[v.name].watching():
                lp = _logprobs(model, caches, x, chunk)
            stored[v.name].add(caches)
            r = res[v.name]
            r["nll"] += -float(mx.take_along_axis(lp, y[:, None], axis=-1).sum())
            # In float64, each side renormalized: KL of two proper distributions is >= 0 up
            # to float64 rounding, whatever BLAS summed the float32 logits.
            r["kl"] += float((p_ref * (ref64 - _log_normalized64(lp))).sum())
            r["top1"] += float((mx.argmax(lp, -1) == mx.argmax(ref, -1)).sum())
            r["n"] += len(x)
            gen = _greedy(
                model,
                caches_for(model, v.quant, calibration, v.method),
                w[:prompt_tokens],
                gen_tokens,
                chunk,
            )
            r["gen_agree"] += sum(a == b for a, b in zip(gen, ref_gen))
            r["gen_n"] += gen_tokens
            done += 1
            if progress:
                progress(done, steps)
    out = {"bf16": {"ppl": math.exp(ref_nll / ref_n)}}
    for name, r in res.items():
        ppl = math.exp(r["nll"] / r["n"])
        out[name] = {
            "ppl": ppl,
            "delta_ppl_pct": 100.0 * (ppl / out["bf16"]["ppl"] - 1.0),
            "kl": r["kl"] / r["n"],
            "top1_agreement": r["top1"] / r["n"],
            "greedy_agreement": r["gen_agree"] / r["gen_n"],
            "layer_errors": stored[name].errors(),
        }
    return out


def fill_latents(caches, ctx: int, rank: int, rope: int, seed: int = 0, index_dims: int = 0):
    """Pre-fill caches with `ctx` latent-shaped tokens; speed does not depend on their values.
    (bench kv's decode speed and bench dsa's both time decode over caches filled so.)"""
    key = mx.random.key(seed)
    for c in caches:
        parts = list(c.caches) if isinstance(c, CacheList) else [c]
        for s in range(0, ctx, 1024):
            n = min(1024, ctx - s)
            k1, k2, k3, key = mx.random.split(key, 4)
            parts[0].append(
                mx.random.normal((1, 1, n, rank), key=k1), mx.random.normal((1, 1, n, rope), key=k2)
            )
            if len(parts) > 1:
                parts[1].append(mx.random.normal((1, 1, n, index_dims), key=k3))
        mx.eval([a for p in parts for a in p.arrays()])


def decode_speed(
    model,
    quants: dict[str, LatentQuant | tuple[LatentQuant, str]],
    calibration,
    method,
    contexts,
    steps: int = 16,
    rounds: int = 3,
) -> dict[str, dict[int, float]]:
    """Decode tokens/s per named quant and context (a (quant, method) pair: that method, not
    `method`); rounds interleave the variants."""
    attn = model.layers[0].self_attn
    rank, rope = attn.kv_lora_rank, attn.qk_rope_head_dim
    out = {name: {} for name in quants}
    for ctx in contexts:
        best = {name: 0.0 for name in quants}
        caches = {}
        for name, q in quants.items():
            q, m = q if isinstance(q, tuple) else (q, method)
            caches[name] = caches_for(model, q, calibration, m if q.bits else None)
            indexer = getattr(attn, "indexer", None)
            fill_latents(
                caches[name], ctx, rank, rope, index_dims=indexer.head_dim if indexer else 0
            )
        for _ in range(rounds):
            for name in quants:
                cs = caches[name]
                tok = mx.array([[1]])
                mx.eval(model(tok, cache=cs))  # warm-up
                t = time.perf_counter()
                for _ in range(steps):
                    logits = model(tok, cache=cs)
                    mx.eval(logits)
                dt = time.perf_counter() - t
                for c in cs:
                    c.trim(steps + 1)
                best[name] = max(best[name], steps / dt)
        for name in quants:
            out[name][ctx] = best[name]
    return out


def rows(
    model,
    calibration: Calibration,
    windows,
    contexts=(1024, 4096, 16384),
    chunk=64,
    gen_tokens=256,
    progress=None,
    gen_progress=None,
    speed_steps=16,
    which: str = "all",
    gen_prompts: list[list[int]] = (),
    gen_max_tokens: int = 700,
    eos=frozenset(),
) -> list[dict]:
    """The table: bf16 first, then the variants of set `which` ("all"; "gate": uniform INT2
    and INT4 against the calibration's plan; "windows": the served cache at each window
    setting), each with its measured per-layer error, the worst layer's, and whether that is
    within the gate's target; and with `gen_prompts`, the free-generation columns
    (generation.py) of bf16 and of every variant ("all": of the default and gated ones)."""
    attn = model.layers[0].self_attn
    rank, rope = attn.kv_lora_rank, attn.qk_rope_head_dim
    default = calibration.meta.get("default", DEFAULT_METHOD)
    gated = calibration.default_method == "gate"
    if which == "gate":
        if not gated:
            raise ValueError("the calibration has no gate plan (make one with macserve calibrate)")
        vs = gate_variants(calibration)
    elif which == "windows":
        vs = window_variants(calibration)
    else:
        vs = variants(default, gated)
    gen = {}
    if gen_prompts:
        gen_vs = [v for v in vs if which != "all" or v.default or v.method == "gate"]
        makers = {"bf16": lambda: caches_for(model, BF16)}
        for v in gen_vs:
            makers[v.name] = lambda v=v: caches_for(model, v.quant, calibration, v.method)
        gen = generation.run(
            model, makers, list(gen_prompts), gen_max_tokens, eos, progress=gen_progress
        )
    q = quality(
        model, vs, windows, calibration, chunk=chunk, gen_tokens=gen_tokens, progress=progress
    )
    speed_quants = {"bf16": BF16, "int2": INT2, "int4": replace(INT2, bits=4)}
    if gated:
        speed_quants["gated"] = (INT2, "gate")
    speed = decode_speed(model, speed_quants, calibration, default, contexts, steps=speed_steps)
    longest = max(contexts)
    target = (calibration.meta.get("gate") or {}).get("target")
    table = [
        {
            "variant": "bf16 latent",
            "default": False,
            "windows": False,
            "bytes_per_token_per_layer": BF16.bytes_per_token(rank, rope),
            "ppl": q["bf16"]["ppl"],
            "delta_ppl_pct": 0.0,
            "kl": 0.0,
            "top1_agreement": 1.0,
            "greedy_agreement": 1.0,
            "layer_errors": None,
            "max_layer_error": 0.0,
            "target": target,
            "within_target": True,
            "decode_speed_ratio": 1.0,
            "decode_tokens_per_s": speed["bf16"],
            "sink": None,
            "recent": None,
            **gen.get("bf16", {}),
        }
    ]
    for v in vs:
        worst = max(q[v.name]["layer_errors"])
        table.append(
            {
                "variant": v.name,
                "default": v.default,
                "windows": v.windows,
                "bytes_per_token_per_layer": v.bytes_per_token_per_layer(rank, rope, calibration),
                **q[v.name],
                "max_layer_error": worst,
                "target": target,
                "within_target": None if target is None else worst <= target,
                "decode_speed_ratio": speed[v.speed_key][longest] / speed["bf16"][longest],
                "decode_tokens_per_s": speed[v.speed_key],
                "sink": v.quant.sink,
                "recent": v.quant.recent,
                **gen.get(v.name, {}),
            }
        )
    return table
