"""Which KV cache a generation uses (a frozen spec, resolved once) and how it is built.

    spec = CacheSpec.for_model(model_dir, "int2")        # or "bf16"; rotation found here, once
    opts = EngineOptions(spec, mtp_k=1)                   # what serve / generate run with
    caches = make_caches(model, quant, rotations, clips)  # one RotatedLatentCache per layer

A model folder may ship its calibration as `latent-rotation.safetensors`; `--kv int2` then
needs no `--rotation`. That default is decided in `CacheSpec.for_model` and nowhere else.
A calibration whose gate chose a format per layer (engine/gate.py) gets a cache per layer in
that format: `quant` is then a list, one LatentQuant per layer of the whole model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..errors import MacserveError
from ..int2_format import INT2, SHIPPED_ROTATION, LatentQuant, format_name
from . import mla_attention
from .dsa_indexer import IndexerKeyCache
from .latent_cache import RotatedLatentCache

KINDS = ("bf16", "int2")


@dataclass(frozen=True)
class CacheSpec:
    """`kind` bf16 is mlx-lm's own cache; int2 the rotated INT2 latent cache in `quant`'s
    format with the rotations of calibration file `rotation` (`method`: None = the file's
    default)."""

    kind: str = "bf16"
    rotation: Path | None = None
    quant: LatentQuant = INT2
    method: str | None = None

    @classmethod
    def for_model(
        cls, model_dir: str | Path, kind: str = "bf16", rotation: str | Path | None = None
    ) -> CacheSpec:
        """The spec for a model folder, refusing now what every request would fail on."""
        if kind not in KINDS:
            raise MacserveError(f"kv must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "bf16":
            if rotation is not None:
                raise MacserveError("--rotation applies to the int2 cache; add --kv int2")
            return cls()
        rotation = rotation or shipped_rotation(model_dir)
        if rotation is None:
            raise MacserveError(
                f"--kv int2 needs --rotation FILE: {model_dir} ships no "
                f"{SHIPPED_ROTATION} (make one with macserve calibrate)"
            )
        return cls("int2", Path(rotation))


def shipped_rotation(model_dir: str | Path) -> Path | None:
    """The calibration a model folder ships, if it ships one."""
    p = Path(model_dir).expanduser() / SHIPPED_ROTATION
    return p if p.exists() else None


@dataclass(frozen=True)
class EngineOptions:
    """How a model is run: its cache, MTP draft tokens per round (0: no drafting) and when
    to draft (`mtp`: on, off, or auto: while measured to pay, mtp_auto.py)."""

    cache: CacheSpec = CacheSpec()
    mtp_k: int = 0
    mtp: str = "on"

    def __post_init__(self):
        if not 0 <= self.mtp_k <= 3:
            raise MacserveError("--mtp-k must be 0..3")
        if self.mtp not in ("auto", "on", "off"):
            raise MacserveError(f"--mtp must be auto, on or off, not {self.mtp!r}")

    @property
    def drafts(self) -> bool:
        """Drafting may happen (the model's MTP layer is then needed)."""
        return self.mtp_k > 0 and self.mtp != "off"


def make_caches(
    model,
    quant: LatentQuant | list[LatentQuant],
    rotations: list | None = None,
    clips: list | None = None,
) -> list:
    """One cache per trunk layer. `quant`: one format for every layer, or one per layer of
    the whole model (a gated calibration's plan). `rotations`/`clips`: per layer of the whole
    model (from a calibration), None for the unrotated cache. DSA models get mlx-lm's layout,
    CacheList(latent, indexer key), with our two caches."""
    attns = mla_attention.mla_attentions(model)
    n = len(attns)
    # A pipeline rank holds layers [start, start + n) of the whole model.
    start = getattr(getattr(model, "model", None), "start_idx", 0) or 0
    total = getattr(getattr(model, "args", None), "num_hidden_layers", None) or n
    if isinstance(quant, LatentQuant):
        quants = [quant] * n
    elif len(quant) != total:
        raise ValueError(f"the cache plan has {len(quant)} layers, the model {total}")
    else:
        quants = list(quant[start : start + n])
    if rotations is None:
        latents = [RotatedLatentCache(q) for q in quants]
    else:
        if len(rotations) != total:
            raise ValueError(f"calibration has {len(rotations)} layers, the model {total}")
        clips = clips if clips is not None else [None] * total
        latents = [
            RotatedLatentCache(q, r, c)
            for q, r, c in zip(quants, rotations[start : start + n], clips[start : start + n])
        ]
    if not hasattr(attns[0], "indexer"):
        return latents
    return [
        CacheList(c, IndexerKeyCache(q.index_bits if q.quantized else None, q.group_size))
        for c, q in zip(latents, quants)
    ]


def formats(caches) -> list[str]:
    """Per layer, the format its cache actually stores the latent in ("int2-g64", "bf16"),
    read from the cache objects; mlx-lm's own caches by their class ("mlx-lm KVCache")."""
    out = []
    for c in latent_caches(caches):
        is_ours = isinstance(c, RotatedLatentCache)
        out.append(format_name(c.quant) if is_ours else f"mlx-lm {type(c).__name__}")
    return out


def clone(cache):
    """A copy of one layer's cache that shares memory until either side writes: ours through
    their `clone`, mlx-lm's (KVCache and kin) by new array objects over the same buffers, as
    MLX arrays are copy-on-write under slice assignment."""
    if isinstance(cache, CacheList):
        return CacheList(*[clone(c) for c in cache.caches])
    if hasattr(cache, "clone"):
        return cache.clone()
    new = copy.copy(cache)
    for k, v in vars(cache).items():
        if isinstance(v, mx.array):
            setattr(new, k, v[...])
        elif isinstance(v, list):
            setattr(new, k, [x[...] if isinstance(x, mx.array) else x for x in v])
    return new


def cache_bytes(cache) -> int:
    """Every array one layer's cache holds, as allocated."""
    if isinstance(cache, CacheList):
        return sum(cache_bytes(c) for c in cache.caches)
    if isinstance(cache, RotatedLatentCache | IndexerKeyCache):
        return cache.nbytes
    return sum(v.nbytes for v in vars(cache).values() if isinstance(v, mx.array))


def model_dtype(model):
    """The dtype the model computes in (its norms' weights stay unquantized)."""
    return mla_attention.mla_attentions(model)[0].kv_a_layernorm.weight.dtype


def latent_caches(caches) -> list[RotatedLatentCache]:
    """The latent cache of each layer, whether or not the model is DSA."""
    return [c[0] if isinstance(c, CacheList) else c for c in caches]


# -- a cache's stored form, for the server's disk tier -------------------------------------------
#
# What a layer's cache holds, as named arrays and string metadata (safetensors' two parts), and
# back into a fresh cache of the same kind. The INT2 latent cache is stored as it is held: its
# codes, scales and biases and its bf16 sink and window rows, each buffer cut to the rows in
# use; rotations and clips are the calibration's, not the cache's, and come back with the fresh
# cache. mlx-lm's caches go through mlx-lm's own protocol (`state` and `meta_state`, as
# `mlx_lm.models.cache.save_prompt_cache` stores them).

_LATENT_STORES = ("sink_lat", "sink_pe", "codes_lat", "codes_pe", "win_lat", "win_pe")


def _rows_out(rows, key: str, arrays: dict, meta: dict) -> None:
    meta[f"{key}.n"] = str(rows.length)
    meta[f"{key}.parts"] = str(len(rows.parts or ()))
    for j, p in enumerate(rows.parts or ()):
        arrays[f"{key}.{j}"] = p[..., : rows.length, :]


def _rows_in(rows, key: str, arrays: dict, meta: dict) -> None:
    n, parts = int(meta[f"{key}.n"]), int(meta[f"{key}.parts"])
    got = tuple(arrays[f"{key}.{j}"] for j in range(parts))
    if any(p.shape[2] != n for p in got):
        raise ValueError(f"{key}: {n} rows stated, {[p.shape[2] for p in got]} stored")
    rows.parts, rows.length = (got or None), n


def cache_to_arrays(cache, key: str, arrays: dict, meta: dict) -> None:
    """Add one layer's cache to `arrays` / `meta` under `key` (evaluated arrays)."""
    if isinstance(cache, CacheList):
        meta[f"{key}.kind"] = "list"
        meta[f"{key}.n"] = str(len(cache.caches))
        for k, c in enumerate(cache.caches):
            cache_to_arrays(c, f"{key}.{k}", arrays, meta)
    elif isinstance(cache, RotatedLatentCache):
        meta[f"{key}.kind"] = "latent"
        meta[f"{key}.pos"] = f"{cache.offset},{cache.win_start},{cache._dims[0]},{cache._dims[1]}"
        for name in _LATENT_STORES:
            _rows_out(getattr(cache, name), f"{key}.{name}", arrays, meta)
    elif isinstance(cache, IndexerKeyCache):
        meta[f"{key}.kind"] = "indexer"
        meta[f"{key}.pos"] = f"{cache.offset},{cache.dims}"
        _rows_out(cache.keys_rows, f"{key}.rows", arrays, meta)
    else:  # mlx-lm's protocol: `state` (arrays and scalars), `meta_state` (strings)
        meta[f"{key}.kind"] = "mlx:" + type(cache).__name__
        state = cache.state
        state = state if isinstance(state, tuple | list) else (state,)
        meta[f"{key}.n"] = str(len(state))
        for j, x in enumerate(state):
            if isinstance(x, mx.array):
                arrays[f"{key}.{j}"] = x
            elif x is None:
                meta[f"{key}.{j}"] = "none"
            elif isinstance(x, int):
                meta[f"{key}.{j}"] = f"int:{x}"
            else:
                raise ValueError(f"{type(cache).__name__}: state item {type(x).__name__}")
        ms = getattr(cache, "meta_state", None)  # not every mlx-lm version's KVCache has it
        if ms:
            meta[f"{key}.meta"] = ",".join(ms if isinstance(ms, tuple | list) else (ms,))


def cache_from_arrays(fresh, key: str, arrays: dict, meta: dict):
    """`fresh` (a new, empty cache of the kind the server runs) holding what `key` stored;
    ValueError if the stored kind or shape does not fit it."""
    kind = meta.get(f"{key}.kind")
    if isinstance(fresh, CacheList):
        if kind != "list" or int(meta[f"{key}.n"]) != len(fresh.caches):
            raise ValueError(f"{key}: stored {kind}, the model's cache is a CacheList")
        for k, c in enumerate(fresh.caches):
            cache_from_arrays(c, f"{key}.{k}", arrays, meta)
    elif isinstance(fresh, RotatedLatentCache):
        if kind != "latent":
            raise ValueError(f"{key}: stored {kind}, the model's cache is the latent cache")
        off, win, d0, d1 = (int(x) for x in meta[f"{key}.pos"].split(","))
        for name in _LATENT_STORES:
            _rows_in(getattr(fresh, name), f"{key}.{name}", arrays, meta)
        fresh.offset, fresh.win_start, fresh._dims = off, win, (d0, d1)
    elif isinstance(fresh, IndexerKeyCache):
        if kind != "indexer":
            raise ValueError(f"{key}: stored {kind}, the model's cache is an indexer cache")
        off, dims = (int(x) for x in meta[f"{key}.pos"].split(","))
        _rows_in(fresh.keys_rows, f"{key}.rows", arrays, meta)
        fresh.offset, fresh.dims = off, dims
    else:
        if kind != "mlx:" + type(fresh).__name__:
            raise ValueError(f"{key}: stored {kind}, the model's cache is {type(fresh).__name__}")
        state = []
        for j in range(int(meta[f"{key}.n"])):
            v = meta.get(f"{key}.{j}")
            if v is None:
                state.append(arrays[f"{key}.{j}"])
            elif v == "none":
                state.append(None)
            else:
                state.append(int(v.removeprefix("int:")))
        fresh.state = tuple(state)
        if f"{key}.meta" in meta:
            fresh.meta_state = tuple(meta[f"{key}.meta"].split(","))
    return fresh
