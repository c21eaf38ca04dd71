"""ModelShape -> what each engine allocates, per token and per sequence.

Public API (`inspect` and `new` call these; report.py wraps them per source):

- `CACHE_KEYS`: the "<engine>/<cache type>" keys.
- `layout(shape, key, ubatch=512, swa_full=False) -> Layout`: the buffers that engine keeps
  for this model. `Layout.supported` is False (with `Layout.reason`) when the engine cannot
  cache the model that way. `Layout.per_token` (bytes per token of context, a Fraction:
  compressed caches add a row every `ratio` tokens), `Layout.state` (bytes per sequence that
  do not grow with context: recurrent states, sliding windows, INT2 bf16 windows) and
  `Layout.bytes_at(ctx)` (exact bytes for one sequence of `ctx` tokens, with the engine's
  padding: llama.cpp pads contexts to 256 cells, mlx-lm grows its KVCache in steps of 256).
- `kv_bytes_per_token(shape, key)`, `state_bytes_per_sequence(shape, key)`: the two numbers,
  None when unsupported.
- `max_context(shape, key, budget_bytes, weights_bytes=0, parallel=1) -> int | None`: the
  longest context per sequence such that weights + parallel x bytes_at(ctx) <= budget,
  capped at the model's own limit (None: unsupported).

The machine's side (the budget, `parse_size`) is budget.py.

Rules, each from the engine's own code (docs/inspect.md shows the reasoning and arithmetic):

- llama.cpp (src/llama-kv-cache*.cpp, llama-model.cpp create_memory): f16 2 B per value,
  q8_0 34 B and q4_0 18 B per 32 values (quantized rows need widths divisible by 32).
  Full attention: K and V rows per cell. MLA (`is_mla`): K only, kv_lora_rank + rope wide;
  DSA: plus an indexer-key row on layers that own an indexer (3 x 128 wide with GLM-5.3's
  k-pool: key | gate | pooled). Sliding layers: min(ctx, window + ubatch) cells per
  sequence, padded to 256, unless --swa-full. Recurrent r/s states: f32 (MiniMax-01's lightning
  layers: s only, head_dim^2 x heads). MiniMax-M3 (llama_kv_cache_msa): plus an indexer cache
  of one key head and one V head per token on its sparse layers. DeepSeek-V4: a
  K-only window cache on every layer, compressed K rows every 4 (CSA) or 128 (HCA) tokens
  plus CSA indexer rows, each padded to 256 cells, and f32 compressor states. nextn (MTP)
  layers are filtered out of the main context's cache.
- mlx-lm (mlx_lm/models/*.py make_cache): bf16. KVCache for full attention;
  RotatingKVCache(window) for sliding layers where the model code uses it; ArraysCache with
  conv tails in the model dtype and recurrent states in fp32; MLA caches latent + rope
  (deepseek_v3 family) or expands K and V per head (deepseek_v2, minicpm3, youtu_llm); DSA
  models keep a bf16 indexer key on every layer, shared or not, and deepseek_v32's Indexer a
  zero-filled values array as large. This is the modelled row; where mlx-lm has the model type,
  inspect shows what it measures instead (mlx_measure.py, `measured_layout`).
- macserve/int2 (MLA only): latent as 2-bit affine groups of 64 with a bf16 scale and bias
  (L/4 + L/64 x 4 B), or per layer the format a calibration's plan names (int2_format.py:
  INT2 g128, INT3, INT4, bf16 with no bf16 windows), rope key as 8-bit groups of 64 (R + ceil(R/64) x 4 B); the first 64
  and last 512 tokens of a sequence, and 16 rows of slack for an exact trim, also kept in
  bf16 (a fixed per-sequence cost); a DSA
  indexer key as 8-bit groups of 64 (D + ceil(D/64) x 4 B); every other cache as in mlx/bf16.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

from ..cache_kinds import LONG_WINDOW_STEP, CacheKind
from ..errors import MacserveError
from ..int2_format import BF16_LATENT, INT2, LatentQuant, format_name
from .arch import MLA, Compressed, Full, Linear, ModelShape, NoCache, Sliding
from .kv_buffers import Buffer, Layout
from .kv_buffers import Unsupported as _Unsupported
from .kv_buffers import unsupported as _unsupported
from .kv_llama import llama_layout
from .mlx_measure import engine_name, mlx_lm_dir, utils_constant

MLX_KEY, INT2_KEY = CacheKind.BF16.inspect_key, CacheKind.INT2.inspect_key  # cache_kinds.py
LATENT_ROWS, WINDOW_ROWS = "latent + rope", "bf16 sink + recent + slack rows"  # int2's buffers
CACHE_KEYS = (MLX_KEY, "llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0", INT2_KEY)
LLAMA_UBATCH = 512  # llama-server's default -ub


def measured_layout(m, key: str = MLX_KEY) -> Layout:
    """A Layout from mlx_measure.Measured: one buffer per growing or fixed part of each cache
    object the engine made (ring buffers as windows, so short contexts are not overcounted)."""
    bufs = []
    for c in m.caches:
        # each part apart: what is in the model's dtype (model_dtype) and what is not
        for per, fixed, dt in (
            (c.model_per_token, c.model_fixed, True),
            (c.per_token - c.model_per_token, c.fixed - c.model_fixed, False),
        ):
            if per:
                bufs.append(Buffer(c.index, c.cls, per.numerator, "token", per.denominator, 0, dt))
            if c.window and fixed and fixed % c.window == 0:
                what = f"{c.cls} (window)"
                bufs.append(Buffer(c.index, what, fixed // c.window, "window", 1, c.window, dt))
            elif fixed:
                bufs.append(Buffer(c.index, f"{c.cls} (fixed)", fixed, "fixed", 1, 1, dt))
    return Layout(key, bufs, origin="measured", engine=m.engine)


# ---------------------------------------------------------------------------------------
# llama.cpp


# ---------------------------------------------------------------------------------------
# mlx-lm (and the macserve engine built on it)

# Read from mlx_lm/models/*.py: which MLA modules cache the latent (update_and_fetch of
# kv_latent, k_pe) and which decompress and cache K and V per head.
MLX_MLA_LATENT = {
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k25",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "kimi_k3",
    "kimi_linear",
    "kimi_vl",
    "longcat_flash",
    "mistral4",
    "bailing_hybrid",
    "bailing_moe_v3",
}
MLX_MLA_EXPANDED = {"deepseek_v2", "minicpm3", "youtu_llm"}


@dataclass(frozen=True)
class MlxModule:
    """Which mlx-lm module would load this model_type (None: mlx-lm has none)."""

    name: str | None
    version: str | None
    uses_rotating_cache: bool  # the module's make_cache uses RotatingKVCache
    indexer_zero_values: bool = False  # deepseek_v32's Indexer: values = zeros_like(keys)


@cache
def mlx_module(model_type: str) -> MlxModule:
    """The module mlx-lm loads for `model_type`, and whether its code (or a sibling module it
    takes its model from: gemma3 -> gemma3_text, glm_moe_dsa -> deepseek_v32) makes a
    RotatingKVCache. Read from mlx-lm's files; importing them would import mlx."""
    d = mlx_lm_dir()
    if d is None:
        return MlxModule(None, None, False)
    version = engine_name().partition(" ")[2]
    name = utils_constant("MODEL_REMAPPING").get(model_type, model_type)
    path = d / "models" / f"{name}.py"
    if not path.exists():
        return MlxModule(None, version, False)
    src = path.read_text()
    for base in set(_siblings(src)):
        p = d / "models" / f"{base}.py"
        if p.exists():
            src += p.read_text()
    return MlxModule(
        name, version, "RotatingKVCache(" in src, "cache.values = mx.zeros_like(cache.keys)" in src
    )


def _siblings(src: str):
    """Model modules this one imports (`from .deepseek_v32 import Model`, `from . import
    gemma3_text`), not the shared helpers."""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            yield from (n for n in names if n not in _HELPERS)


_HELPERS = {"cache", "base", "activations", "rope_utils", "switch_layers", "pipeline", "mla"}


def _mlx_layer(i: int, l, mod: MlxModule, int2: bool, q: LatentQuant = INT2) -> list[Buffer]:
    """`q`: the latent's format on this layer with int2 (a calibration's plan, else INT2).
    `model_dtype`: mlx-lm's arrays in the activations' dtype (float32 in the engine on a CPU
    host: host.py); not the fp32 states, nor the INT2 cache's rows (stored from bf16)."""
    bf16 = 2
    if isinstance(l, NoCache):
        return []
    if isinstance(l, Full):
        out = [
            Buffer(i, "K", bf16 * l.kv_heads * l.k_dim, "token", model_dtype=True),
            Buffer(i, "V", bf16 * l.kv_heads * l.v_dim, "token", model_dtype=True),
        ]
        if l.indexer:
            # MiniMax-M3's MSA indexer key (mlx-lm has no module for it: modelled on the
            # KVCache-held key of deepseek_v32's indexer, without its zero-filled values).
            out.append(Buffer(i, "indexer key", bf16 * l.indexer, "token", model_dtype=True))
        return out
    if isinstance(l, Sliding):
        k, v = bf16 * l.kv_heads * l.k_dim, bf16 * l.kv_heads * l.v_dim
        if l.chunked:
            # ChunkedKVCache (llama4): the chunk, plus the 256-row step it allocates past it
            # before the next call trims the front (cache.py, update_and_fetch).
            return [
                Buffer(i, "K (chunk)", k, "window", rows=l.window + 256, model_dtype=True),
                Buffer(i, "V (chunk)", v, "window", rows=l.window + 256, model_dtype=True),
            ]
        if mod.name and not mod.uses_rotating_cache:
            # The model code makes a plain KVCache for every layer: sliding layers grow too.
            return [
                Buffer(i, "K (sliding, kept in full)", k, "token", model_dtype=True),
                Buffer(i, "V (sliding, kept in full)", v, "token", model_dtype=True),
            ]
        return [
            Buffer(i, "K (window)", k, "window", rows=l.window, model_dtype=True),
            Buffer(i, "V (window)", v, "window", rows=l.window, model_dtype=True),
        ]
    if isinstance(l, Linear):
        # ArraysCache: conv tail in the activations' dtype, gated-delta/SSM state in fp32.
        return [
            Buffer(i, "conv state (bf16)", bf16 * l.conv_elems, "fixed", rows=1, model_dtype=True),
            Buffer(i, "recurrent state (f32)", 4 * l.state_elems, "fixed", rows=1),
        ]
    if isinstance(l, MLA):
        if int2:
            what = f"{LATENT_ROWS} ({format_name(q)}/{'bf16' if q.bits is None else 'int8'})"
            out = [Buffer(i, what, q.row_bytes(l.latent, l.rope), "token")]
            # what the engine holds after a prefill (the allocator's figure, bench engine):
            # 64 + 512 tokens and the 16 rows kept for an exact trim (none for a bf16 layer)
            bf = BF16_LATENT.row_bytes(l.latent, l.rope)
            if q.bf16_rows():
                out.append(Buffer(i, WINDOW_ROWS, bf, "fixed", rows=q.bf16_rows()))
        elif mod.name in MLX_MLA_EXPANDED:
            out = [
                Buffer(i, "K per head", bf16 * l.heads * l.k_head, "token", model_dtype=True),
                Buffer(i, "V per head", bf16 * l.heads * l.v_head, "token", model_dtype=True),
            ]
        elif mod.name is None or mod.name in MLX_MLA_LATENT:
            out = [
                Buffer(i, "latent", bf16 * l.latent, "token", model_dtype=True),
                Buffer(i, "rope key", bf16 * l.rope, "token", model_dtype=True),
            ]
        else:
            raise _Unsupported(f"mlx-lm's {mod.name} MLA cache layout is not verified here")
        if l.indexer and int2:
            # macserve's engine (engine/dsa_indexer.py): the same key on every layer, 8-bit
            # groups of 64 with a bf16 scale and bias, and no zero-filled values array.
            bits = "bf16" if q.bits is None else f"int{q.index_bits}"
            out.append(Buffer(i, f"indexer key ({bits})", q.index_row_bytes(l.indexer), "token"))
        elif l.indexer:
            # deepseek_v32's Indexer caches every token's key on every layer (it ignores
            # indexer_types and pools nothing) with update_and_fetch(k, k), then sets
            # `cache.values = mx.zeros_like(cache.keys)`: a zero-filled array as large as
            # the keys, allocated all the same.
            out.append(Buffer(i, "indexer key", bf16 * l.indexer, "token", model_dtype=True))
            if mod.indexer_zero_values:
                out.append(
                    Buffer(i, "indexer values (zeros)", bf16 * l.indexer, "token", model_dtype=True)
                )
        return out
    if isinstance(l, Compressed):
        if int2:
            raise _Unsupported("the INT2 latent format is defined for MLA layers only")
        # deepseek_v41.LayerCache: the last `window` rows, closed compressed groups, their
        # index keys, and the open group's rows in fp32 (kv and gate).
        kv, n = bf16 * l.head_dim, l.ratio
        out = [Buffer(i, "K=V (window)", kv, "window", rows=l.window, model_dtype=True)]
        if n:
            out.append(Buffer(i, f"compressed K=V (1/{n})", kv, "token", n, model_dtype=True))
            if n > 1:
                out.append(
                    Buffer(i, "open group (f32 kv + gate)", 2 * 4 * l.head_dim, "fixed", rows=n - 1)
                )
        if l.indexer:
            key = bf16 * l.indexer
            out.append(Buffer(i, f"indexer key (1/{n})", key, "token", n, model_dtype=True))
        return out
    raise TypeError(l)


def _mlx_layout(layers: list, key: str, mod: MlxModule, int2: bool, plan=None) -> Layout:
    """`plan`: with int2, one LatentQuant per MLA layer (a calibration's), else INT2 on all."""
    mla = [i for i, l in enumerate(layers) if isinstance(l, MLA)]
    if int2 and not mla:
        return _unsupported(key, "no MLA layers: the INT2 latent cache does not apply")
    if plan is not None and len(plan) != len(mla):
        return _unsupported(
            key, f"the calibration's plan has {len(plan)} layers, the model {len(mla)} MLA layers"
        )
    per_layer = dict(zip(mla, plan or [INT2] * len(mla)))
    try:
        bufs = [
            b
            for i, l in enumerate(layers)
            for b in _mlx_layer(i, l, mod, int2, per_layer.get(i, INT2))
        ]
    except _Unsupported as e:
        return _unsupported(key, str(e))
    return Layout(key, bufs)


# ---------------------------------------------------------------------------------------


def layout(
    shape: ModelShape,
    key: str,
    ubatch: int = LLAMA_UBATCH,
    swa_full: bool = False,
    mtp: bool = False,
    plan: list[LatentQuant] | None = None,
) -> Layout:
    """The buffers engine `key` keeps for `shape`'s trunk layers (or its MTP layers).
    `plan`: for macserve/int2, the format of each MLA layer (a calibration file's plan)."""
    layers = shape.mtp_layers if mtp else shape.layers
    engine, _, t = key.partition("/")
    if engine == "llama.cpp" and t in ("f16", "q8_0", "q4_0"):
        return llama_layout(layers, key, t, ubatch, swa_full)
    if engine in ("mlx", "macserve") and shape.source_format == "gguf":
        return _unsupported(key, "MLX engines load safetensors, not GGUF")
    if key == MLX_KEY:
        return _mlx_layout(layers, key, mlx_module(shape.model_type), int2=False)
    if key == INT2_KEY:
        return _mlx_layout(layers, key, mlx_module(shape.model_type), int2=True, plan=plan)
    raise MacserveError(f"unknown cache type {key!r}; one of {', '.join(CACHE_KEYS)}")


def auto_figures(int2: Layout, ctx: int) -> tuple[int, int, int]:
    """macserve's `auto` cache at `ctx`, from the macserve/int2 layout (a calibration's plan):
    (one sequence's bytes with int2's window, one more bf16 window row's bytes over the layers
    that store codes, one sequence's bytes with every row bf16): cache_kinds.auto_window's
    figures. All bf16: each such layer's code rows become bf16 rows, CTX of them plus a decode
    step's headroom, in place of its fixed window rows."""
    base = int2.bytes_at(ctx)
    cells = -(-ctx // int2.pad) * int2.pad if ctx > 0 else 0  # as Layout.bytes_at pads
    row, full = 0, base
    # rows a decode step grows an all-bf16 window by, held past CTX: the server runs every row
    # bf16 as auto's unbounded window (server/capacity.fitted), which grows in long steps
    # (engine/latent_cache.py) whatever the CTX
    headroom = LONG_WINDOW_STEP
    windows = {b.layer: b for b in int2.buffers if b.what == WINDOW_ROWS}
    for b in int2.buffers:
        w = windows.get(b.layer)
        if w is not None and b.what.startswith(LATENT_ROWS):
            row += w.row
            full += w.row * (cells + headroom - w.rows) - b.row * cells
    return base, row, full


def engine_notes(shape: ModelShape) -> list[str]:
    """What the user should know about how a figure was reached for this model."""
    notes = list(shape.notes)
    if shape.source_format == "config":
        mod = mlx_module(shape.model_type)
        if mod.name is None and mod.version:
            notes.append(
                f"mlx-lm {mod.version} has no module for {shape.model_type!r}: the mlx "
                "figures are modelled on its usual cache classes (docs/inspect.md)"
            )
    return notes


def as_number(x: Fraction):
    return int(x) if x.denominator == 1 else round(float(x), 3)


def kv_bytes_per_token(shape: ModelShape, key: str):
    lay = layout(shape, key)
    return as_number(lay.per_token) if lay.supported else None


def state_bytes_per_sequence(shape: ModelShape, key: str) -> int | None:
    lay = layout(shape, key)
    return lay.state if lay.supported else None


def max_context(
    shape: ModelShape,
    key: str,
    budget_bytes: int,
    weights_bytes: int = 0,
    parallel: int = 1,
    lay: Layout | None = None,
) -> int | None:
    """Longest context per sequence with weights + parallel x bytes_at(ctx) <= budget."""
    lay = lay or layout(shape, key)
    if not lay.supported:
        return None
    limit = shape.max_position_embeddings or 2**31
    free = budget_bytes - (weights_bytes or 0)

    def fits(n):
        return parallel * lay.bytes_at(n) <= free

    if not fits(0):
        return 0
    if fits(limit):
        return limit
    lo, hi = 0, limit  # bytes_at is monotone: fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
