"""Which KV cache a generation uses (a frozen spec, resolved once) and how it is built.

    spec = CacheSpec.for_model(model_dir, "int2")        # "bf16", "auto"; rotation found here
    opts = EngineOptions(spec, mtp_k=1)                   # what serve / generate run with
    caches = make_caches(model, quant, rotations, clips)  # one RotatedLatentCache per layer

A model folder may ship its calibration as `latent-rotation.safetensors`; `--kv int2` then
needs no `--rotation`. That default is decided in `CacheSpec.for_model` and nowhere else.
A calibration whose gate chose a format per layer (engine/gate.py) gets a cache per layer in
that format: `quant` is then a list, one LatentQuant per layer of the whole model.
`auto` is that cache with the bf16 recent window its memory share holds (`with_window`, set
by server/capacity.py once the model is measured; every row bf16 until then).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from ..cache_kinds import CacheKind
from ..errors import MacserveError
from ..int2_format import INT2, SHIPPED_ROTATION, LatentQuant, format_name
from . import mla_attention
from .dsa_indexer import DsaCaches, IndexerKeyCache
from .latent_cache import RotatedLatentCache


@dataclass(frozen=True)
class CacheSpec:
    """`kind` (cache_kinds.py; a name is parsed here) bf16 is mlx-lm's own cache; int2 the
    rotated INT2 latent cache in `quant`'s format with the rotations of calibration file
    `rotation` (`method`: None = the file's default); auto the same cache, its window in
    `quant.recent` (None: the kind's own format: INT2, or for auto every row bf16)."""

    kind: CacheKind = CacheKind.BF16
    rotation: Path | None = None
    quant: LatentQuant = None  # type: ignore[assignment]  # set in __post_init__
    method: str | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", CacheKind.parse(self.kind))
        except ValueError as e:
            raise MacserveError(str(e)) from None
        if self.quant is None:
            object.__setattr__(self, "quant", self.kind.facts.quant or INT2)

    def with_window(self, recent: int) -> CacheSpec:
        """auto's spec with a bf16 recent window of `recent` tokens (capacity.py fits it)."""
        if self.kind != CacheKind.AUTO:
            raise ValueError(f"a window is auto's, not {self.kind}'s")
        return replace(self, quant=replace(self.quant, recent=recent))

    @classmethod
    def for_model(
        cls, model_dir: str | Path, kind: str = "bf16", rotation: str | Path | None = None
    ) -> CacheSpec:
        """The spec for a model folder, refusing now what every request would fail on."""
        kind = cls(kind).kind
        if not kind.calibrated:
            if rotation is not None:
                which = " or ".join(str(k) for k in CacheKind if k.calibrated)
                raise MacserveError(f"--rotation applies to the {which} cache; add --kv {which}")
            return cls(kind)
        rotation = rotation or shipped_rotation(model_dir)
        if rotation is None:
            raise MacserveError(
                f"--kv {kind} needs --rotation FILE: {model_dir} ships no "
                f"{SHIPPED_ROTATION} (make one with macserve calibrate)"
            )
        return cls(kind, Path(rotation))


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
        DsaCaches(c, IndexerKeyCache(q.index_bits if q.quantized else None, q.group_size))
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
    if isinstance(cache, CacheList):  # its own class: a DSA layer's restores in place
        return type(cache)(*[clone(c) for c in cache.caches])
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
    """The dtype the model computes in (its norms' weights stay unquantized): an MLA layer's
    latent norm, else, in a model without MLA (a Llama the engine serves with mlx-lm's own
    caches), its final norm."""
    mla = mla_attention.mla_attentions(model)
    if mla:
        return mla[0].kv_a_layernorm.weight.dtype
    return model.model.norm.weight.dtype


def latent_caches(caches) -> list[RotatedLatentCache]:
    """The latent cache of each layer, whether or not the model is DSA."""
    return [c[0] if isinstance(c, CacheList) else c for c in caches]
