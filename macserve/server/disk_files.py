"""The disk tier's files: hashes, checksums and a safetensors file's header and token list
read without loading its arrays (disk_cache.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


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
