"""A layer's cache as named arrays and string metadata (safetensors' two parts), and back:
what the prompt cache's disk tier writes (server/disk_cache.py).

Generic over mlx-lm's cache protocol: every cache class says what it holds (`state`: arrays,
ints, floats, strings, None, nested in tuples and lists) and restores itself from it (a
`state` setter; `from_state`), as mlx-lm's own classes and ours (latent_cache.py,
dsa_indexer.py) do; `mlx_lm.models.cache.save_prompt_cache` stores the same trees. Here the
state is flattened under `key` (arrays by path, `key.s.0.1`; the rest as typed strings in the
metadata) beside its class name, and restored by setting `state` on a fresh cache the server
built for that layer (it holds the calibration's rotation, which no state does; a stored
class other than the fresh one's is refused).

Beside it, for the disk tier, which arrays are rows of tokens (`TokenRows`): the class's
own `stored_rows()`, or for mlx-lm's classes the table below. The INT2 latent cache is
stored in a form of its own (stored_codes.py): codes for every row past the sink, its bf16
window apart, so the window is written once per snapshot rather than once per prefix block.
"""

from __future__ import annotations

import mlx.core as mx

from . import stored_codes
from .rows import TokenRows


def _kv_rows(cache) -> TokenRows:
    """mlx-lm's KVCache: state (keys, values, offset), rows [0, offset) of buffers with
    headroom past it; its rows alone are its state."""
    n = cache.offset
    return TokenRows({"0": (0, n), "1": (0, n)}, n, True, ("2",))


MLX_ROWS = {  # mlx-lm's classes whose state is made of token rows; any other: none are
    "KVCache": _kv_rows,
    "CacheList": lambda c: TokenRows.of_list([token_rows(x) for x in c.caches]),
}


def token_rows(cache) -> TokenRows:
    own = getattr(cache, "stored_rows", None)
    if own is not None:
        return own()
    rows = MLX_ROWS.get(type(cache).__name__)
    return rows(cache) if rows is not None else TokenRows()


def _put(x, key: str, arrays: dict, meta: dict) -> None:
    if isinstance(x, mx.array):
        arrays[key] = x
    elif isinstance(x, tuple | list):
        meta[key] = f"seq:{len(x)}"
        for j, y in enumerate(x):
            _put(y, f"{key}.{j}", arrays, meta)
    elif x is None:
        meta[key] = "none"
    elif isinstance(x, bool):  # before int: a bool is an int
        meta[key] = f"bool:{int(x)}"
    elif isinstance(x, int | float | str):
        meta[key] = f"{type(x).__name__}:{x}"
    else:
        raise ValueError(f"{key}: a state item of type {type(x).__name__}")


def _get(key: str, arrays: dict, meta: dict):
    if key in arrays:
        return arrays[key]
    tag, _, v = meta[key].partition(":")
    if tag == "seq":
        return tuple(_get(f"{key}.{j}", arrays, meta) for j in range(int(v)))
    read = {
        "none": lambda _: None,
        "bool": lambda s: s == "1",
        "int": int,
        "float": float,
        "str": str,
    }
    if tag not in read:
        raise ValueError(f"{key}: unknown stored item {meta[key]!r}")
    return read[tag](v)


def to_stored(cache, key: str, arrays: dict, meta: dict) -> None:
    """Add one layer's cache to `arrays` / `meta` under `key`: its class, its state, and
    which of its arrays are token rows (`key.rows`, for disk_blocks.py). The INT2 latent
    cache has a form of its own: codes for every row, its window apart (stored_codes.py)."""
    if stored_codes.handles(cache):
        stored_codes.put(cache, key, arrays, meta)
        return
    meta[f"{key}.class"] = type(cache).__name__
    _put(cache.state, f"{key}.s", arrays, meta)
    if ms := getattr(cache, "meta_state", None):  # mlx-lm before 0.32: scalars kept apart
        _put(ms, f"{key}.m", arrays, meta)
    meta[f"{key}.rows"] = token_rows(cache).to_json()


def restore(fresh, key: str, arrays: dict, meta: dict, at: int | None = None):
    """`fresh` (a new, empty cache of the layer the server runs) holding what `key` stored;
    ValueError if the stored class or shape does not fit it. `at`: a codes form's first `at`
    tokens, entered without its window (stored_codes.restore)."""
    stored = meta.get(f"{key}.class")
    if stored != type(fresh).__name__:
        raise ValueError(f"{key}: stored {stored}, the model's cache is {type(fresh).__name__}")
    if meta.get(f"{key}.form") == stored_codes.FORM:
        return stored_codes.restore(fresh, key, arrays, meta, at)
    try:
        fresh.state = _get(f"{key}.s", arrays, meta)
        if f"{key}.m" in meta:
            fresh.meta_state = _get(f"{key}.m", arrays, meta)
    except (TypeError, KeyError) as e:  # a state of another shape than the class's
        raise ValueError(f"{key}: a {stored} state that does not fit: {e}") from None
    return fresh


def stored_keys(meta: dict) -> list[str]:
    """The keys of the caches a stored form holds."""
    return [k[: -len(".class")] for k in meta if k.endswith(".class")]
