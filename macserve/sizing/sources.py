"""Where a model's metadata comes from, as `inspect`, `new` and `pull` name it: a config.json,
a local folder, a local .gguf, or a Hugging Face repo id (`org/name`, `org/name:QUANT` or
`--quant` for GGUF repos), the repo read from the Hugging Face cache when it holds the model,
else from the hub.

Only config.json, the file listing and GGUF headers are read, never weights. Local files:
model_source.py (and `ModelSource`, what every source reads into); the hub over the network:
hub.py; which GGUF files make up a model: gguf_files.py. Here: which of them a source names,
and the Hugging Face cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .. import env
from ..errors import MacserveError
from .gguf_files import gguf_files
from .hub import read_remote
from .model_source import ModelSource, read_gguf_file, read_local

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def split_source(source: str, quant: str | None = None) -> tuple[str, str | None]:
    """(repo id, quant) of `org/name`, `org/name:QUANT` (and --quant); refuses anything else."""
    repo = source
    if ":" in source:
        repo, _, q = source.rpartition(":")
        if quant and q and q.lower() != quant.lower():
            raise MacserveError(f"{source}: quant given twice ({q!r} and --quant {quant!r})")
        quant = quant or q or None
    if not _REPO.fullmatch(repo):
        raise MacserveError(f"{source}: no such file, and not a Hugging Face repo id (org/name)")
    return repo, quant


def resolve(source: str, quant: str | None = None) -> ModelSource:
    """A path if it exists, else a hub repo id (`org/name` or `org/name:QUANT`): from the
    Hugging Face cache when it holds what the model needs, else from the hub."""
    p = Path(source).expanduser()
    try:
        exists = p.exists()
    except (OSError, ValueError) as e:  # longer than PATH_MAX, a NUL: no file, no repo either
        raise MacserveError(
            f"{source[:80]}...: not a usable path or repo id: {e.__class__.__name__}"
        ) from None
    if exists:
        return read_local(p, quant)
    if source.endswith((".json", ".gguf")) or source.startswith((".", "/", "~")):
        raise MacserveError(f"{source}: no such file")
    parent = p.parent
    if str(parent) not in ("", ".") and parent.is_dir():
        # `models/tiny-mal` beside a real `models/` folder is a typo, not a hub repo id:
        # say so before a hub look-up fails with a network error that hides it.
        raise MacserveError(
            f"{source}: no such file or folder (a folder {parent}/ is here, so this reads as "
            "a path; a Hugging Face repo id of the same name can be inspected from elsewhere)"
        )
    repo, quant = split_source(source, quant)
    cached = cached_source(repo, quant)
    if cached is not None:
        return cached
    if env.hf_offline():
        raise MacserveError(
            f"{repo}: not in the Hugging Face cache ({env.hf_hub_cache()}) and HF_HUB_OFFLINE "
            f"is set: run macserve pull {source} while online"
        )
    return read_remote(repo, quant)


# ---------------------------------------------------------------------------------------
# the Hugging Face cache: what `macserve pull` (or any huggingface_hub download) left in
# HF_HUB_CACHE, read without the network. Layout (huggingface_hub's): models--ORG--NAME/
# refs/main holds the commit, snapshots/<commit>/ the files (links to blobs/, made only once a
# file is complete, so a file there is whole).


def hub_snapshot(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo` at `revision`, if the cache has one."""
    root = env.hf_hub_cache() / ("models--" + repo.replace("/", "--"))
    try:
        commit = (root / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snap = root / "snapshots" / commit
    return snap if commit and snap.is_dir() else None


def _complete_mlx(folder: Path) -> bool:
    """config.json and every weight file the index names (or at least one) are there."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def cached_source(repo: str, quant: str | None = None) -> ModelSource | None:
    """`repo` (and `quant`) from the Hugging Face cache, or None when it lacks what is needed."""
    snap = hub_snapshot(repo)
    if snap is None:
        return None
    ggufs = [str(p.relative_to(snap)) for p in snap.rglob("*.gguf")]
    if quant or (ggufs and not (snap / "config.json").exists()):
        if not ggufs:
            return None
        try:
            first, _ = gguf_files(repo, ggufs, quant)
        except MacserveError:
            return None
        src = read_gguf_file(snap / first)
        src.name = f"{repo}:{quant}" if quant else repo
        return src
    if not _complete_mlx(snap):
        return None
    src = read_local(snap, None)
    src.name = repo
    return src
