"""Read a GGUF file's metadata (key/value header) from any readable binary stream.

Only the header is read, never tensor data, so the same code serves a local file and an
HTTP range-request stream (hub.HttpRangeFile) at a cost of kilobytes.
Arrays of more than `max_array` items (token lists, merges) are skipped, not kept.
"""

from __future__ import annotations

import struct

from ..errors import MacserveError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, f, name: str):
        self.f, self.name, self.read_bytes = f, name, 0

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        self.read_bytes += len(b)
        if len(b) != n:
            raise MacserveError(f"{self.name}: truncated GGUF header")
        return b

    def scalar(self, t: int):
        fmt = _SCALARS[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        (n,) = struct.unpack("<Q", self.take(8))
        if n > 1 << 24:
            raise MacserveError(f"{self.name}: corrupt GGUF header (string of {n} bytes)")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, t: int, max_array: int):
        if t in _SCALARS:
            return self.scalar(t)
        if t == _STRING:
            return self.string()
        if t == _ARRAY:
            (et,) = struct.unpack("<I", self.take(4))
            (n,) = struct.unpack("<Q", self.take(8))
            if n > 1 << 32:
                raise MacserveError(f"{self.name}: corrupt GGUF header (array of {n} items)")
            if et not in _SCALARS and et not in (_STRING, _ARRAY):
                raise MacserveError(f"{self.name}: corrupt GGUF header (array type {et})")
            if et in _SCALARS and n > max_array:
                self.skip(n * struct.calcsize(_SCALARS[et]))
                return {"array_len": n}
            items = [self.value(et, max_array) for _ in range(n)]
            return items if n <= max_array else {"array_len": n}
        raise MacserveError(f"{self.name}: corrupt GGUF header (value type {t})")

    def skip(self, n: int):
        # Streams over HTTP seek cheaply; reading would fetch what we skip.
        try:
            self.f.seek(n, 1)
        except (AttributeError, OSError, ValueError):
            self.take(n)


def read_gguf_metadata(f, name: str = "GGUF", max_array: int = 4096) -> tuple[dict, int]:
    """(metadata dict, bytes read). Raises MacserveError on a non-GGUF or truncated file."""
    r = _Reader(f, name)
    magic = f.read(4)
    r.read_bytes += len(magic)
    if magic != b"GGUF":
        raise MacserveError(f"{name}: not a GGUF file")
    version = r.scalar(4)
    if version not in (2, 3):
        raise MacserveError(f"{name}: unsupported GGUF version {version}")
    _n_tensors, n_kv = struct.unpack("<QQ", r.take(16))
    if n_kv > 1 << 20:
        raise MacserveError(f"{name}: corrupt GGUF header ({n_kv} keys)")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        (t,) = struct.unpack("<I", r.take(4))
        meta[key] = r.value(t, max_array)
    meta["gguf.tensor_count"] = _n_tensors
    return meta, r.read_bytes
