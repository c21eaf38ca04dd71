"""ModelShape -> bytes per token and per sequence, per engine and cache type; the budget.

Public API (used by `inspect` and by `new` to size a context):
- `CACHE_KEYS`: the "<engine>/<cache type>" keys.
- `kv_bytes_per_token(shape, key)` -> int | None (None: that engine cannot cache this model).
- `state_bytes_per_sequence(shape, key)` -> int: fixed state (recurrent layers, sliding
  ring buffers, the INT2 cache's bf16 sink/recent windows).
- `machine_budget(memory_bytes=None)` -> Budget.
- `max_context(shape, key, budget_bytes, weights_bytes, parallel=1)` -> int.

Rules, from each engine's code:
- llama.cpp: MLA caches K only (latent + rope, "MQA over the latent"); q8_0 is 34 B per 32
  values, q4_0 18 B per 32; sliding layers keep window + ubatch (512) cells per sequence;
  recurrent states are f32; nextn (MTP) layers get no cache in the main context.
- mlx-lm: bf16; deepseek_v2 expands K (nope + rope) and V per head; the other MLA models
  cache the latent + rope; DSA models keep an indexer key (bf16) on every layer, shared or
  not; sliding layers are RotatingKVCache(window); recurrent conv tails in bf16 and states
  in fp32.
- macserve/int2 (MLA only): latent as 2-bit affine groups of 64 with bf16 scale + bias,
  rope key as 8-bit groups of 64, an owned indexer key as 8-bit groups of 64; the first
  64 and last 256 tokens of a sequence stay bf16 (a fixed cost per sequence).
"""

from __future__ import annotations

import math
import platform
import subprocess
from dataclasses import dataclass

from .arch import MLA, Full, Linear, ModelShape, NoCache, Sliding

CACHE_KEYS = ("mlx/bf16", "llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0", "macserve/int2")
INT2_SINK, INT2_RECENT = 64, 256
LLAMA_UBATCH = 512


def _llama_bytes(elems: int, t: str) -> int:
    if t == "f16":
        return 2 * elems
    block = {"q8_0": 34, "q4_0": 18}[t]
    return math.ceil(elems / 32) * block


def _affine_bytes(elems: int, bits: int) -> int:
    """mx.quantize layout: packed values + one bf16 scale and bias per group of 64."""
    return elems * bits // 8 + math.ceil(elems / 64) * 4


def _mla_int2(l: MLA) -> int:
    idx = 0
    if l.indexer and not l.indexer_shared:
        idx = _affine_bytes(l.indexer, 8) // l.indexer_pool
    return _affine_bytes(l.latent, 2) + (_affine_bytes(l.rope, 8) if l.rope else 0) + idx


def _mla_mlx(l: MLA, model_type: str) -> int:
    if model_type == "deepseek_v2":
        return l.heads * (l.k_head + l.v_head) * 2
    return (l.latent + l.rope) * 2 + (l.indexer * 2) // l.indexer_pool


def layer_bytes_per_token(l, key: str, model_type: str) -> int | None:
    engine, t = key.split("/")
    if isinstance(l, (Sliding, Linear, NoCache)):
        return 0
    if isinstance(l, Full):
        if engine == "macserve":
            return None
        if engine == "mlx":
            return l.kv_heads * (l.k_dim + l.v_dim) * 2
        return _llama_bytes(l.kv_heads * l.k_dim, t) + _llama_bytes(l.kv_heads * l.v_dim, t)
    if isinstance(l, MLA):
        if engine == "mlx":
            return _mla_mlx(l, model_type)
        if engine == "macserve":
            return _mla_int2(l)
        if l.indexer:
            return None  # llama.cpp's DSA cache layout is not modelled here
        return _llama_bytes(l.latent + l.rope, t)
    raise TypeError(l)


def layer_state_bytes(l, key: str, model_type: str) -> int | None:
    engine, t = key.split("/")
    if isinstance(l, Linear):
        if engine == "macserve":
            return None
        conv = 2 if engine == "mlx" else 4
        return l.conv_elems * conv + l.state_elems * 4
    if isinstance(l, Sliding):
        if engine == "macserve":
            return None
        cells = l.window if engine == "mlx" else l.window + LLAMA_UBATCH
        per = Full(l.kv_heads, l.k_dim, l.v_dim)
        return cells * layer_bytes_per_token(per, key, model_type)
    if isinstance(l, MLA) and engine == "macserve":
        bf16 = _mla_mlx(MLA(l.latent, l.rope, l.heads, l.k_head, l.v_head,
                            l.indexer if not l.indexer_shared else 0, False, l.indexer_pool), "")
        return (INT2_SINK + INT2_RECENT) * (bf16 - _mla_int2(l))
    return 0


def _sum(shape: ModelShape, key: str, fn) -> int | None:
    total = 0
    for l in shape.layers:
        b = fn(l, key, shape.model_type)
        if b is None:
            return None
        total += b
    return total


def kv_bytes_per_token(shape: ModelShape, key: str) -> int | None:
    return _sum(shape, key, layer_bytes_per_token)


def state_bytes_per_sequence(shape: ModelShape, key: str) -> int | None:
    return _sum(shape, key, layer_state_bytes)


@dataclass
class Budget:
    total_bytes: int
    budget_bytes: int
    wired_limit_bytes: int | None
    source: str


def _wired_limit_mb() -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True,
                             text=True, timeout=2)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def default_working_set(total: int) -> int:
    """Metal's default GPU working set with iogpu.wired_limit_mb=0: about 2/3 of RAM up to
    36 GB, 3/4 above (Apple's recommendedMaxWorkingSetSize on current Macs)."""
    return int(total * (0.75 if total > 36 * 2**30 else 2 / 3))


def machine_budget(memory_bytes: int | None = None) -> Budget:
    if memory_bytes is not None:
        return Budget(memory_bytes, default_working_set(memory_bytes), None, "--memory (default working set)")
    import psutil

    total = psutil.virtual_memory().total
    if platform.system() == "Darwin":
        mb = _wired_limit_mb()
        if mb:
            return Budget(total, mb * 2**20, mb * 2**20, "iogpu.wired_limit_mb")
        ws = default_working_set(total)
        return Budget(total, ws, ws, "default GPU working set (iogpu.wired_limit_mb=0)")
    return Budget(total, default_working_set(total), None, "total memory (psutil), Mac rule")


def max_context(shape: ModelShape, key: str, budget_bytes: int, weights_bytes: int,
                parallel: int = 1) -> int | None:
    """Tokens per sequence that fit beside the weights for `parallel` sequences (None: the
    engine cannot run this model; unbounded when nothing grows: the model's own limit)."""
    per = kv_bytes_per_token(shape, key)
    state = state_bytes_per_sequence(shape, key)
    if per is None or state is None:
        return None
    free = budget_bytes - weights_bytes - parallel * state
    if free <= 0:
        return 0
    limit = shape.max_position_embeddings or 2**31
    if per == 0:
        return limit
    return min(limit, free // (per * parallel))


def parse_size(text: str) -> int:
    s = text.strip().upper().replace("IB", "B")
    units = {"TB": 2**40, "GB": 2**30, "MB": 2**20, "KB": 2**10, "T": 2**40, "G": 2**30,
             "M": 2**20, "K": 2**10, "B": 1}
    for u, m in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, m = s, 1
    try:
        v = float(num)
    except ValueError:
        from .errors import MacserveError

        raise MacserveError(f"not a size: {text!r} (try 256GB)") from None
    return int(v * m)
