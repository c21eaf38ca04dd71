"""Which KV cache a generation uses (a frozen spec, resolved once) and how it is built.

    spec = CacheSpec.for_model(model_dir, "int2")        # or "bf16"; rotation found here, once
    opts = EngineOptions(spec, mtp_k=1)                   # what serve / generate run with
    caches = make_caches(model, quant, rotations, clips)  # one RotatedLatentCache per layer

A model folder may ship its calibration as `latent-rotation.safetensors`; `--kv int2` then
needs no `--rotation`. That default is decided in `CacheSpec.for_model` and nowhere else.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..errors import MacserveError
from ..int2_format import INT2, LatentQuant
from . import mla_attention
from .dsa_indexer import IndexerKeyCache
from .latent_cache import RotatedLatentCache

SHIPPED_ROTATION = "latent-rotation.safetensors"
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
    """How a model is run: its cache, and MTP draft tokens per step (0: off)."""

    cache: CacheSpec = CacheSpec()
    mtp_k: int = 0

    def __post_init__(self):
        if not 0 <= self.mtp_k <= 3:
            raise MacserveError("--mtp-k must be 0..3")


def make_caches(
    model, quant: LatentQuant, rotations: list | None = None, clips: list | None = None
) -> list:
    """One cache per trunk layer. `rotations`/`clips`: per layer of the whole model (from a
    calibration), None for the unrotated cache. DSA models get mlx-lm's layout,
    CacheList(latent, indexer key), with our two caches."""
    attns = mla_attention.mla_attentions(model)
    n = len(attns)
    if rotations is None:
        latents = [RotatedLatentCache(quant) for _ in range(n)]
    else:
        # A pipeline rank holds layers [start, start + n) of the whole model.
        start = getattr(getattr(model, "model", None), "start_idx", 0) or 0
        total = getattr(getattr(model, "args", None), "num_hidden_layers", None) or n
        if len(rotations) != total:
            raise ValueError(f"calibration has {len(rotations)} layers, the model {total}")
        clips = clips if clips is not None else [None] * total
        latents = [
            RotatedLatentCache(quant, r, c)
            for r, c in zip(rotations[start : start + n], clips[start : start + n])
        ]
    if not hasattr(attns[0], "indexer"):
        return latents
    bits = quant.index_bits if quant.quantized else None
    return [CacheList(c, IndexerKeyCache(bits, quant.group_size)) for c in latents]


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
