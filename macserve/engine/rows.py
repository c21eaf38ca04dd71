"""Rows of tokens in a fixed-size buffer, bf16 or quantized: what the latent cache
(latent_cache.py) and the DSA indexer's key cache (dsa_indexer.py) are made of.

A buffer grows in blocks at its end (a decode step does not copy it) and drops rows from its
front by copying (so a slice never keeps a prefill chunk's whole buffer alive). `stored` and
`restore` are its part of its cache's stored form (mlx-lm's `state`): the parts cut to the
rows in use, and back.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import mlx.core as mx

CODE_STEP = 256  # code rows added per growth, as mlx-lm's KVCache grows
# On the CPU, codes are dequantized by one compiled elementwise kernel (False: the unfused ops
# it replaced; the bench flips it to measure the difference, tests check both agree).
FUSED_DEQUANTIZE = True
# A decode step unpacks codes through aliases of the buffers shaped once per write
# (`Rows.dense`; False: each step reshapes its slices, as before; the e2e bench flips it).
GROUPED_VIEWS = True


class Rows:
    """A (B, 1, T, D) buffer of rows: bf16, or quantized (codes, scales, biases), with room
    to grow at the end and rows dropped from the front by copying (`keep_last`)."""

    def __init__(self, bits: int | None, group_size: int, step: int):
        self.bits, self.group_size, self.step = bits, group_size, step
        self.parts: tuple[mx.array, ...] | None = None
        self.length = 0
        self._grouped: tuple[mx.array, ...] | None = None  # `dense`'s aliases of the parts

    def group(self, dims: int) -> int:
        """A rotary key of 32 dims is one group of 32: mx.quantize needs group <= dims."""
        return min(self.group_size, dims)

    @property
    def capacity(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[2]

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        # Stored from bf16 whatever the model's dtype: the layout's bytes (bf16 rows, bf16
        # scales and biases) hold on a float32 CPU model too.
        x = x.astype(mx.bfloat16)
        if self.bits is None:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.group(x.shape[-1]), bits=self.bits))

    def append(self, x: mx.array, exact: bool = False) -> None:
        """Add x's rows, growing the buffer when they do not fit: a decode step grows it by
        `step` rows of headroom; a prefill chunk (`exact`) to what it needs, code rows rounded
        up to CODE_STEP and bf16 rows exactly (the window is compacted right after)."""
        new = self.encode(x)
        n = x.shape[2]
        self._grouped = None
        if self.length + n > self.capacity:
            need = self.length + n
            if not exact:
                cap = need + self.step
            elif self.bits is not None:
                cap = -(-need // CODE_STEP) * CODE_STEP
            else:
                cap = need
            if self.length == 0 and n == cap:
                # The rows fill the new buffer: MLX would make the buffer the rows themselves
                # (a full slice assignment returns its update), and the rows are a slice of a
                # prefill chunk (the sink's first 64 rows): the whole chunk would stay alive.
                self.parts = tuple(_copy(p) for p in new)
                self.length = n
                return
            grown = []
            for i, p in enumerate(new):
                buf = mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype)
                if self.parts is not None and self.length:
                    buf[..., : self.length, :] = self.parts[i][..., : self.length, :]
                grown.append(buf)
            self.parts = tuple(grown)
        for p, v in zip(self.parts, new):
            p[..., self.length : self.length + n, :] = v
        self.length += n

    def view(self, start: int, stop: int) -> tuple[mx.array, ...]:
        if start == 0 and stop == self.capacity:  # the whole buffer (a full sink): no slice
            return self.parts
        return tuple(p[..., start:stop, :] for p in self.parts)

    def dense(self, start: int, stop: int, dims: int, dtype=mx.float32) -> mx.array:
        """Rows [start, stop) as dense values of `dtype`, as `decode(view(start, stop))`. On
        the CPU, codes are read through aliases of the buffers already shaped for the
        unpacking kernel (words by group, scales and biases per group), made once per write:
        a decode step then adds three slices and the kernel, not a reshape of each part
        too (every op is a few microseconds of dispatch at the demo's sizes)."""
        if self.bits is None or not GROUPED_VIEWS or not _fused(self.group(dims), self.bits):
            return self.decode(self.view(start, stop), dims, dtype)
        if self._grouped is None:
            g = self.group(dims)
            w, scales, biases = self.parts
            lead = w.shape[:3]
            if self.bits == 8:
                self._grouped = (
                    mx.view(w, mx.uint8).reshape(*lead, dims // g, g),
                    scales.reshape(*lead, dims // g, 1),
                    biases.reshape(*lead, dims // g, 1),
                )
            else:
                self._grouped = (
                    w.reshape(*lead, dims // g, g * self.bits // 32, 1),
                    scales.reshape(*lead, dims // g, 1, 1),
                    biases.reshape(*lead, dims // g, 1, 1),
                )
        w, scales, biases = (x[:, :, start:stop] for x in self._grouped)
        if self.bits == 8:
            out = _bytes_affine(dtype)(w, scales, biases)
        else:
            out = _affine(dtype)(w, _shifts(self.bits), _mask(self.bits), scales, biases)
        return out.reshape(*w.shape[:3], dims)

    def drop_last(self, n: int) -> None:
        self.length -= n

    def keep_last(self, n: int) -> None:
        """Keep only the last n rows, in a fresh buffer with no headroom (the old one is
        freed once nothing reads it)."""
        if self.parts is None or (n == self.length == self.capacity):
            return
        s = self.length - n
        self.parts = tuple(_copy(p[..., s : self.length, :]) for p in self.parts)
        self.length = n
        self._grouped = None

    def decode(self, parts: tuple[mx.array, ...], dims: int, dtype=mx.float32) -> mx.array:
        """Rows as dense values of `dtype`."""
        if self.bits is None:
            return parts[0].astype(dtype)
        w, scales, biases = parts
        return dequantize(w, scales, biases, self.group(dims), self.bits, dtype)

    def arrays(self) -> list[mx.array]:
        return list(self.parts or ())

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts or ())

    def stored(self) -> tuple[mx.array, ...]:
        """The rows in use, part by part (bf16: the rows; quantized: codes, scales, biases)."""
        return tuple(p[..., : self.length, :] for p in self.parts or ())

    def restore(self, parts) -> None:
        """Hold `parts`, as `stored` gave them; ValueError if they are not rows of this kind."""
        parts = tuple(parts)
        n = parts[0].shape[2] if parts else 0
        if parts and len(parts) != (1 if self.bits is None else 3):
            raise ValueError(f"{len(parts)} parts stored, a {self.bits or 16}-bit row has other")
        if any(p.ndim != 4 or p.shape[2] != n for p in parts):
            raise ValueError(f"stored parts of unequal rows: {[p.shape for p in parts]}")
        self.parts, self.length = (parts or None), n
        self._grouped = None

    def clone(self) -> Rows:
        """Shares the buffers until either side writes (MLX copies a buffer on write when
        another array still holds it)."""
        new = Rows(self.bits, self.group_size, self.step)
        new.parts = None if self.parts is None else tuple(p[...] for p in self.parts)
        new.length = self.length
        return new


@dataclass(frozen=True)
class TokenRows:
    """Which arrays of a cache's stored form are rows of tokens that no later token changes,
    so the prompt cache's disk tier can cut them into prefix blocks (server/disk_blocks.py).
    `rows`: a path in the cache's `state` (indices joined by dots) -> (token of its row 0,
    token after its last row in use; the array may hold headroom past it). `complete`: every
    token before it is in those rows. `cuttable`: those rows alone are the cache's state, so
    a prefix of whole blocks is one; `counts` then name the state's token counts (ints)."""

    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    complete: int = 0
    cuttable: bool = False
    counts: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps([self.rows, self.complete, self.cuttable, self.counts])

    @classmethod
    def from_json(cls, text: str) -> TokenRows:
        rows, complete, cuttable, counts = json.loads(text)
        return cls({k: tuple(v) for k, v in rows.items()}, complete, cuttable, tuple(counts))

    @classmethod
    def of_list(cls, parts: list[TokenRows]) -> TokenRows:
        """A CacheList's, from its caches' (its state is [(state, class name), ...])."""
        rows = {f"{j}.0.{k}": v for j, p in enumerate(parts) for k, v in p.rows.items()}
        counts = tuple(f"{j}.0.{k}" for j, p in enumerate(parts) for k in p.counts)
        cut = bool(parts) and all(p.cuttable for p in parts)
        return cls(rows, min((p.complete for p in parts), default=0), cut, counts)


def _copy(x: mx.array) -> mx.array:
    """A copy of rows with a buffer of its own. A slice shares its parent's buffer, and so
    does anything one-input MLX makes of it (mx.contiguous, x + 0, mx.array(x)): MLX donates
    the input's whole allocation to the output when nothing else holds it, which would keep a
    whole prefill chunk's rows alive. A concatenation of two pieces always allocates anew."""
    h = x.shape[2] // 2
    return mx.concatenate([x[..., :h, :], x[..., h:, :]], axis=2)


def dequantize(
    w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, dtype=None
) -> mx.array:
    """mx.dequantize, in `dtype` (default: the scales'). On the CPU by unpacking with shifts and masks:
    MLX's CPU dequantize kernel is scalar (184 ms for 32K x 512 2-bit rows here, against 77 ms
    unpacked with vector ops). Where a group is whole words (2, 4, 8 bits), the unpacking and
    the scale and bias are one compiled elementwise kernel (one pass over the rows instead of
    five: a decode step reads every code row)."""
    dtype = dtype or scales.dtype
    if mx.default_device().type != mx.DeviceType.cpu:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    dims = w.shape[-1] * 32 // bits
    if bits == 8 and _fused(group_size, bits):
        # 8-bit codes are the words' bytes in order: converted, no shift or mask (233 us
        # against 141 for 2,048 x 64 rotary keys here: one broadcast input fewer).
        u = mx.view(w, mx.uint8).reshape(*w.shape[:-1], dims // group_size, group_size)
        out = _bytes_affine(dtype)(u, scales[..., None], biases[..., None])
        return out.reshape(*w.shape[:-1], dims)
    if _fused(group_size, bits):
        words = group_size * bits // 32
        grouped = w.reshape(*w.shape[:-1], dims // group_size, words, 1)
        out = _affine(dtype)(
            grouped, _shifts(bits), _mask(bits), scales[..., None, None], biases[..., None, None]
        )
        return out.reshape(*w.shape[:-1], dims)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    v = unpack(w, bits)
    v = v.reshape(*w.shape[:-1], dims // group_size, group_size).astype(scales.dtype)
    return (v * scales[..., None] + biases[..., None]).reshape(*w.shape[:-1], dims)


def _fused(group_size: int, bits: int) -> bool:
    """Codes are unpacked by one compiled kernel: on the CPU, where a group is whole words."""
    return (
        FUSED_DEQUANTIZE
        and mx.default_device().type == mx.DeviceType.cpu
        and 32 % bits == 0
        and (group_size * bits) % 32 == 0
    )


@functools.cache
def _affine(dtype):
    """codes -> values: one elementwise kernel, compiled once per dtype for any shape."""

    def f(w, shifts, mask, scales, biases):
        return ((w >> shifts) & mask).astype(dtype) * scales.astype(dtype) + biases.astype(dtype)

    return mx.compile(f, shapeless=True)


@functools.cache
def _bytes_affine(dtype):
    """8-bit codes (bytes) -> values: one elementwise kernel, compiled once per dtype."""

    def f(u, scales, biases):
        return u.astype(dtype) * scales.astype(dtype) + biases.astype(dtype)

    return mx.compile(f, shapeless=True)


@functools.cache
def _shifts(bits: int) -> mx.array:
    return mx.arange(0, 32, bits, dtype=mx.uint32)


@functools.cache
def _mask(bits: int) -> mx.array:
    return mx.array((1 << bits) - 1, dtype=mx.uint32)


def unpack(w: mx.array, bits: int) -> mx.array:
    """The codes mx.quantize packed into uint32 words, one per value (uint32). MLX packs them
    as one little-endian bit stream: for 2, 4 and 8 bits each word holds 32 / bits whole
    codes; for 3, 5 and 6 a code can straddle two words, but 8 codes always fill `bits`
    bytes, so those bytes are read as one wider word and cut there."""
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        return ((w[..., None] >> shifts) & mask).reshape(*w.shape[:-1], -1)
    wide = mx.uint32 if bits <= 4 else mx.uint64
    b = mx.view(w, mx.uint8).reshape(*w.shape[:-1], -1, bits).astype(wide)
    word = b[..., 0]
    for k in range(1, bits):
        word = word | (b[..., k] << (8 * k))
    shifts = mx.arange(0, 8 * bits, bits, dtype=wide)
    return ((word[..., None] >> shifts) & mask).astype(mx.uint32).reshape(*w.shape[:-1], -1)
