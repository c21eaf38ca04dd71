"""What every part of `bench engine` is measured on: the model (a real folder, or a synthetic
one at DeepSeek-V3's width), its caches of each kind, filled as a prefill fills them, and
best-of-N timing."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ...int2_format import BF16_LATENT, INT2, LatentQuant
from .. import mla_attention
from ..caches import make_caches, model_dtype
from ..dsa_indexer import IndexerKeyCache
from ..latent_cache import RotatedLatentCache
from ..model import computes_float32, load
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
    """The loader's rule (model.computes_float32): float32 on the CPU, the model's own on a
    GPU."""
    return mx.float32 if computes_float32() else None


def setup_synthetic(
    kind: str, layers: int, heads: int | None = None, hidden: int | None = None
) -> Setup:
    """The synthetic model at DeepSeek-V3's width; `heads` / `hidden` narrower (tests only:
    see synthetic.config), said in its name."""
    model, mtp = synthetic(kind, layers, mx.bfloat16, heads=heads, hidden=hidden)
    mla_attention.install(model, extra=[mtp.self_attn])
    r = model.args.kv_lora_rank
    rots = [_orthogonal(r, i) for i in range(layers)]
    narrow = f", {heads} heads" if heads else ""
    narrow += f", hidden {hidden}" if hidden else ""
    return Setup(model, mtp, f"synthetic {kind} ({layers} layers{narrow})", rots)


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


def best_of(fns, reps: int) -> list[float]:
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
