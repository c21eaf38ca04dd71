"""A snapshot's stored form (engine/stored_form.py) cut into N-token prefix blocks and a
tail, and put back together.

Block i holds, for every layer, the rows of tokens [iN, (i+1)N) that a snapshot holds in a
form that no later token changes (each cache class declares them: `stored_rows`, or
engine/stored_form.py's table for mlx-lm's): mlx-lm's KVCache rows, the DSA indexer's key
rows, and the INT2 latent cache's bf16 sink rows (tokens [0, sink), so block 0's) and INT2
code rows for every token past the sink (engine/stored_codes.py: the window's rows too,
quantized as the cache will quantize them). The MTP layer's row r is (h_r, token r + 1): it
belongs with token r + 1, so block i holds MTP rows for tokens [iN, (i+1)N) too and needs no
token beyond the block's own. A block is named by a chain hash of the tokens up to its end
(plus whether it carries MTP rows), so two snapshots that share a prefix share its blocks.

The tail holds the rest: rows from the last whole block on, the INT2 cache's bf16 window
(the last `recent` + `slack` tokens: the only window a stored prefix holds), every array
that is not made of rows (another cache kind: all of it), and the snapshot's metadata.
Loading blocks 0..k-1 and the tail gives back the snapshot's state byte for byte.

A chain can also be entered at a block boundary P without a tail (`layout`'s `short` >= 0):
where every layer is made of rows alone (mlx-lm's KVCache, the bf16 cache), the state a cold
prefill of those tokens leaves is those rows; where latent caches hold codes, their state at
P - recent is rebuilt from the codes and the last `recent` tokens are prefilled again
(engine/stored_codes.py says what that state is and what equality it keeps).
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from ..engine import stored_codes
from ..engine.rows import TokenRows
from ..engine.stored_form import stored_keys, to_stored, token_rows


def _shift(owner: str) -> int:
    return 1 if owner == "mtp" or owner.startswith("mtp.") else 0


def layout(arrays: dict, meta: dict) -> tuple[dict[str, tuple[int, int]], int, int]:
    """({array: (token of its row 0, token after its last valid row)} for the arrays made of
    rows, the token up to which every layer's rows are complete, `short`); each cache's rows
    as its class declared them (engine/stored_form.py: `key.rows`). `short`: how many tokens
    short of its end a chain of whole blocks is entered without a tail: 0 where every cache
    is made of rows alone, the INT2 window's `recent` where latent caches hold codes
    (engine/stored_codes.py), -1 where some cache cannot be (its state is more than rows)."""
    rows: dict[str, tuple[int, int]] = {}
    complete = []
    short = 0
    for owner in stored_keys(meta):
        s = _shift(owner)
        tr = TokenRows.from_json(meta[f"{owner}.rows"])
        for path, (first, end) in tr.rows.items():
            if f"{owner}.s.{path}" in arrays:
                rows[f"{owner}.s.{path}"] = (s + first, s + end)
        complete.append(s + tr.complete)
        own = int(meta[f"{owner}.short"]) if f"{owner}.short" in meta else -1
        own = 0 if tr.cuttable else own
        short = -1 if -1 in (short, own) else max(short, own)
    return rows, min(complete, default=0), short


def short_of(caches: list) -> int:
    """`layout`'s `short` for a snapshot of these caches, from their classes alone (no state
    is read: PromptCache.keep_on_disk asks before any entry exists)."""
    out = 0
    for c in caches:
        if stored_codes.handles(c):
            own = stored_codes.short(c.quant)
        else:
            own = 0 if token_rows(c).cuttable else -1
        if own < 0:
            return -1
        out = max(out, own)
    return out


def entry_form(tokens, caches: list, mtp, meta: dict, n: int) -> tuple[list[dict], dict, int]:
    """(blocks, tail, short: `layout`'s) of a snapshot: its caches' stored forms (`L{i}`, `mtp`) and
    tokens, cut into `n`-token blocks; `meta` gets the caches' metadata."""
    arrays: dict = {"tokens": mx.array(np.asarray(tokens, dtype=np.int32))}
    for i, c in enumerate(caches):
        to_stored(c, f"L{i}", arrays, meta)
    if mtp is not None:
        to_stored(mtp, "mtp", arrays, meta)
    blocks, tail = split(arrays, meta, n)
    return blocks, tail, layout(arrays, meta)[2]


def chain_keys(tokens: np.ndarray, n: int, k: int, mtp: bool, salt: str) -> list[str]:
    """Names of blocks 0..k-1 of `tokens`: block i's hashes every token before its end."""
    h = hashlib.sha256((salt + (":mtp" if mtp else "")).encode())
    keys = []
    t = np.asarray(tokens, dtype=np.int64)
    for i in range(k):
        h.update(t[i * n : (i + 1) * n].tobytes())
        keys.append(h.copy().hexdigest()[:32])
    return keys


def _rows(a: mx.array, first: int, lo: int, hi: int) -> mx.array:
    """The rows of `a` (row 0 is token `first`) for tokens [lo, hi)."""
    r0, r1 = max(0, lo - first), max(0, hi - first)
    return a[..., r0:r1, :]


def split(arrays: dict, meta: dict, n: int) -> tuple[list[dict], dict]:
    """(blocks 0..k-1, the tail) of one snapshot's stored form (tokens included)."""
    rows, complete, _ = layout(arrays, meta)
    k = complete // n
    blocks = []
    tokens = arrays["tokens"]
    for i in range(k):
        lo, hi = i * n, (i + 1) * n
        b = {"tokens": tokens[lo:hi]}
        for name, (first, end) in rows.items():
            if min(hi, end) > max(lo, first):
                b[name] = _rows(arrays[name], first, lo, min(hi, end))
        blocks.append(b)
    tail = {"tokens": tokens}
    for name, a in arrays.items():
        if name in rows:
            first, end = rows[name]
            tail[name] = _rows(a, first, max(k * n, first), end)
        elif name != "tokens":
            tail[name] = a
    return blocks, tail


def join(blocks: list[dict], tail: dict | None, meta: dict, tokens: int) -> dict:
    """The stored form of blocks 0..k-1 and `tail` (None: a chain entered at its last
    block; `meta` is then the block's, and is changed to hold `tokens` tokens)."""
    names = dict.fromkeys(k for part in [*blocks, tail or {}] for k in part if k != "tokens")
    out = {}
    for name in names:
        parts = [b[name] for b in blocks if name in b]
        if tail is not None and name in tail:
            parts.append(tail[name])
        out[name] = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    if tail is None:  # caches of rows alone: their token counts are the blocks' end
        for owner in stored_keys(meta):
            for path in TokenRows.from_json(meta[f"{owner}.rows"]).counts:
                meta[f"{owner}.s.{path}"] = f"int:{tokens - _shift(owner)}"
    return out
