"""The prompt cache: the caches of recent sequences, so a request that shares a prefix with one
(the next turn of a chat, the same system prompt) prefills only the rest.

Entries are snapshots taken at two points of each request: the end of its prompt (a clone of
the caches, sharing memory with the running sequence until it writes) and the end of its
generation (the sequence's own caches, handed over). A follow-up chat turn (old prompt +
answer + new message) extends the second with a rollback of a token or two, or the first with
none at all.

`fetch` reuses the entry with the longest usable common prefix: a clone of it, rolled back to
that prefix with `trim`, exactly or not at all. mlx-lm's caches trim anything; the INT2
latent cache only as far back as its bf16 window still covers the last `recent` (512)
tokens (`trimmable()`), so an entry that would need a longer rollback is passed over for a
shorter one (or none). At least one prompt token is always left to prefill: its logits start the
answer.

A drafting (MTP) request also needs the MTP layer's cache: its rows (h_i, token i+1) for
i < n - 1 (MTPDecoder.prefill). Entries made by drafting requests keep it; a drafting request
reuses only such entries, and one token less than it shares, so the last shared token is
prefilled again and its hidden state, which the next MTP row needs, recomputed. Plain
requests use any entry and ignore its MTP cache.

Bytes are counted as allocated (`cache_bytes`); past `max_bytes` the least recently used
entries go. mlx-lm's own `LRUPromptCache` deep-copies entries and trims without checking the
count, which the INT2 cache cannot honour; hence this class.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList

from ..engine.caches import cache_bytes, clone


def trimmable(cache) -> int:
    """Tokens one layer's cache can roll back exactly."""
    if isinstance(cache, CacheList):
        return min(trimmable(c) for c in cache.caches)
    if hasattr(cache, "trimmable"):
        return cache.trimmable()
    return cache.offset if cache.is_trimmable() else 0


def offset(cache) -> int:
    return cache.caches[0].offset if isinstance(cache, CacheList) else cache.offset


def _trim(caches: list, n: int) -> bool:
    """Roll every cache back n tokens; False if any could not do it exactly."""
    return n == 0 or all(c.trim(n) == n for c in caches)


def _states(caches: list) -> list:
    return [c.state for c in caches]


@dataclass
class Entry:
    tokens: np.ndarray  # the tokens whose keys the caches hold, in order
    caches: list  # one per trunk layer
    mtp: Any  # the MTP layer's cache (len(tokens) - 1 rows), or None
    nbytes: int
    gone: bool = False  # folded into a longer entry (its disk write, if pending, is moot)

    def rollback_ok(self, keep: int, mtp: bool) -> bool:
        """Whether the caches can go back to `keep` tokens (and the MTP cache to as many
        rows) exactly."""
        back = len(self.tokens) - keep
        if any(trimmable(c) < back for c in self.caches):
            return False
        return not mtp or trimmable(self.mtp) >= back - 1


@dataclass
class Hit:
    caches: list  # the trunk's caches holding the first `cached` prompt tokens
    mtp: Any  # the MTP layer's cache with `cached` rows, for a drafting request
    cached: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PromptCache:
    """LRU entries within `max_bytes` (0: off). Used by the worker thread; `stats` may be
    read from others."""

    def __init__(self, max_bytes: int, disk=None):
        """`disk`: a disk_cache.DiskTier behind this one, or None."""
        self.max_bytes = max_bytes
        self.disk = disk
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0
        self.disk_hits = 0  # of `hits`, those whose entry came from the disk tier
        self.disk_tokens = 0
        self._lock = threading.Lock()

    def stats(self) -> dict:
        """Totals (hits and cached_tokens of every tier) and each tier's own."""
        with self._lock:
            mem = {
                "hits": self.hits - self.disk_hits,
                "cached_tokens": self.cached_tokens - self.disk_tokens,
                "bytes": self.nbytes,
            }
            disk = self.disk.stats() if self.disk is not None else None
            return {
                "entries": len(self.entries),
                "bytes": self.nbytes,
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "cached_tokens": self.cached_tokens,
                "tiers": {
                    "memory": mem,
                    "disk": disk or {"hits": 0, "cached_tokens": 0, "bytes": 0},
                },
            }

    def _best(self, ids: np.ndarray, mtp: bool) -> tuple[int | None, int]:
        """The memory entry giving the longest prefix of `ids`, and that prefix's length."""
        best, best_keep = None, 0
        for key, e in self.entries.items():
            if mtp and e.mtp is None:
                continue
            keep = min(common_prefix(e.tokens, ids), len(ids) - 1)
            if mtp:
                keep -= 1  # the last shared token is prefilled again (its hidden state)
            if keep > best_keep and e.rollback_ok(keep, mtp):
                best, best_keep = key, keep
        return best, best_keep

    def reusable(self, prompt: list[int], mtp: bool = False) -> int:
        """Prompt tokens `fetch` would give, looked up without taking anything (no counts)."""
        ids = np.asarray(prompt, dtype=np.int64)
        keep = self._best(ids, mtp)[1]
        if self.disk is not None and self.max_bytes > 0:
            plan = self.disk.best(ids, mtp, keep)
            keep = plan.keep if plan else keep
        return keep

    def fetch(self, prompt: list[int], mtp: bool = False) -> Hit | None:
        """Caches holding the longest prefix of `prompt` that an entry can give back exactly
        (never the whole prompt), or None. The disk tier is asked when it holds a longer
        prefix than memory does (an entry, or whole prefix blocks: disk_cache.py); what it
        loads becomes a memory entry and is served from there."""
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_keep = self._best(ids, mtp)
        tier = "memory"
        if self.disk is not None and self.max_bytes > 0:
            plan = self.disk.best(ids, mtp, best_keep)
            loaded = self.disk.load(plan, mtp, best_keep) if plan else None
            if loaded is not None:
                nbytes = sum(cache_bytes(c) for c in loaded.caches)
                nbytes += 0 if loaded.mtp is None else cache_bytes(loaded.mtp)
                e = Entry(loaded.tokens, loaded.caches, loaded.mtp, nbytes)
                with self._lock:
                    best = self._next
                    self._next += 1
                    self.entries[best] = e
                    self.nbytes += nbytes
                best_keep, tier = loaded.keep, "disk"
        if best is None:
            with self._lock:
                self.misses += 1
            return None
        e = self.entries[best]
        self.entries.move_to_end(best)
        caches = [clone(c) for c in e.caches]
        extra = None
        if mtp:
            extra = clone(e.mtp)
            ok = _trim([extra], (len(e.tokens) - 1) - best_keep)
        else:
            ok = True
        ok = ok and _trim(caches, len(e.tokens) - best_keep)
        if not ok or any(offset(c) != best_keep for c in caches):
            # rollback_ok said yes; a cache that disagrees is a bug to see, not to serve.
            raise RuntimeError(f"a prompt-cache entry could not roll back to {best_keep} tokens")
        with self._lock:
            self.hits += 1
            self.cached_tokens += best_keep
            if tier == "disk":
                self.disk_hits += 1
                self.disk_tokens += best_keep
            self._evict()  # after the hit: a disk entry larger than the budget served once
        if tier == "disk":
            self.disk.count_hit(best_keep)
        return Hit(caches, extra, best_keep)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def keep_on_disk(self, tokens: list[int], caches: list) -> None:
        """A prefill's state at a chunk's end, for the disk tier alone, where a chain of its
        blocks cannot be entered without a tail (a DSA layer's caches): a chat that shares only
        those tokens (a system prompt) can start from it. Nothing for caches whose blocks are
        entered anywhere (bf16, and INT2, whose blocks hold codes: disk_blocks.py)."""
        if self.disk is None or self.max_bytes <= 0 or self.disk.cuttable:
            return
        if any(offset(c) != len(tokens) for c in caches):
            return
        ids = np.asarray(tokens, dtype=np.int64)
        reach = min(trimmable(c) for c in caches)
        parts, meta = self.disk.stored_form(ids, caches, None, reach, -1)
        self.disk.put(ids, parts, meta, None)

    def insert(self, tokens: list[int], caches: list, mtp=None) -> None:
        """Keep `caches` (which hold exactly `tokens`; the entry owns them from now on: pass a
        clone of caches still in use) and the MTP cache, if any."""
        if self.max_bytes <= 0 or not tokens:
            return
        if any(offset(c) != len(tokens) for c in caches):
            return  # not a clean snapshot (a cut-off generation): not worth a guess
        mx.eval(_states(caches), [] if mtp is None else mtp.state)
        nbytes = sum(cache_bytes(c) for c in caches) + (0 if mtp is None else cache_bytes(mtp))
        if nbytes > self.max_bytes:
            return
        new = Entry(np.asarray(tokens, dtype=np.int64), list(caches), mtp, nbytes)
        folded = []
        with self._lock:
            # An entry this one covers (its tokens a prefix of these, within an exact rollback
            # of this one, one token to spare for a drafting request, and no MTP cache this
            # one lacks) only takes space.
            for key in [
                k
                for k, e in self.entries.items()
                if len(e.tokens) <= len(new.tokens)
                and common_prefix(e.tokens, new.tokens) == len(e.tokens)
                and (e.mtp is None or mtp is not None)
                and new.rollback_ok(max(0, len(e.tokens) - 1), e.mtp is not None)
            ]:
                old = self.entries.pop(key)
                old.gone = True
                folded.append(old)
                self.nbytes -= old.nbytes
            self.entries[self._next] = new
            self._next += 1
            self.nbytes += nbytes
            self._evict()  # memory's LRU only: the disk tier keeps what memory drops
        if self.disk is not None:
            for old in folded:
                self.disk.drop(old.tokens)
            reach = min(trimmable(c) for c in caches)
            mtp_reach = -1 if mtp is None else trimmable(mtp)
            arrays, meta = self.disk.stored_form(new.tokens, caches, mtp, reach, mtp_reach)
            self.disk.put(new.tokens, arrays, meta, new)
