"""A quantized MLA latent cache on mlx-lm's cache protocol.

Per layer and token an MLA model caches one latent c (kv_lora_rank dims) and one rotary key
k_pe (qk_rope_head_dim dims). This cache stores u = c @ R (R orthogonal, fitted by
`calibration.py`), clipped per rotated dimension, quantized with `mx.quantize`, and k_pe at
8 bits, in the layout `int2_format.LatentQuant` defines. Attention reads it without
dequantizing on a GPU (see `mla_attention.py`).

Token layout, in token order:

    sink    tokens [0, sink)                    bf16
    codes   tokens [sink, offset - recent)      quantized
    window  tokens [offset - recent, offset)    bf16

A token is quantized when it leaves the window, not before: no token is held twice, so a
sequence holds (offset - sink - recent) code rows and sink + recent bf16 rows (plus `slack`).
The window keeps `slack` bf16 rows more than it shows, so `trim` can roll back up to that
many tokens (speculative decoding's rejected drafts) to exactly the state the cache had
before them; a trim further than the rows held refuses (returns how far it could go).

During a prefill chunk of L tokens, each query p must see tokens older than p - recent as
codes and its own last `recent` tokens in bf16, exactly as L single decode steps would: so the
window holds the chunk's rows plus `recent` before it while the chunk is attended, and is cut
back to recent + slack rows afterwards (`compact`, called by the attention), with a copy, so
the chunk's rows are freed.

Memory is in fixed-size buffers that grow in blocks (codes: 256 rows; window: 32 rows) so a
decode step does not copy the cache. Every buffer owns its rows: nothing it holds is a slice
of a prefill chunk's arrays (a slice keeps its parent's whole buffer alive), so `nbytes`, the
buffers' sizes, is what MLX's allocator holds for the cache (tested at real width).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..int2_format import LatentQuant

__all__ = ["LatentQuant", "RotatedLatentCache"]  # LatentQuant: the format, int2_format.py

CODE_STEP = 256  # code rows added per growth, as mlx-lm's KVCache grows
WINDOW_STEP = 32  # bf16 window rows of headroom for decode steps between compactions


class Rows:
    """A (B, 1, T, D) buffer of rows: bf16, or quantized (codes, scales, biases), with room
    to grow at the end and rows dropped from the front by copying (`keep_last`)."""

    def __init__(self, bits: int | None, group_size: int, step: int):
        self.bits, self.group_size, self.step = bits, group_size, step
        self.parts: tuple[mx.array, ...] | None = None
        self.length = 0

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
        return tuple(p[..., start:stop, :] for p in self.parts)

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

    def decode(self, parts: tuple[mx.array, ...], dims: int, dtype=mx.float32) -> mx.array:
        """Rows as dense values of `dtype`."""
        if self.bits is None:
            return parts[0].astype(dtype)
        w, scales, biases = parts
        return dequantize(
            w, scales.astype(dtype), biases.astype(dtype), self.group(dims), self.bits
        )

    def arrays(self) -> list[mx.array]:
        return list(self.parts or ())

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts or ())

    def clone(self) -> Rows:
        """Shares the buffers until either side writes (MLX copies a buffer on write when
        another array still holds it)."""
        new = Rows(self.bits, self.group_size, self.step)
        new.parts = None if self.parts is None else tuple(p[...] for p in self.parts)
        new.length = self.length
        return new


def _copy(x: mx.array) -> mx.array:
    """A copy of rows with a buffer of its own. A slice shares its parent's buffer, and so
    does anything one-input MLX makes of it (mx.contiguous, x + 0, mx.array(x)): MLX donates
    the input's whole allocation to the output when nothing else holds it, which would keep a
    whole prefill chunk's rows alive. A concatenation of two pieces always allocates anew."""
    h = x.shape[2] // 2
    return mx.concatenate([x[..., :h, :], x[..., h:, :]], axis=2)


def dequantize(
    w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """mx.dequantize, in the scales' dtype. On the CPU by unpacking with shifts and masks:
    MLX's CPU dequantize kernel is scalar (184 ms for 32K x 512 2-bit rows here, against 77 ms
    unpacked with vector ops)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    v = unpack(w, bits)
    dims = v.shape[-1]
    v = v.reshape(*w.shape[:-1], dims // group_size, group_size).astype(scales.dtype)
    return (v * scales[..., None] + biases[..., None]).reshape(*w.shape[:-1], dims)


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


class RotatedLatentCache(_BaseCache):
    """One MLA layer's cache. `rotation` (r x r) and `clip` (r,) come from calibration, in
    the model's dtype (a float32 rotation would turn a bf16 model's whole residual stream
    float32)."""

    def __init__(
        self, quant: LatentQuant, rotation: mx.array | None = None, clip: mx.array | None = None
    ):
        self.quant = quant
        self.rotation = rotation
        self.clip = clip
        self.offset = 0
        self._dims = (0, 0)
        q = quant
        bf = (None, q.group_size)
        self.sink_lat, self.sink_pe = Rows(*bf, q.sink or 1), Rows(*bf, q.sink or 1)
        self.codes_lat = Rows(q.bits, q.group_size, CODE_STEP)
        self.codes_pe = Rows(q.rope_bits if q.bits is not None else None, q.group_size, CODE_STEP)
        # The bf16 baseline keeps every token in its "window": grow it like the codes.
        step = WINDOW_STEP if q.bits is not None else CODE_STEP
        self.win_lat, self.win_pe = Rows(*bf, step), Rows(*bf, step)
        self.win_start = 0  # token position of the window's first row
        self._dep = mx.array(0)

    @property
    def keys(self) -> mx.array:
        """mlx-lm's pipeline ties each step's send to the last layer's cache
        (`cache[-1].keys = mx.depends(cache[-1].keys, h)`); this is what it holds on to.
        `append` lets go of it: the send is evaluated anyway through the all_gather after it,
        and a chain of unevaluated steps would keep every step's activations alive."""
        return self._dep

    @keys.setter
    def keys(self, v: mx.array) -> None:
        self._dep = v

    @property
    def latent_dims(self) -> int:
        return self.rotation.shape[0] if self.rotation is not None else self._dims[0]

    @property
    def rope_dims(self) -> int:
        return self._dims[1]

    @property
    def quantized(self) -> bool:
        return self.quant.bits is not None

    @property
    def codes_end(self) -> int:
        """Tokens [sink, codes_end) are held as codes."""
        return self.quant.sink + self.codes_lat.length

    def clone(self) -> RotatedLatentCache:
        """An independent cache holding the same tokens, sharing memory until written (the
        prompt cache keeps one and hands out clones)."""
        new = RotatedLatentCache(self.quant, self.rotation, self.clip)
        new.offset, new._dims, new.win_start = self.offset, self._dims, self.win_start
        for name in ("sink_lat", "sink_pe", "codes_lat", "codes_pe", "win_lat", "win_pe"):
            setattr(new, name, getattr(self, name).clone())
        return new

    def _stores(self):
        return (
            self.sink_lat,
            self.sink_pe,
            self.codes_lat,
            self.codes_pe,
            self.win_lat,
            self.win_pe,
        )

    def arrays(self) -> list[mx.array]:
        """Every buffer the cache holds (to evaluate, or to count)."""
        return [p for st in self._stores() for p in st.arrays()]

    # -- writing ------------------------------------------------------------------------------
    def rotate(self, latent: mx.array) -> mx.array:
        return latent if self.rotation is None else latent @ self.rotation

    def _clipped(self, u: mx.array) -> mx.array:
        if self.quant.row_quantile is not None:
            t = mx.sort(mx.abs(u), axis=-1)
            k = int(round(self.quant.row_quantile * (u.shape[-1] - 1)))
            lim = t[..., k : k + 1]
            return mx.clip(u, -lim, lim)
        if self.clip is not None:
            return mx.clip(u, -self.clip, self.clip)
        return u

    def append(self, latent: mx.array, k_pe: mx.array) -> None:
        """Store L new tokens: latent (B, 1, L, r) unrotated, k_pe (B, 1, L, d) after RoPE.
        Tokens that leave the window are quantized now."""
        q = self.quant
        self._dep = mx.array(0)
        self._dims = (latent.shape[-1], k_pe.shape[-1])
        u = self.rotate(latent)
        n = u.shape[2]
        exact = n > 1  # a prefill chunk: size the buffers to it; decode: grow by a step
        if not self.quantized:
            self.win_lat.append(u, exact), self.win_pe.append(k_pe, exact)
            self.offset += n
            return
        into_sink = max(0, min(n, q.sink - self.offset))
        if into_sink:
            self.sink_lat.append(u[..., :into_sink, :], True)
            self.sink_pe.append(k_pe[..., :into_sink, :], True)
            u, k_pe = u[..., into_sink:, :], k_pe[..., into_sink:, :]
        if self.win_lat.length == 0:
            self.win_start = max(q.sink, self.offset)
        if u.shape[2]:
            self.win_lat.append(u, exact)
            self.win_pe.append(k_pe, exact)
        self.offset += n
        # Quantize what has left the window: tokens [codes_end, offset - recent).
        leave = self.offset - q.recent - self.codes_end
        if leave > 0:
            a = self.codes_end - self.win_start
            lat, pe = self.win_lat.view(a, a + leave), self.win_pe.view(a, a + leave)
            self.codes_lat.append(self._clipped(lat[0]), exact)
            self.codes_pe.append(pe[0], exact)
        if not exact and self.win_lat.length > q.recent + q.slack + WINDOW_STEP:
            self.compact()

    def compact(self) -> None:
        """Cut the window back to recent + slack rows (with a copy, so a prefill chunk's rows
        are freed). The attention calls it once a chunk's graph is built."""
        if not self.quantized:
            return
        keep = min(self.win_lat.length, self.quant.recent + self.quant.slack)
        if keep < self.win_lat.length or self.win_lat.capacity > keep + WINDOW_STEP:
            self.win_start += self.win_lat.length - keep
            self.win_lat.keep_last(keep)
            self.win_pe.keep_last(keep)

    # -- reading ------------------------------------------------------------------------------
    def segments(self, new: int | None = None):
        """[(kind, first token, latent parts, rope parts)] held for attention: kind "sink" and
        "window" are bf16 rows, "codes" quantized ones. With `new`, only what the last `new`
        queries can see (the window from the first query's oldest bf16 token on: for one
        query, exactly its last `recent` tokens, so a decode step needs no mask); `visible`
        says which query sees which row."""
        out = []
        s = self.sink_lat.length
        if s:
            out.append(("sink", 0, self.sink_lat.view(0, s), self.sink_pe.view(0, s)))
        c = self.codes_lat.length
        if c:
            out.append(
                ("codes", self.quant.sink, self.codes_lat.view(0, c), self.codes_pe.view(0, c))
            )
        w = self.win_lat.length
        if w:
            first = self.win_start if self.quantized else 0
            skip = 0
            if new is not None and self.quantized:
                skip = max(0, self.offset - new + 1 - self.quant.recent - first)
            if skip < w:
                out.append(
                    ("window", first + skip, self.win_lat.view(skip, w), self.win_pe.view(skip, w))
                )
        return out

    def visible(self, kind: str, start: int, n: int, new: int):
        """Which of a segment's rows [start, start + n) the last `new` queries see: True (all
        see all), False (none sees any), or a (new, n) bool mask. Query p sees the sink up to
        p, codes older than p - recent, and bf16 window rows in [p + 1 - recent, p]."""
        p0 = self.offset - new
        p = mx.arange(p0, self.offset)[:, None]
        t = mx.arange(start, start + n)[None, :]
        recent = self.quant.recent if self.quantized else self.offset + 1
        if kind == "codes":
            lo, hi = start + recent, start + n - 1 + recent  # first / last query to see any
            if p0 >= hi:
                return True
            if self.offset - 1 < lo:
                return False
            return t <= p - recent
        if kind == "sink" or not self.quantized:
            if p0 >= start + n - 1:
                return True
            return t <= p
        # window: p + 1 - recent <= t <= p
        if p0 >= start + n - 1 and self.offset - 1 + 1 - recent <= start:
            return True
        m = (t <= p) & (t >= p + 1 - recent)
        return m

    # -- mlx-lm's protocol -----------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        """For attention code that is not ours: store, then hand back dequantized arrays."""
        self.append(keys, values)
        return self.dequantized()

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """(c, k_pe) for every cached token, c unrotated, in float32 (for tests and foreign
        callers; the attention never dequantizes it all)."""
        lats, pes = [], []
        for kind, start, lat, pe in self.segments():
            if kind == "window":
                skip = max(0, self.codes_end - start) if self.quantized else 0
                lat, pe = tuple(x[..., skip:, :] for x in lat), tuple(x[..., skip:, :] for x in pe)
            store_lat = self.codes_lat if kind == "codes" else self.sink_lat
            store_pe = self.codes_pe if kind == "codes" else self.sink_pe
            lats.append(store_lat.decode(lat, self.latent_dims))  # float32: for tests
            pes.append(store_pe.decode(pe, self.rope_dims))
        u = mx.concatenate(lats, axis=2)
        r = self.rotation
        c = u if r is None else u @ r.astype(mx.float32).T
        return c, mx.concatenate(pes, axis=2)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trimmable(self) -> int:
        """How many tokens `trim` can remove exactly: down to where the window's bf16 rows
        still cover the last `recent` tokens (every token, for the bf16 baseline)."""
        if not self.quantized or self.win_start <= self.quant.sink:
            return self.offset
        return max(0, self.offset - (self.win_start + self.quant.recent))

    def trim(self, n: int) -> int:
        """Remove the last n tokens exactly, or as many as can be removed exactly (see
        `trimmable`); returns how many were removed. Callers must honour a short count."""
        n = max(0, min(n, self.trimmable()))
        if n == 0:
            return 0
        new = self.offset - n
        if not self.quantized:
            self.win_lat.drop_last(n), self.win_pe.drop_last(n)
            self.offset = new
            return n
        q = self.quant
        codes_end = max(q.sink, new - q.recent)
        drop = self.codes_end - codes_end
        if drop > 0:
            self.codes_lat.drop_last(drop), self.codes_pe.drop_last(drop)
        in_window = self.offset - max(self.win_start, new)
        if in_window > 0:
            self.win_lat.drop_last(min(in_window, self.win_lat.length))
            self.win_pe.drop_last(min(in_window, self.win_pe.length))
        if new < self.sink_lat.length:
            cut = self.sink_lat.length - new
            self.sink_lat.drop_last(cut), self.sink_pe.drop_last(cut)
        self.offset = new
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self) -> int:
        """Every buffer as allocated (headroom included); not the rotation, which is the
        model's (one per layer, shared by every sequence)."""
        return sum(s.nbytes() for s in self._stores())

    @property
    def state(self):
        """The arrays mlx-lm's generate_step evaluates after each prefill chunk, so a long
        prompt is computed chunk by chunk (memory bounded per chunk, cancellable)."""
        return self.arrays()

    @state.setter
    def state(self, v):
        raise ValueError("RotatedLatentCache cannot be restored from a saved prompt cache")
