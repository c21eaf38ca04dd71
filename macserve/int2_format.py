"""The INT2 latent cache's layout: what is stored per token and per sequence, in bytes.

One definition, read by `sizing/` (what `inspect` counts for macserve/int2) and by `engine/`
(what `RotatedLatentCache` stores). No mlx here: `inspect` must stay fast to import.

Per MLA layer and token: the rotated latent as `bits`-bit affine codes in groups of
`group_size` with a bf16 scale and bias per group, and the rotary key at `rope_bits` (8) the
same way. Per sequence: the first `sink` and last `recent` tokens also kept in bf16. DSA
models add the indexer key at `index_bits` (8). `bits=None` is the bf16 baseline (the same
cache class with quantization off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BF16 = 2  # bytes


def quantized_row_bytes(dims: int, bits: int | None, group_size: int) -> int:
    """Bytes of one row of `dims` values: packed codes plus a bf16 scale and bias per group
    (a row narrower than a group is one group, as mx.quantize needs group <= dims)."""
    if dims == 0:
        return 0
    if bits is None:
        return BF16 * dims
    g = min(group_size, dims)
    return dims * bits // 8 + math.ceil(dims / g) * 2 * BF16


@dataclass(frozen=True)
class LatentQuant:
    """How one MLA layer's latent cache is stored. bits=None stores bf16 everywhere."""

    bits: int | None = 2
    group_size: int = 64
    rope_bits: int | None = 8
    sink: int = 64
    recent: int = 256
    slack: int = 16  # extra bf16 rows kept so `trim` (rejected drafts) restores exactly
    row_quantile: float | None = None  # clip each row at this quantile of |u| instead of `clip`
    index_bits: int | None = 8  # DSA models' indexer key; bf16 when bits is None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def row_bytes(self, latent_dims: int, rope_dims: int) -> int:
        """Bytes of one token's latent + rotary key in the quantized segment."""
        if self.bits is None:
            return BF16 * (latent_dims + rope_dims)
        return quantized_row_bytes(latent_dims, self.bits, self.group_size) + quantized_row_bytes(
            rope_dims, self.rope_bits, self.group_size
        )

    def bytes_per_token(self, latent_dims: int, rope_dims: int) -> float:
        """`row_bytes` as a float (the bench tables' column)."""
        return float(self.row_bytes(latent_dims, rope_dims))

    def window_tokens(self) -> int:
        """Tokens of a sequence also kept in bf16 (0 for the bf16 baseline)."""
        return self.sink + self.recent if self.bits is not None else 0

    def bf16_rows(self) -> int:
        """bf16 rows a sequence's cache holds after a prefill: the sink, the recent window and
        the `slack` rows kept for an exact `trim` (0 for the bf16 baseline)."""
        return self.window_tokens() + self.slack if self.bits is not None else 0

    def index_row_bytes(self, dims: int) -> int:
        bits = self.index_bits if self.bits is not None else None
        return quantized_row_bytes(dims, bits, self.group_size)


INT2 = LatentQuant()  # the shipped format: 2-bit latent, 8-bit rope, 64 sink + 256 recent
BF16_LATENT = LatentQuant(bits=None)  # the baseline it is measured against
