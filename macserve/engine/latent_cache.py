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

import functools
import json
from dataclasses import asdict

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..cache_kinds import LONG_WINDOW, LONG_WINDOW_STEP, WINDOW_STEP
from ..int2_format import LatentQuant, format_name
from .rows import CODE_STEP, Rows, TokenRows

# WINDOW_STEP: bf16 window rows of headroom for decode steps between compactions. A window
# of LONG_WINDOW rows or more (KV=auto's, sized to a memory share: thousands of rows) grows and
# is cut back in LONG_WINDOW_STEP blocks: in 32-row ones each growth or compaction would copy
# the whole window every 32 steps.
# Decode steps quantize this many rows ahead in one go (rows still in the recent window, whose
# codes do not depend on when they are made), so most steps only move the codes' length.
STAGE = 32


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
        long = q.bits is None or q.recent >= LONG_WINDOW
        step = LONG_WINDOW_STEP if long else WINDOW_STEP
        self.win_lat, self.win_pe = Rows(*bf, step), Rows(*bf, step)
        self.win_start = 0  # token position of the window's first row
        # Code rows quantized ahead, past codes_lat.length (not shown, not stored): the next
        # rows to leave the window (`append`); any trim lets them go.
        self.staged = 0
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
        new.staged = self.staged
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
        if 0 < leave <= self.staged:  # a decode step: its rows' codes were made ahead
            self.codes_lat.length += leave
            self.codes_pe.length += leave
            self.staged -= leave
        elif leave > 0:
            # A decode step quantizes the next STAGE rows too (they are in the window, the
            # oldest of its recent rows): one quantization per STAGE steps instead of one each.
            ahead = 0 if exact else min(STAGE, q.recent)
            a = self.codes_end - self.win_start + self.staged
            n = leave - self.staged + ahead
            lat, pe = self.win_lat.view(a, a + n), self.win_pe.view(a, a + n)
            self.codes_lat.length += self.staged
            self.codes_pe.length += self.staged
            self.codes_lat.append(self._clipped(lat[0]), exact)
            self.codes_pe.append(pe[0], exact)
            self.codes_lat.length -= ahead
            self.codes_pe.length -= ahead
            self.staged = ahead
        if not exact and self.win_lat.length > q.recent + q.slack + self.win_lat.step:
            self.compact()

    def compact(self) -> None:
        """Cut the window back to recent + slack rows (with a copy, so a prefill chunk's rows
        are freed). The attention calls it once a chunk's graph is built."""
        if not self.quantized:
            return
        keep = min(self.win_lat.length, self.quant.recent + self.quant.slack)
        if keep < self.win_lat.length or self.win_lat.capacity > keep + self.win_lat.step:
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
        staged_end = self.codes_end + self.staged  # token after the last row quantized
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
        # Code rows past the length stay quantized ahead while their tokens stay: the rows
        # dropped and the staged ones, up to the new end.
        self.staged = max(0, min(staged_end, new) - self.codes_end)
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

    # -- its stored form, on mlx-lm's protocol ----------------------------------------------------
    @property
    def state(self):
        """What the cache holds: its format (JSON), whether it is rotated, its positions
        (offset, window start, latent and rope dims), then each buffer's rows in use (sink,
        codes, window; latent and rope). The rotation and clip are the calibration's, not
        the cache's: a rotated cache is restored by setting `state` on a fresh cache of its
        layer. mlx-lm's generate_step evaluates this after each prefill chunk, so a long
        prompt is computed chunk by chunk (memory bounded per chunk, cancellable)."""
        return (
            _format_json(self.quant),
            self.rotation is not None,
            self.offset,
            self.win_start,
            *self._dims,
            *(st.stored() for st in self._stores()),
        )

    @state.setter
    def state(self, v):
        fmt, rotated, offset, win_start, d0, d1, *stores = v
        quant = LatentQuant(**json.loads(fmt))
        if quant != self.quant or rotated != (self.rotation is not None) or len(stores) != 6:
            raise ValueError(
                f"stored: {_label(quant, rotated)}; this cache: "
                f"{_label(self.quant, self.rotation is not None)}"
            )
        for st, parts in zip(self._stores(), stores):
            st.restore(parts)
        self.offset, self.win_start, self._dims = offset, win_start, (d0, d1)
        self.staged = 0

    @classmethod
    def from_state(cls, state, rotation: mx.array | None = None, clip: mx.array | None = None):
        """A cache holding `state`, with the calibration's `rotation` and `clip` if it was
        rotated (mlx-lm's `from_state` takes the state alone: enough for an unrotated one)."""
        if state[1] and rotation is None:
            raise ValueError("a rotated latent cache's state needs its rotation back")
        obj = cls(LatentQuant(**json.loads(state[0])), rotation, clip)
        obj.state = state
        return obj

    def stored_rows(self) -> TokenRows:
        """The sink and code rows in `state` (items 6-9): no later token changes them. The
        window's rows turn into codes later, so only this state has them."""
        n_sink, n_codes = self.sink_lat.length, self.codes_lat.length
        rows = {}
        for i, st in enumerate(self._stores()[:4]):
            first, n = (0, n_sink) if i < 2 else (n_sink, n_codes)
            for j in range(len(st.parts or ())):
                rows[f"{6 + i}.{j}"] = (first, first + n)
        return TokenRows(rows, n_sink + n_codes)


@functools.cache
def _format_json(q: LatentQuant) -> str:
    return json.dumps(asdict(q))  # once per format: `state` is read after every prefill chunk


def _label(q: LatentQuant, rotated: bool) -> str:
    return f"{format_name(q)} sink {q.sink} recent {q.recent}{' rotated' if rotated else ''}"
