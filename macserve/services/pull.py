"""`macserve pull REPO[:QUANT]`: download what a model needs into the Hugging Face cache.

huggingface_hub's `snapshot_download` does the work: progress bars on stderr, resume of a
partial download (its `.incomplete` blobs continue with HTTP ranges), the standard cache
layout (HF_HUB_CACHE), so mlx-lm, llama.cpp's `-m` and `inspect` all find the files. Only the
files the model needs are fetched:

- GGUF (a :QUANT, or a repo of GGUF files only): the parts of that one quant;
- MLX / safetensors: mlx-lm's own download patterns (`mlx_lm.utils.DEFAULT_ALLOW_PATTERNS`,
  the same list its offline completeness check uses), plus the engine's shipped INT2
  calibration `latent-rotation.safetensors`, then any weight file the index names that those
  patterns missed (`mtp.safetensors`: the MTP layers the engine drafts with).

With HF_HUB_OFFLINE set nothing is fetched: the cached copy is used if it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import MacserveError
from ..sizing import hub, sources
from ..sizing.gguf_files import gguf_files

# engine/caches.SHIPPED_ROTATION (named, not imported: services never import the engine)
ENGINE_FILES = ("latent-rotation.safetensors",)


@dataclass(frozen=True)
class Pulled:
    repo: str
    quant: str | None
    snapshot: Path  # the cache's snapshot folder
    files: tuple[str, ...]  # what was asked for (names, or patterns for the MLX layout)
    model_path: Path  # what a profile's MODEL names: the GGUF (first part) or the folder


def mlx_patterns() -> list[str]:
    # mlx-lm's own list, so its offline check (hf_repo_to_path) finds the snapshot complete.
    # Imports mlx (~2 s): only a pull of an MLX model needs it.
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS) + list(ENGINE_FILES)


def _wanted(repo: str, quant: str | None) -> tuple[list[str], str | None]:
    """(allow patterns, the GGUF file a profile serves or None for a folder)."""
    files = hub.list_repo_files(repo)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if quant or (ggufs and "config.json" not in files):
        if not ggufs:
            raise MacserveError(f"{repo}: no GGUF files in this repository")
        first, group = gguf_files(repo, ggufs, quant)
        return group, first
    if "config.json" not in files:
        raise MacserveError(f"{repo}: no config.json and no GGUF files")
    return mlx_patterns(), None


def pull(source: str, quant: str | None = None) -> Pulled:
    repo, quant = sources.split_source(source, quant)
    if env.hf_offline():
        cached = sources.cached_source(repo, quant)
        snap = sources.hub_snapshot(repo)  # not None when cached is not
        if cached is None or snap is None or cached.local_path is None:
            raise MacserveError(
                f"{source}: HF_HUB_OFFLINE is set and the Hugging Face cache "
                f"({env.hf_hub_cache()}) does not hold it complete"
            )
        path = Path(cached.local_path)
        return Pulled(repo, quant, snap, (), path if cached.is_gguf else snap)
    patterns, gguf = _wanted(repo, quant)
    snap = _download(repo, patterns)
    if gguf is None:
        # Weight files the index names beyond mlx-lm's patterns (the MTP layers the engine
        # drafts with, e.g. mtp.safetensors): a second pass fetches just those.
        missing = [s for s in _indexed_shards(snap) if not (snap / s).is_file()]
        if missing:
            _download(repo, missing)
            patterns += missing
    return Pulled(repo, quant, snap, tuple(patterns), snap / gguf if gguf else snap)


def _download(repo: str, patterns: list[str]) -> Path:
    # 0.3-0.5 s to import; only a download needs it (the module docstring of sizing/hub.py)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo,
                allow_patterns=patterns,
                cache_dir=str(env.hf_hub_cache()),
                endpoint=env.hf_endpoint(),
            )
        )
    except Exception as e:  # hub, network and disk errors come in many types: one line
        raise MacserveError(f"{repo}: download failed: {type(e).__name__}: {e}") from None


def _indexed_shards(folder: Path) -> list[str]:
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        return sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return []
