"""The prompt cache's disk tier: entries kept across restarts, so the next turn of a long chat
after `macserve set`, a router's idle stop or a reboot prefills only its new tokens.

What is kept: every entry the memory tier keeps (a request's end-of-prompt and
end-of-generation snapshots, prompt_cache.py), written by a background thread after the memory
tier has it, so an answer never waits on the disk. An entry the memory tier folds into a
longer one before it is written is not written; one already written is deleted. This first
version stores whole prefixes, one file per entry, not N-token blocks: a follow-up turn shares
its whole history with the previous turn's end-of-generation snapshot, which is the case
this is for; two chats that share only a system prompt share a file only if one's
end-of-prompt snapshot is that prompt.

The stored form is the cache's own (engine/caches.py: `cache_to_arrays`): INT2 codes, scales
and bf16 windows for the latent cache, mlx-lm's `state` / `meta_state` otherwise, plus the MTP
layer's cache for entries made by drafting requests; one safetensors file with the tokens, the
arrays, and in its metadata the format, the identity (model, calibration, cache kind) and a
sha256 of every array's bytes.

Where: `<dir>/<identity>/<hash of the tokens>.safetensors`, `dir` from `--prompt-cache-dir`.
Bounded by `--prompt-cache-disk` bytes, least recently used (file mtime, touched on each hit)
deleted first, and never written when the filesystem would be left with less than
`MIN_FREE` free. Writes are atomic (temp file, fsync, rename, fsync of the folder). A file
that is torn, truncated or corrupt (its checksum), made for another model, calibration or
cache kind, or that cannot be written (a full disk) is skipped with one log line and
deleted if it is ours to delete: never a crash, never a wrong cache.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.caches import CacheSpec, cache_from_arrays, cache_to_arrays, model_dtype
from ..fileio import atomic_path
from .prompt_cache import common_prefix

log = logging.getLogger("macserve.server")

FORMAT = "macserve-prompt-cache/1"
MIN_FREE = 2 * 2**30  # bytes the filesystem keeps free whatever --prompt-cache-disk says
SUFFIX = ".safetensors"


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def identity(bundle, spec: CacheSpec) -> dict[str, str]:
    """What a stored cache is only valid for: the model (its config and weight files), the
    calibration (its bytes) and the cache's format and dtype."""
    path = Path(bundle.path)
    weights = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    weights = [w for w in weights if w[0] != "latent-rotation.safetensors"]
    model = _sha((path / "config.json").read_bytes(), json.dumps(weights).encode())[:16]
    if spec.kind == "int2":
        calibration = f"{spec.rotation.name}:{_file_sha(spec.rotation)[:16]}:{spec.method}"
    else:
        calibration = "none"
    cache = f"{FORMAT}:{spec.kind}:{spec.quant!r}:{model_dtype(bundle.model)}"
    return {"model": f"{path.name}:{model}", "calibration": calibration, "cache": cache}


def _checksum(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        mv = memoryview(arrays[k])
        h.update(mv if mv.c_contiguous else bytes(mv))
    return h.hexdigest()


@dataclass
class DiskEntry:
    path: Path
    tokens: np.ndarray
    nbytes: int
    reach: int  # tokens the trunk's caches can roll back exactly
    mtp_reach: int  # rows the MTP cache can roll back exactly; -1: no MTP cache
    used: float  # last use (the file's mtime)


@dataclass
class Loaded:
    caches: list
    mtp: object
    tokens: np.ndarray


class DiskTier:
    """Used by the worker thread (best, load) and its own writer thread (writes, eviction);
    `stats` may be read from any."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        ident: dict[str, str],
        fresh: Callable[[], list],
        fresh_mtp: Callable[[], object] | None,
    ):
        self.ident = ident
        self.key = _sha(json.dumps(ident, sort_keys=True).encode())[:16]
        self.dir = Path(root) / self.key
        self.max_bytes = max_bytes
        self.fresh, self.fresh_mtp = fresh, fresh_mtp
        self.entries: dict[str, DiskEntry] = {}
        self.nbytes = 0
        self.hits = 0
        self.cached_tokens = 0
        self.writes = 0
        self.skipped = 0  # files skipped (corrupt, foreign) or writes that failed
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._scan()
        threading.Thread(target=self._writer, name="macserve-disk-cache", daemon=True).start()

    # -- the index --------------------------------------------------------------------------

    def _skip(self, path: Path, why: str, delete: bool = True) -> None:
        self.skipped += 1
        log.warning("prompt cache: skipped %s on disk: %s", path.name, why)
        if delete:
            with contextlib.suppress(OSError):
                path.unlink()

    def _scan(self) -> None:
        """Index the files already there, reading only their headers and token lists."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("prompt cache: no disk tier at %s: %s", self.dir, e)
            self.max_bytes = 0
            return
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith("."):  # a write cut off before its rename
                self._skip(p, "an unfinished write")
                continue
            if p.suffix != SUFFIX:
                continue
            try:
                meta = _header(p)
                self._check_identity(meta)
                tokens = _read_tokens(p, meta)
                e = DiskEntry(
                    p,
                    tokens,
                    p.stat().st_size,
                    int(meta["reach"]),
                    int(meta["mtp_reach"]),
                    p.stat().st_mtime,
                )
            except (OSError, ValueError, KeyError, TypeError) as err:
                self._skip(p, str(err))
                continue
            self.entries[p.stem] = e
            self.nbytes += e.nbytes
        if self.entries:
            log.info(
                "prompt cache: %d entries on disk (%.1f MB) in %s",
                len(self.entries),
                self.nbytes / 2**20,
                self.dir,
            )
        self._evict()

    def _check_identity(self, meta: dict) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
        for k in ("model", "calibration", "cache"):
            if meta.get(f"id.{k}") != self.ident[k]:
                raise ValueError(
                    f"made for {k} {meta.get(f'id.{k}')!r}; this server runs {self.ident[k]!r}"
                )

    def stats(self) -> dict:
        with self._lock:
            return {
                "hits": self.hits,
                "cached_tokens": self.cached_tokens,
                "bytes": self.nbytes,
                "entries": len(self.entries),
                "max_bytes": self.max_bytes,
                "writes": self.writes,
                "skipped": self.skipped,
                "dir": str(self.dir),
            }

    # -- reading (the worker thread) --------------------------------------------------------

    def best(self, ids: np.ndarray, mtp: bool, better_than: int) -> tuple[DiskEntry, int] | None:
        """The entry that gives back the longest prefix of `ids` (more than `better_than`
        tokens), with that length; as PromptCache.fetch counts it."""
        best, best_keep = None, better_than
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            if mtp and e.mtp_reach < 0:
                continue
            keep = min(common_prefix(e.tokens, ids), len(ids) - 1)
            if mtp:
                keep -= 1
            back = len(e.tokens) - keep
            ok = back <= e.reach and (not mtp or back - 1 <= e.mtp_reach)
            if keep > best_keep and ok:
                best, best_keep = e, keep
        return (best, best_keep) if best is not None else None

    def load(self, e: DiskEntry) -> Loaded | None:
        """The entry's caches, or None (skipped with one log line) if its file is not what
        it says."""
        try:
            arrays, meta = mx.load(str(e.path), format="safetensors", return_metadata=True)
            self._check_identity(meta)
            if meta.get("checksum") != _checksum(arrays):
                raise ValueError("checksum mismatch (a corrupt file)")
            tokens = np.asarray(arrays["tokens"], dtype=np.int64)
            if not np.array_equal(tokens, e.tokens):
                raise ValueError("its tokens changed since it was indexed")
            caches = [
                cache_from_arrays(c, f"L{i}", arrays, meta) for i, c in enumerate(self.fresh())
            ]
            mtp = None
            if "mtp.kind" in meta and self.fresh_mtp is not None:
                mtp = cache_from_arrays(self.fresh_mtp(), "mtp", arrays, meta)
            mx.eval([c.state for c in caches], [] if mtp is None else mtp.state)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            with self._lock:
                if self.entries.pop(e.path.stem, None) is not None:
                    self.nbytes -= e.nbytes
            self._skip(e.path, str(err))
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(e.path, (now, now))  # least recently used goes first: this one was used
        e.used = now
        return Loaded(caches, mtp, tokens)

    def count_hit(self, tokens: int) -> None:
        with self._lock:
            self.hits += 1
            self.cached_tokens += tokens

    # -- writing (the writer thread) --------------------------------------------------------

    def stored_form(self, tokens, caches: list, mtp, reach: int, mtp_reach: int):
        """(arrays, metadata) of an entry, evaluated. On the worker thread: the slices it
        takes are MLX work, which stays on the thread that owns the model; the writer thread
        then only reads finished buffers."""
        arrays: dict = {"tokens": mx.array(np.asarray(tokens, dtype=np.int32))}
        meta = {"format": FORMAT, "reach": str(reach), "mtp_reach": str(mtp_reach)}
        meta.update({f"id.{k}": v for k, v in self.ident.items()})
        for i, c in enumerate(caches):
            cache_to_arrays(c, f"L{i}", arrays, meta)
        if mtp is not None:
            cache_to_arrays(mtp, "mtp", arrays, meta)
        mx.eval(list(arrays.values()))
        return arrays, meta

    def put(self, tokens: np.ndarray, arrays: dict, meta: dict, entry) -> None:
        """Queue an entry for writing; `entry.gone` set by the memory tier before the write
        starts means it was folded into a longer one: not written."""
        if self.max_bytes > 0:
            self._q.put(("write", tokens, arrays, meta, entry))

    def drop(self, tokens: np.ndarray) -> None:
        """The memory tier folded this entry into a longer one: its file only takes space."""
        if self.max_bytes > 0:
            self._q.put(("drop", tokens))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, the bench, a clean shutdown)."""
        done = threading.Event()
        self._q.put(("flush", done))
        return done.wait(timeout)

    def _writer(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item[0] == "flush":
                    item[1].set()
                elif item[0] == "drop":
                    self._remove(_key(item[1]))
                else:
                    self._write(*item[1:])
            except Exception as e:  # noqa: BLE001 - a write that fails costs a hit, never the server
                self.skipped += 1
                log.warning("prompt cache: not written to disk: %s: %s", type(e).__name__, e)

    def _remove(self, key: str) -> None:
        with self._lock:
            e = self.entries.pop(key, None)
            if e is not None:
                self.nbytes -= e.nbytes
        if e is not None:
            with contextlib.suppress(OSError):
                e.path.unlink()

    def _write(self, tokens, arrays: dict, meta: dict, entry) -> None:
        if getattr(entry, "gone", False):
            return
        key = _key(tokens)
        if key in self.entries:
            return
        reach, mtp_reach = int(meta["reach"]), int(meta["mtp_reach"])
        size = sum(a.nbytes for a in arrays.values())
        if size > self.max_bytes:
            return
        free = shutil.disk_usage(self.dir).free
        if free - size < MIN_FREE:
            self.skipped += 1
            log.warning(
                "prompt cache: not written to disk: %.1f GB free, %d GB kept free",
                free / 2**30,
                MIN_FREE // 2**30,
            )
            return
        meta["checksum"] = _checksum(arrays)
        path = self.dir / f"{key}{SUFFIX}"
        try:
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                mx.save_safetensors(f, arrays, meta)
        except OSError as e:
            self.skipped += 1
            full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            log.warning(
                "prompt cache: not written to disk%s: %s",
                " (the disk or a file size limit is full)" if full else "",
                e,
            )
            return
        st = path.stat()
        with self._lock:
            self.entries[key] = DiskEntry(path, tokens, st.st_size, reach, mtp_reach, st.st_mtime)
            self.nbytes += st.st_size
            self.writes += 1
        if getattr(entry, "gone", False):  # folded while it was being written
            self._remove(key)
        self._evict()

    def _evict(self) -> None:
        with self._lock:
            order = sorted(self.entries.values(), key=lambda e: e.used)
            victims = []
            while self.nbytes > self.max_bytes and order:
                e = order.pop(0)
                self.entries.pop(e.path.stem, None)
                self.nbytes -= e.nbytes
                victims.append(e)
        for e in victims:
            with contextlib.suppress(OSError):
                e.path.unlink()


def _key(tokens: np.ndarray) -> str:
    return _sha(np.asarray(tokens, dtype=np.int64).tobytes())[:32]


def _header(path: Path) -> dict:
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


def _read_tokens(path: Path, meta: dict) -> np.ndarray:
    t = meta.get("_tokens")
    if not t or t.get("dtype") != "I32":
        raise ValueError("no token list")
    a, b = t["data_offsets"]
    with open(path, "rb") as f:
        f.seek(meta["_data"] + a)
        raw = f.read(b - a)
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)
