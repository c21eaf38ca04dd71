"""Loading a model for the engine and building its latent caches."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from . import mla_attention
from .calibrate import Calibration
from .dsa_indexer import IndexerKeyCache
from .latent_cache import LatentQuant, RotatedLatentCache


def load_model(model_dir: str | Path):
    """mlx-lm's model and tokenizer, MLA layers able to read the quantized cache."""
    from mlx_lm import load

    model, tok = load(str(model_dir))
    if sys.platform != "darwin":
        # MLX's CPU backend runs the MoE experts' gather_mm only in float32.
        model.set_dtype(mx.float32)
    if mla_attention.install(model) == 0:
        raise ValueError(f"{model_dir}: no MLA attention layers; the latent cache needs an MLA model")
    return model, tok


def make_caches(model, quant: LatentQuant, calibration: Calibration | None = None,
                method: str | None = None) -> list:
    """One cache per trunk layer. Quantized caches other than `plain` need a calibration.
    DSA models get mlx-lm's layout, CacheList(latent, indexer key), with our two caches."""
    attns = mla_attention.mla_attentions(model)
    n = len(attns)
    if quant.bits is None or method in (None, "plain"):
        latents = [RotatedLatentCache(quant) for _ in range(n)]
    else:
        if calibration is None:
            raise ValueError(f"--kv with rotation {method!r} needs a calibration file (macserve calibrate)")
        rots, clips = calibration.for_method(method)
        # A pipeline rank holds layers [start, start + n) of the whole model.
        start = getattr(getattr(model, "model", None), "start_idx", 0) or 0
        total = getattr(getattr(model, "args", None), "num_hidden_layers", None) or n
        if len(rots) != total:
            raise ValueError(f"calibration has {len(rots)} layers, the model {total}")
        latents = [RotatedLatentCache(quant, r, c)
                   for r, c in zip(rots[start:start + n], clips[start:start + n])]
    if not hasattr(attns[0], "indexer"):
        return latents
    bits = None if quant.bits is None else quant.index_bits
    return [CacheList(c, IndexerKeyCache(bits, quant.group_size)) for c in latents]


def latent_caches(caches) -> list[RotatedLatentCache]:
    """The latent cache of each layer, whether or not the model is DSA."""
    return [c[0] if isinstance(c, CacheList) else c for c in caches]
