"""The INT2 latent cache's stored form for the prompt cache's disk tier: codes for every row
past the sink, and the bf16 window of one snapshot only (server/disk_cache.py).

The cache's own `state` (latent_cache.py) holds tokens [offset - recent - slack, offset) as a
bf16 window, which later tokens turn into codes: stored as is, every snapshot (each whole
prefill chunk's end, each request's end) would carry a window of its own, and no prefix
block could be shared past a window. Here, built on the cache's public protocol alone
(`state`, its setter, `quant`, `rotation`, `clip`, `offset`):

- **codes** for tokens [sink, offset), in the layer's format: the state's own code rows, and
  the window's rows quantized now exactly as the cache will quantize them when they leave its
  window (clipped by `clip` or the row quantile, cast to bf16, `mx.quantize` in groups), so
  the codes of a token are the same bytes whichever snapshot wrote them, and a block of
  them is shared by every snapshot of that prefix;
- the **sink**'s bf16 rows (tokens [0, sink)), and for a layer stored in bf16 (a gate's
  `bf16` format: `quant.bits` None) every row in bf16: rows no later token changes;
- for a cache whose window never ends (KV=auto in a share that holds every row bf16:
  `recent` is ALL_ROWS, server/capacity.fitted), its window's bf16 rows as rows of the
  blocks, as the sequence held them: no code is made of them (`rows_form`). A prefix of
  whole blocks is then entered at its end with no token prefilled again, and gives back
  exactly the state a prefill of those tokens leaves (the window of a longer snapshot is
  the same rows);
- the **window** (its bf16 rows, `recent` + `slack` tokens): not rows of the prefix blocks,
  so only the snapshot's tail holds it (server/disk_blocks.py).

`restore` gives back:

- with the window (the snapshot's own end, `at` None): the snapshot's state, byte for byte;
- without it, at `at` tokens (a prefix of whole blocks, entered without a tail): what the
  cache would hold at `at` but with its window's rows dequantized from their codes. The disk
  tier enters such a prefix of P tokens at `at` = P - `short(...)` (= recent), so the last
  `recent` tokens are prefilled again: every query of the request's own tokens finds in its
  window rows a prefill computed, never a code's dequantized value; only those recomputed
  tokens saw a window made of codes. Not the engine's state bit for bit (no file holds the
  bf16 rows it had): the codes are exact, the rest is a prefill's over a window of codes.
  What is kept: the request's logits stay closer to a cold INT2 prefill's than INT2's own
  are to the bf16 cache's (tests/test_disk_codes.py); greedy answers are a cold prefill's
  in the tests' chats, though a near-tie can flip where an exact state would not.
"""

from __future__ import annotations

import json

import mlx.core as mx

from ..cache_kinds import ALL_ROWS
from ..int2_format import LatentQuant
from .latent_cache import RotatedLatentCache
from .rows import TokenRows

FORM = "codes"  # meta[key.form]: this stored form, not the generic state (stored_form.py)
WINDOW = ("wl", "wp")  # the window's arrays: the tail's alone


def handles(cache) -> bool:
    return isinstance(cache, RotatedLatentCache)


def _encode(x: mx.array, bits: int | None, group_size: int) -> tuple[mx.array, ...]:
    """Rows as the cache stores them (rows.Rows.encode): bf16, then quantized in groups of
    at most the row's width."""
    x = x.astype(mx.bfloat16)
    if bits is None:
        return (x,)
    return tuple(mx.quantize(x, group_size=min(group_size, x.shape[-1]), bits=bits))


def _clipped(cache, u: mx.array) -> mx.array:
    """What the cache quantizes a latent row from (RotatedLatentCache's clipping)."""
    q = cache.quant
    if q.row_quantile is not None:
        t = mx.sort(mx.abs(u), axis=-1)
        k = int(round(q.row_quantile * (u.shape[-1] - 1)))
        lim = t[..., k : k + 1]
        return mx.clip(u, -lim, lim)
    if cache.clip is not None:
        return mx.clip(u, -cache.clip, cache.clip)
    return u


def _decode(parts: tuple[mx.array, ...], bits: int, group_size: int, dims: int) -> mx.array:
    w, scales, biases = parts
    g = min(group_size, dims)
    return mx.dequantize(w, scales, biases, group_size=g, bits=bits).astype(mx.bfloat16)


def _cat(a: tuple, b: tuple) -> tuple:
    if not a:
        return b
    if not b:
        return a
    return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b))


def rows_form(q: LatentQuant) -> bool:
    """Every row this layer holds is bf16 for good (a bf16 format, or a window that never
    ends): it is stored as its rows, not as codes."""
    return q.bits is None or q.recent >= ALL_ROWS


def short(q: LatentQuant) -> int:
    """Tokens a prefix entered without its window is given back short of its end: the
    window's `recent`, prefilled again (0 where every row is bf16: its rows are all)."""
    return 0 if rows_form(q) else q.recent


def put(cache, key: str, arrays: dict, meta: dict) -> None:
    """Add one latent cache's codes form to `arrays` / `meta` under `key`."""
    fmt, rotated, offset, win_start, d0, d1, sl, sp, cl, cp, wl, wp = cache.state
    q = cache.quant
    meta[f"{key}.class"] = type(cache).__name__
    meta[f"{key}.form"] = FORM
    meta[f"{key}.fmt"] = fmt
    codes_end = q.sink + (cl[0].shape[2] if cl else 0)  # tokens [sink, codes_end): codes
    head = {"rotated": rotated, "offset": offset, "win_start": win_start, "dims": [d0, d1]}
    head["codes_end"] = codes_end
    meta[f"{key}.head"] = json.dumps(head)
    meta[f"{key}.short"] = str(short(q))
    rows: dict[str, tuple[int, int]] = {}

    def add(name: str, parts: tuple, first: int) -> None:
        for j, p in enumerate(parts):
            arrays[f"{key}.s.{name}.{j}"] = p
            rows[f"{name}.{j}"] = (first, first + p.shape[2])

    if q.bits is None:  # every token a bf16 row in the window, from token 0
        add("rl", wl, 0), add("rp", wp, 0)
    elif rows_form(q):  # the sink's rows, then the window's from its start: every row bf16
        add("sl", sl, 0), add("sp", sp, 0)
        add("rl", wl, win_start), add("rp", wp, win_start)
    else:
        add("sl", sl, 0), add("sp", sp, 0)
        # The window's rows past the codes, quantized as the cache will when they leave it.
        a = codes_end - win_start
        if wl and a < wl[0].shape[2]:
            lat = _encode(_clipped(cache, wl[0][..., a:, :]), q.bits, q.group_size)
            pe = _encode(wp[0][..., a:, :], q.rope_bits, q.group_size)
            cl, cp = _cat(cl, lat), _cat(cp, pe)
        add("cl", cl, q.sink), add("cp", cp, q.sink)
        for name, parts in zip(WINDOW, (wl, wp)):
            for j, p in enumerate(parts):
                arrays[f"{key}.s.{name}.{j}"] = p
    meta[f"{key}.rows"] = TokenRows(rows, offset).to_json()


def _parts(arrays: dict, key: str, name: str) -> tuple:
    out, j = [], 0
    while f"{key}.s.{name}.{j}" in arrays:
        out.append(arrays[f"{key}.s.{name}.{j}"])
        j += 1
    return tuple(out)


def _rows(parts: tuple, lo: int, hi: int) -> tuple:
    return tuple(p[..., lo:hi, :] for p in parts) if hi > lo else ()


def restore(fresh, key: str, arrays: dict, meta: dict, at: int | None = None):
    """`fresh` (a new cache of the layer) holding the stored snapshot (`at` None: its window
    must be there) or its first `at` tokens with a window made of their codes."""
    fmt = meta[f"{key}.fmt"]
    q = LatentQuant(**json.loads(fmt))
    h = json.loads(meta[f"{key}.head"])
    offset, win_start = h["offset"], h["win_start"]
    d0, d1 = h["dims"]
    exact = at is None or at == offset and f"{key}.s.wl.0" in arrays
    sl, sp, cl, cp = (_parts(arrays, key, n) for n in ("sl", "sp", "cl", "cp"))
    rl, rp = _parts(arrays, key, "rl"), _parts(arrays, key, "rp")
    if rows_form(q) and q.bits is not None and (cl or f"{key}.s.wl.0" in arrays):
        # written as codes before such a cache was stored as its rows (same format 4): skipped
        # (and deleted) by the disk tier, never read as rows
        raise ValueError(f"{key}: a never-ending window stored as codes, not as its rows")
    if at is None and rows_form(q):
        # the rows there are (a chain of blocks entered without its tail: to their end)
        at = sum(p[0].shape[2] for p in (sl, rl) if p)
    at = offset if at is None else at
    if at > offset:
        raise ValueError(f"{key}: {at} tokens asked of a snapshot of {offset}")
    if q.bits is None:
        stores = ((), (), (), (), _rows(rl, 0, at), _rows(rp, 0, at))
        state = (fmt, h["rotated"], at, win_start, d0, d1, *stores)
    elif rows_form(q):
        n_sink, first = min(at, q.sink), h["win_start"] if at == offset else q.sink
        stores = (
            _rows(sl, 0, n_sink),
            _rows(sp, 0, n_sink),
            (),
            (),
            _rows(rl, 0, at - first),
            _rows(rp, 0, at - first),
        )
        state = (fmt, h["rotated"], at, first if at > q.sink else win_start, d0, d1, *stores)
    elif exact:
        if at > q.sink and not _parts(arrays, key, "wl") and win_start < at:
            raise ValueError(f"{key}: the snapshot's window is not there")
        n = h["codes_end"] - q.sink
        wl, wp = _parts(arrays, key, "wl"), _parts(arrays, key, "wp")
        stores = (sl, sp, _rows(cl, 0, n), _rows(cp, 0, n), wl, wp)
        state = (fmt, h["rotated"], at, win_start, d0, d1, *stores)
    else:
        n_sink = min(at, q.sink)
        codes_end = max(q.sink, at - q.recent)
        # As a prefill leaves it: the last recent + slack tokens past the sink in the window.
        start = max(q.sink, at - q.recent - q.slack)
        lo, hi = start - q.sink, at - q.sink
        wl = _rows(cl, lo, hi)
        wp = _rows(cp, lo, hi)
        if wl:
            wl = (_decode(wl, q.bits, q.group_size, d0),)
            wp = (_decode(wp, q.rope_bits, q.group_size, d1),)
        n = codes_end - q.sink
        stores = (
            _rows(sl, 0, n_sink),
            _rows(sp, 0, n_sink),
            _rows(cl, 0, n),
            _rows(cp, 0, n),
            wl,
            wp,
        )
        state = (fmt, h["rotated"], at, start if at > q.sink else q.sink, d0, d1, *stores)
    try:
        fresh.state = state
    except (TypeError, KeyError, IndexError) as e:
        raise ValueError(f"{key}: a stored latent cache that does not fit: {e}") from None
    return fresh
