"""The disk tier's files (disk_cache.py): their format, what the index knows of each (an
entry's tail, a block, what a lookup found and loaded), hashes, checksums and a safetensors
file's header and token list read without loading its arrays."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Bumped when the stored form changes: a file of another format is skipped with one log line
# and deleted (and the identity, disk_identity.py, names it: another folder). 4: the INT2
# latent cache as codes for every row and its window in the tail alone
# (engine/stored_codes.py), not its `state` with a window per snapshot as in 3; 3: each
# cache's own `state` (engine/stored_form.py), not engine/caches.py's per-class layout of 2.
FORMAT = "macserve-prompt-cache/4"
SUFFIX = ".safetensors"


@dataclass
class DiskEntry:
    """An entry's tail file; its blocks are `chain`."""

    path: Path
    tokens: np.ndarray
    nbytes: int
    reach: int  # tokens the trunk's caches can roll back exactly
    mtp_reach: int  # rows the MTP cache can roll back exactly; -1: no MTP cache
    used: float  # last use (the file's mtime)
    chain: list[str] = field(default_factory=list)


@dataclass
class Block:
    path: Path
    nbytes: int
    used: float
    short: int  # a chain may end here without a tail, this many tokens short; -1: not


@dataclass
class Plan:
    """What `best` found: an entry (its blocks and tail) or whole blocks alone."""

    tail: DiskEntry | None
    chain: list[str]
    tokens: np.ndarray  # the tokens the files hold
    keep: int
    at: int | None = None  # tokens the restored caches hold, if fewer (disk_blocks.py)


@dataclass
class Loaded:
    caches: list
    mtp: object
    tokens: np.ndarray
    keep: int  # prompt tokens it gives back (rolled back to this many)


def sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksum(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        mv = memoryview(arrays[k])
        h.update(mv if mv.c_contiguous else bytes(mv))
    return h.hexdigest()


def header(path: Path) -> dict:
    """A safetensors file's metadata, from its header alone; ValueError if it is torn."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated (no header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100 * 2**20):
            raise ValueError("truncated or torn (the header runs past the file)")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"truncated: {size} bytes, the header describes {8 + n + end}")
    meta = header.get("__metadata__") or {}
    meta["_tokens"] = header.get("tokens")
    meta["_data"] = 8 + n
    return meta


def read_tokens(path: Path, meta: dict) -> np.ndarray:
    t = meta.get("_tokens")
    if not t or t.get("dtype") != "I32":
        raise ValueError("no token list")
    a, b = t["data_offsets"]
    with open(path, "rb") as f:
        f.seek(meta["_data"] + a)
        raw = f.read(b - a)
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)
