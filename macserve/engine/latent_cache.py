"""A quantized MLA latent cache on mlx-lm's cache protocol.

Per layer and token an MLA model caches one latent c (kv_lora_rank dims) and one rotary key
k_pe (qk_rope_head_dim dims). This cache stores u = c @ R (R orthogonal, fitted by
`calibrate.py`), clipped per rotated dimension, quantized with `mx.quantize`, and k_pe at
8 bits, in the layout `int2_format.LatentQuant` defines. Attention reads it without
dequantizing (see `mla_attention.py`).

Token layout, in token order, which is also the order of the score columns:

    sink    tokens [0, sink)                  bf16
    int     tokens [sink, offset - recent)    quantized
    recent  tokens [offset - recent, offset)  bf16

Every token past the sink is quantized when it arrives; the bf16 copy of the last
`recent + slack` tokens is kept as well. That costs `slack` bf16 rows but makes `trim` exact:
rolling back up to `slack` tokens (speculative decoding's rejected drafts) restores precisely
the state the cache had before them, bf16 window included.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..int2_format import LatentQuant

__all__ = ["LatentQuant", "RotatedLatentCache"]  # LatentQuant: the format, int2_format.py

STEP = 256  # buffer growth, as mlx-lm's own caches


class _Store:
    """A growable (B, 1, T, D) buffer, either bf16 or quantized (codes, scales, biases)."""

    def __init__(self, bits: int | None, group_size: int):
        self.bits, self.group_size = bits, group_size
        self.parts: tuple[mx.array, ...] | None = None
        self.length = 0

    def group(self, dims: int) -> int:
        """A rotary key of 32 dims is one group of 32: mx.quantize needs group <= dims."""
        return min(self.group_size, dims)

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        x = x.astype(mx.bfloat16)
        if self.bits is None:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.group(x.shape[-1]), bits=self.bits))

    def decode(self, parts: tuple[mx.array, ...], dims: int) -> mx.array:
        if self.bits is None:
            return parts[0]
        # In float32: a bf16 result would round the levels themselves.
        w, scales, biases = parts
        return mx.dequantize(
            w,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=self.group(dims),
            bits=self.bits,
        )

    def append(self, x: mx.array) -> None:
        new = self._encode(x)
        n = x.shape[2]
        if self.parts is None or self.length + n > self.parts[0].shape[2]:
            grow = ((n + STEP - 1) // STEP) * STEP
            extra = [mx.zeros((*p.shape[:2], grow, p.shape[3]), p.dtype) for p in new]
            if self.parts is None:
                self.parts = tuple(extra)
            else:
                self.parts = tuple(
                    mx.concatenate([p[..., : self.length, :], e], axis=2)
                    for p, e in zip(self.parts, extra)
                )
        for p, v in zip(self.parts, new):
            p[..., self.length : self.length + n, :] = v
        self.length += n

    def view(self, start: int, stop: int) -> tuple[mx.array, ...]:
        return tuple(p[..., start:stop, :] for p in self.parts)

    def drop_last(self, n: int) -> None:
        self.length -= n

    def drop_first(self, n: int) -> None:
        self.parts = tuple(p[..., n : self.length, :] for p in self.parts)
        self.length -= n

    def nbytes(self) -> int:
        if self.parts is None:
            return 0
        return sum(p[..., : self.length, :].nbytes for p in self.parts)


class RotatedLatentCache(_BaseCache):
    """One MLA layer's cache. `rotation` (r x r) and `clip` (r,) come from calibration."""

    def __init__(
        self, quant: LatentQuant, rotation: mx.array | None = None, clip: mx.array | None = None
    ):
        self.quant = quant
        self.rotation = rotation
        self.clip = clip
        self.offset = 0
        self._dims = (0, 0)
        q = quant
        self._sink_lat = _Store(None, q.group_size)
        self._sink_pe = _Store(None, q.group_size)
        self._int_lat = _Store(q.bits, q.group_size)
        self._int_pe = _Store(q.rope_bits if q.bits is not None else None, q.group_size)
        self._rec_lat = _Store(None, q.group_size)
        self._rec_pe = _Store(None, q.group_size)
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

    def arrays(self) -> list[mx.array]:
        """Every buffer the cache holds (to evaluate, or to count)."""
        stores = (
            self._sink_lat,
            self._sink_pe,
            self._int_lat,
            self._int_pe,
            self._rec_lat,
            self._rec_pe,
        )
        return [p for st in stores if st.parts for p in st.parts]

    def stores(self):
        """(latent store, rope store) of the quantized segment, for the attention kernel."""
        return self._int_lat, self._int_pe

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
        """Store L new tokens: latent (B, 1, L, r) unrotated, k_pe (B, 1, L, d) after RoPE."""
        q = self.quant
        self._dep = mx.array(0)
        self._dims = (latent.shape[-1], k_pe.shape[-1])
        u = self.rotate(latent)
        n = u.shape[2]
        if q.bits is None:
            self._int_lat.append(u)
            self._int_pe.append(k_pe)
            self.offset += n
            return
        into_sink = max(0, min(n, q.sink - self.offset))
        if into_sink:
            self._sink_lat.append(u[..., :into_sink, :])
            self._sink_pe.append(k_pe[..., :into_sink, :])
        if into_sink < n:
            u, k_pe = u[..., into_sink:, :], k_pe[..., into_sink:, :]
            self._int_lat.append(self._clipped(u))
            self._int_pe.append(k_pe)
            self._rec_lat.append(u)
            self._rec_pe.append(k_pe)
            keep = q.recent + q.slack
            if self._rec_lat.length > keep + STEP:
                # Drop in blocks so a decode step does not copy the window every time.
                cut = self._rec_lat.length - keep
                self._rec_lat.drop_first(cut)
                self._rec_pe.drop_first(cut)
        self.offset += n

    # -- reading ------------------------------------------------------------------------------
    def segments(self, new: int = 1):
        """[(kind, first token, latent parts, rope parts)] after `new` tokens were appended;
        kind is sink, int, recent (bf16) or all (the unquantized cache).

        The int segment runs to offset - recent; the bf16 window starts up to new - 1 tokens
        earlier, so each of the new queries can see its own last `recent` tokens in bf16
        (`mask` picks, per query, which copy of an overlapping token counts). A chunk of
        `new` tokens therefore scores exactly as `new` single decode steps would.
        """
        q = self.quant
        if q.bits is None:
            return [
                ("all", 0, self._int_lat.view(0, self.offset), self._int_pe.view(0, self.offset))
            ]
        out = []
        s = self._sink_lat.length
        if s:
            out.append(("sink", 0, self._sink_lat.view(0, s), self._sink_pe.view(0, s)))
        past = self.offset - s
        n_int = max(0, past - q.recent)
        if n_int:
            out.append(("int", s, self._int_lat.view(0, n_int), self._int_pe.view(0, n_int)))
        L = self._rec_lat.length
        n_rec = min(L, past, q.recent + new - 1) if n_int else past
        n_rec = max(n_rec, past - n_int)
        if n_rec:
            out.append(
                (
                    "recent",
                    self.offset - n_rec,
                    self._rec_lat.view(L - n_rec, L),
                    self._rec_pe.view(L - n_rec, L),
                )
            )
        return out

    def mask(self, segments, new: int) -> mx.array:
        """(new, columns) visibility: causal, and each token once per query (see segments)."""
        p = mx.arange(self.offset - new, self.offset)[:, None]
        rec_start = next((s for kind, s, _, _ in segments if kind == "recent"), self.offset)
        split = mx.maximum(p + 1 - self.quant.recent, rec_start)
        cols = []
        for kind, start, lat, _ in segments:
            t = mx.arange(start, start + lat[0].shape[2])[None, :]
            if kind == "int":
                cols.append((t < split) & (t <= p))
            elif kind == "recent":
                cols.append((t <= p) & (t >= split))
            else:
                cols.append(t <= p)
        return mx.concatenate(cols, axis=1)

    # -- mlx-lm's protocol -----------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        """For attention code that is not ours: store, then hand back dequantized arrays."""
        self.append(keys, values)
        return self.dequantized()

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """(c, k_pe) for every cached token, c unrotated; for tests and foreign callers."""
        lats, pes = [], []
        for kind, _, lat, pe in self.segments():
            if kind != "int":
                lats.append(lat[0]), pes.append(pe[0])
            else:
                lats.append(self._int_lat.decode(lat, self.latent_dims))
                pes.append(self._int_pe.decode(pe, self.rope_dims))
        u = mx.concatenate(lats, axis=2).astype(mx.float32)
        c = u if self.rotation is None else u @ self.rotation.T
        return c, mx.concatenate(pes, axis=2).astype(mx.float32)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        """Remove the last n tokens exactly: as far as the bf16 rows still held can rebuild the
        recent window (always at least `slack`); returns how many were removed."""
        q = self.quant
        n = min(n, self.offset)
        if q.bits is None:
            self._int_lat.drop_last(n), self._int_pe.drop_last(n)
            self.offset -= n
            return n
        past = self.offset - self._sink_lat.length
        from_past = min(n, past)
        if from_past and past > q.recent:
            # Tokens that must come back into the bf16 window have to still be there.
            need = min(past - from_past, q.recent)
            spare = self._rec_lat.length - from_past - need
            if spare < 0:
                from_past += spare
                n = from_past
        self._int_lat.drop_last(from_past), self._int_pe.drop_last(from_past)
        self._rec_lat.drop_last(from_past), self._rec_pe.drop_last(from_past)
        from_sink = n - from_past
        if from_sink:
            self._sink_lat.drop_last(from_sink), self._sink_pe.drop_last(from_sink)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self) -> int:
        stores = (
            self._sink_lat,
            self._sink_pe,
            self._int_lat,
            self._int_pe,
            self._rec_lat,
            self._rec_pe,
        )
        return sum(s.nbytes() for s in stores)

    @property
    def state(self):
        return []

    @state.setter
    def state(self, v):
        raise ValueError("RotatedLatentCache cannot be restored from a saved prompt cache")
