"""The prompt cache's disk tier: entries kept across restarts, so the next turn of a long chat
after `macserve set`, a router's idle stop or a reboot prefills only its new tokens.

What is kept: every entry the memory tier keeps (a request's end-of-prompt and
end-of-generation snapshots, prompt_cache.py), written by a background thread after the memory
tier has it, so an answer never waits on the disk. An entry the memory tier folds into a
longer one before it is written is not written; one already written loses its tail.

Each entry is a chain of N-token prefix blocks and a tail (disk_blocks.py): block i holds
only the rows of tokens [iN, (i+1)N) and is named by a hash of every token up to its end, so
two chats that share a long system prompt share its blocks on disk, and a follow-up turn
writes only the blocks its predecessor had not. The tail holds the rest (the last partial
block, the INT2 cache's bf16 window: the entry's one window, the metadata). A request loads
the longest match: an entry's blocks and tail (rolled back as the memory tier would), or any
prefix of whole blocks of its prompt, entered at its end for caches made of rows alone
(bf16) and `recent` tokens before it for the INT2 cache, whose window is rebuilt from the
codes and those tokens prefilled again (disk_blocks.py, engine/stored_codes.py); it
prefills only the rest. N (`BLOCK_TOKENS`) was chosen by measurement (docs/server.md,
`python3 -m macserve.server.disk_measure`).

The stored form is each cache's own `state`, on mlx-lm's protocol (engine/stored_form.py),
and for the INT2 latent cache its codes form (engine/stored_codes.py: codes and scales for
every row past the sink, the bf16 sink, the window apart), keys and values for mlx-lm's, plus
the MTP layer's cache for entries made by drafting requests (their blocks are their own:
named with `:mtp`). Each file is one safetensors file with its tokens, arrays, and in its metadata the
format, the identity (disk_identity.py: the model's config and weights' contents, the
calibration, the cache kind) and a sha256 of every array's bytes.

Where: `<dir>/<identity>/{b,t}-<hash>.safetensors`, `dir` from `--prompt-cache-dir`. Bounded
by `--prompt-cache-disk` bytes over all files, least recently used (file mtime, touched on
each hit and each write that reuses a block) deleted first, tails before their blocks, and
never written when the filesystem would be left with less than `MIN_FREE` free. Writes are
atomic (temp file, fsync, rename, fsync of the folder). A file that is torn, truncated or
corrupt (its checksum), made for another model, calibration or cache kind, or that cannot be
written (a full disk) is skipped with one log line and deleted if it is ours to delete:
never a crash, never a wrong cache. A bad block ends its chain there: the blocks before it
still serve where the cache allows (bf16), the entries that need it go.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.stored_form import restore
from ..fileio import atomic_path
from . import disk_blocks
from .disk_files import (
    FORMAT,
    SUFFIX,
    Block,
    DiskEntry,
    Loaded,
    Plan,
    checksum,
    header,
    read_tokens,
    sha,
)
from .prompt_cache import common_prefix

log = logging.getLogger("macserve.server")

MIN_FREE = 2 * 2**30  # bytes the filesystem keeps free whatever --prompt-cache-disk says
BLOCK_TOKENS = 256  # N: measured, docs/server.md ("Prefix blocks")


class DiskTier:
    """Used by the worker thread (best, load, stored_form) and its own writer thread (writes,
    eviction); `stats` may be read from any."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        ident: dict[str, str],
        fresh: Callable[[], list],
        fresh_mtp: Callable[[], object] | None,
        block_tokens: int = BLOCK_TOKENS,
    ):
        self.ident = ident
        self.key = sha(json.dumps(ident, sort_keys=True).encode())[:16]
        self.dir = Path(root) / self.key
        self.max_bytes = max_bytes
        self.n = block_tokens
        self.salt = f"{self.key}:{block_tokens}"  # blocks of another N are other blocks
        self._short: int | None = None  # disk_blocks.layout's, once known
        self.fresh, self.fresh_mtp = fresh, fresh_mtp
        self.entries: dict[str, DiskEntry] = {}
        self.blocks: dict[str, Block] = {}
        self.nbytes = 0
        self.hits = 0
        self.cached_tokens = 0
        self.writes = 0
        self.skipped = 0  # files skipped (corrupt, foreign) or writes that failed
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._scan()
        self._thread = threading.Thread(
            target=self._writer, name="macserve-disk-cache", daemon=True
        )
        self._thread.start()

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
        tails = []
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith("."):  # a write cut off before its rename
                self._skip(p, "an unfinished write")
                continue
            if p.suffix != SUFFIX:
                continue
            try:
                meta = header(p)
                self._check_identity(meta)
                st = p.stat()
                if int(meta["n"]) != self.n:
                    raise ValueError(f"made with {meta['n']}-token blocks, not {self.n}")
                if p.name.startswith("b-"):
                    short = int(meta["short"])
                    self.blocks[p.stem[2:]] = Block(p, st.st_size, st.st_mtime, short)
                elif p.name.startswith("t-"):
                    tokens = read_tokens(p, meta)
                    mtp_reach = int(meta["mtp_reach"])
                    chain = disk_blocks.chain_keys(
                        tokens, self.n, int(meta["chain"]), mtp_reach >= 0, self.salt
                    )
                    reach = int(meta["reach"])
                    tails.append(
                        DiskEntry(p, tokens, st.st_size, reach, mtp_reach, st.st_mtime, chain)
                    )
                else:
                    raise ValueError("not a block or a tail")
            except (OSError, ValueError, KeyError, TypeError) as err:
                self._skip(p, str(err))
                continue
            self.nbytes += st.st_size
        for e in tails:
            gone = next((k for k in e.chain if k not in self.blocks), None)
            if gone is not None:
                self.nbytes -= e.nbytes
                self._skip(e.path, f"its block {gone} is missing")
                continue
            self.entries[e.path.stem[2:]] = e
        if self.entries or self.blocks:
            log.info(
                "prompt cache: %d entries in %d blocks on disk (%.1f MB) in %s",
                len(self.entries),
                len(self.blocks),
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

    @property
    def cuttable(self) -> bool:
        """Whether a chain of blocks is entered without a tail (disk_blocks.layout), so no
        snapshot is kept for its window alone (PromptCache.keep_on_disk). On the worker
        thread: the first call builds the server's fresh caches to ask their classes."""
        if self._short is None:
            self._short = disk_blocks.short_of(self.fresh())
        return self._short >= 0

    def stats(self) -> dict:
        with self._lock:
            return {
                "hits": self.hits,
                "cached_tokens": self.cached_tokens,
                "bytes": self.nbytes,
                "entries": len(self.entries),
                "blocks": len(self.blocks),
                "block_tokens": self.n,
                "max_bytes": self.max_bytes,
                "writes": self.writes,
                "skipped": self.skipped,
                "dir": str(self.dir),
            }

    # -- reading (the worker thread) --------------------------------------------------------

    def best(self, ids: np.ndarray, mtp: bool, better_than: int) -> Plan | None:
        """What gives back the longest prefix of `ids` (more than `better_than` tokens), as
        PromptCache.fetch counts it: an entry, or a chain of blocks alone (entered `short`
        tokens before its end: disk_blocks.py)."""
        best = None
        with self._lock:
            entries = list(self.entries.values())
            blocks = dict(self.blocks)
        for e in entries:
            if mtp and e.mtp_reach < 0:
                continue
            keep = min(common_prefix(e.tokens, ids), len(ids) - 1)
            if mtp:
                keep -= 1
            back = len(e.tokens) - keep
            ok = back <= e.reach and (not mtp or back - 1 <= e.mtp_reach)
            if keep > better_than and ok:
                best, better_than = Plan(e, e.chain, e.tokens, keep), keep
        for m in (True,) if mtp else (False, True):
            chain = disk_blocks.chain_keys(ids, self.n, len(ids) // self.n, m, self.salt)
            j = 0
            while j < len(chain) and chain[j] in blocks and blocks[chain[j]].short >= 0:
                j += 1
            if not j:
                continue
            short = max(blocks[k].short for k in chain[:j])
            at, keep = _entered(min(j * self.n, len(ids) - 1), short, mtp)
            if keep > better_than:
                best, better_than = Plan(None, chain[:j], ids[: j * self.n], keep, at), keep
        return best

    def _read(self, path: Path) -> tuple[dict, dict]:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        self._check_identity(meta)
        if meta.get("checksum") != checksum(arrays):
            raise ValueError("checksum mismatch (a corrupt file)")
        return arrays, meta

    def load(self, plan: Plan, mtp: bool, better_than: int) -> Loaded | None:
        """The caches `plan` names, or None (skipped with one log line) if a file is not what
        it says. A bad block ends the chain there: the blocks before it serve if they can."""
        parts, meta, tail = [], None, None
        try:
            for i, key in enumerate(plan.chain):
                arrays, meta = self._read(self.dir / f"b-{key}{SUFFIX}")
                want = plan.tokens[i * self.n : (i + 1) * self.n]
                if not np.array_equal(np.asarray(arrays.pop("tokens")), want):
                    raise ValueError("its tokens are not the ones its name says")
                parts.append(arrays)
            if plan.tail is not None:
                tail, meta = self._read(plan.tail.path)
                if not np.array_equal(np.asarray(tail.pop("tokens")), plan.tokens):
                    raise ValueError("its tokens changed since it was indexed")
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            bad = plan.chain[len(parts)] if len(parts) < len(plan.chain) else None
            self._skip(self.dir / f"b-{bad}{SUFFIX}" if bad else plan.tail.path, str(err), False)
            self._drop_files(bad, None if bad else plan.tail)
            # Whole blocks before the bad one that the prompt shares: enough where the cache
            # is made of rows alone.
            short = -1 if meta is None else int(meta.get("short", -1))
            # The prefix the plan shares with the prompt, which the blocks kept must not pass.
            shared = plan.keep + mtp if plan.at is None else plan.at + max(short, 0)
            j = min(len(parts), shared // self.n)
            at, keep = _entered(j * self.n, short, mtp)
            if not j or short < 0 or keep <= better_than:
                return None
            parts, tail = parts[:j], None
            plan = Plan(None, plan.chain[:j], plan.tokens[: j * self.n], keep, at)
        try:
            arrays = disk_blocks.join(parts, tail, meta, len(plan.tokens))
            fresh = self.fresh()
            at = plan.at
            caches = [restore(c, f"L{i}", arrays, meta, at) for i, c in enumerate(fresh)]
            mc = None
            if "mtp.class" in meta and self.fresh_mtp is not None:
                mc = restore(self.fresh_mtp(), "mtp", arrays, meta, None if at is None else at - 1)
            mx.eval([c.state for c in caches], [] if mc is None else mc.state)
        except (ValueError, KeyError, RuntimeError) as err:  # files that do not fit together
            self.skipped += 1
            log.warning("prompt cache: skipped an entry on disk: %s", err)
            self._drop_files(plan.chain[-1] if plan.chain else None, plan.tail)
            return None
        now = time.time()
        paths = [self.dir / f"b-{k}{SUFFIX}" for k in plan.chain]
        for p in paths + ([plan.tail.path] if plan.tail else []):
            with contextlib.suppress(OSError):
                os.utime(p, (now, now))  # least recently used goes first: these were used
        with self._lock:
            for k in plan.chain:
                if k in self.blocks:
                    self.blocks[k].used = now
            if plan.tail is not None:
                plan.tail.used = now
        tokens = plan.tokens if plan.at is None else plan.tokens[: plan.at]
        return Loaded(caches, mc, np.asarray(tokens), plan.keep)

    def count_hit(self, tokens: int) -> None:
        with self._lock:
            self.hits += 1
            self.cached_tokens += tokens

    # -- writing (the writer thread) --------------------------------------------------------

    def stored_form(self, tokens, caches: list, mtp, reach: int, mtp_reach: int):
        """(blocks, tail, metadata) of an entry, evaluated. On the worker thread: the slices
        it takes are MLX work, which stays on the thread that owns the model; the writer
        thread then only reads finished buffers."""
        meta = {"format": FORMAT, "reach": str(reach), "mtp_reach": str(mtp_reach)}
        meta.update({f"id.{k}": v for k, v in self.ident.items()})
        blocks, tail, self._short = disk_blocks.entry_form(tokens, caches, mtp, meta, self.n)
        meta["short"] = str(self._short)
        meta["n"], meta["chain"] = str(self.n), str(len(blocks))
        mx.eval([list(b.values()) for b in blocks], list(tail.values()))
        return (blocks, tail), meta

    def put(self, tokens: np.ndarray, arrays, meta: dict, entry) -> None:
        """Queue an entry for writing; `entry.gone` set by the memory tier before the write
        starts means it was folded into a longer one: not written."""
        if self.max_bytes > 0:
            self._q.put(("write", tokens, arrays, meta, entry))

    def drop(self, tokens: np.ndarray) -> None:
        """The memory tier folded this entry into a longer one: its tail only takes space
        (its blocks are the longer one's too)."""
        if self.max_bytes > 0:
            self._q.put(("drop", tokens))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, the bench, a clean shutdown)."""
        done = threading.Event()
        self._q.put(("flush", done))
        return done.wait(timeout)

    def close(self) -> None:
        """Finish the queued writes and end the writer thread (a tier made for a measurement)."""
        self._q.put(("close",))
        self._thread.join()

    def _writer(self) -> None:
        while True:
            item = self._q.get()
            if item[0] == "close":
                return
            try:
                if item[0] == "flush":
                    item[1].set()
                elif item[0] == "drop":
                    self._drop_files(None, self.entries.get(_key(item[1])))
                else:
                    self._write(*item[1:])
            except Exception as e:  # noqa: BLE001 - a write that fails costs a hit, never the server
                self.skipped += 1
                log.warning("prompt cache: not written to disk: %s: %s", type(e).__name__, e)

    def _drop_files(self, block: str | None, tail: DiskEntry | None) -> None:
        """Forget and delete a block (and every entry whose chain holds it) or a tail."""
        with self._lock:
            gone = []
            if block is not None and (b := self.blocks.pop(block, None)) is not None:
                self.nbytes -= b.nbytes
                gone.append(b.path)
            for k, e in list(self.entries.items()):
                if e is tail or (block is not None and block in e.chain):
                    del self.entries[k]
                    self.nbytes -= e.nbytes
                    gone.append(e.path)
        for p in gone:
            with contextlib.suppress(OSError):
                p.unlink()

    def _save(self, path: Path, arrays: dict, meta: dict) -> int:
        meta = dict(meta, checksum=checksum(arrays))
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            mx.save_safetensors(f, arrays, meta)
        return path.stat().st_size

    def _write(self, tokens, parts, meta: dict, entry) -> None:
        if getattr(entry, "gone", False):
            return
        key = _key(tokens)
        if key in self.entries:
            return
        blocks, tail = parts
        reach, mtp_reach = int(meta["reach"]), int(meta["mtp_reach"])
        chain = disk_blocks.chain_keys(tokens, self.n, len(blocks), mtp_reach >= 0, self.salt)
        new = [(k, b) for k, b in zip(chain, blocks) if k not in self.blocks]
        size = sum(a.nbytes for _, b in new for a in b.values())
        size += sum(a.nbytes for a in tail.values())
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
        now = time.time()
        bmeta = {k: v for k, v in meta.items() if k not in ("reach", "mtp_reach", "chain")}
        try:
            for k in chain:
                if (b := self.blocks.get(k)) is not None:  # an earlier entry's: used again
                    with contextlib.suppress(OSError):
                        os.utime(b.path, (now, now))
                    b.used = now
            for k, b in new:
                path = self.dir / f"b-{k}{SUFFIX}"
                n = self._save(path, b, dict(bmeta, block=str(chain.index(k))))
                with self._lock:
                    self.blocks[k] = Block(path, n, time.time(), int(meta["short"]))
                    self.nbytes += n
            path = self.dir / f"t-{key}{SUFFIX}"
            n = self._save(path, tail, meta)
        except OSError as e:
            self.skipped += 1
            full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            log.warning(
                "prompt cache: not written to disk%s: %s",
                " (the disk or a file size limit is full)" if full else "",
                e,
            )
            self._evict()
            return
        with self._lock:
            self.entries[key] = DiskEntry(path, tokens, n, reach, mtp_reach, time.time(), chain)
            self.nbytes += n
            self.writes += 1
        if getattr(entry, "gone", False):  # folded while it was being written
            self._drop_files(None, self.entries.get(key))
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, an entry's tail before its blocks (a block is touched
        whenever an entry that holds it is written or read)."""
        while True:
            with self._lock:
                if self.nbytes <= self.max_bytes:
                    return
                files = [(e.used, 0, None, e) for e in self.entries.values()]
                files += [(b.used, 1, k, None) for k, b in self.blocks.items()]
                if not files:
                    return
                _, _, block, tail = min(files, key=lambda f: (f[0], f[1]))
            self._drop_files(block, tail)


def _entered(end: int, short: int, mtp: bool) -> tuple[int | None, int]:
    """(tokens the restored caches hold, None: the blocks' `end`; prompt tokens given back)
    of a chain entered without a tail at `end`, `short` tokens short (disk_blocks.layout)."""
    if short <= 0:
        return None, end - mtp
    return end - short, end - short - mtp


def _key(tokens: np.ndarray) -> str:
    return sha(np.asarray(tokens, dtype=np.int64).tobytes())[:32]
