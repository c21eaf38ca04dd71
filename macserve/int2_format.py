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

import json
import math
import struct
from dataclasses import dataclass, replace

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
    recent: int = 512  # chosen on generations: docs/int2-latent-cache.md, "Windows"
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


INT2 = LatentQuant()  # the shipped format: 2-bit latent, 8-bit rope, 64 sink + 512 recent
BF16_LATENT = LatentQuant(bits=None)  # the baseline it is measured against


# -- formats per layer, and the plan a calibration file holds -----------------------------------
#
# `macserve calibrate` measures each MLA layer in every format below and writes, per layer, the
# one its gate chose (engine/gate.py) into the calibration file's metadata. The engine builds
# each layer's cache in that format; `inspect` reads the same metadata (the safetensors header,
# JSON, without mlx) to count the same bytes.

SHIPPED_ROTATION = "latent-rotation.safetensors"  # the calibration a model folder ships
FORMATS = {  # name -> (bits, group size); bits None: bf16, stored as is
    "int2-g128": (2, 128),
    "int2-g64": (2, 64),
    "int3-g64": (3, 64),
    "int4-g64": (4, 64),
    "bf16": (None, 64),
}


def format_quant(name: str, base: LatentQuant = INT2) -> LatentQuant:
    """`base` (its windows, rotary-key bits) with the latent stored in format `name`."""
    if name not in FORMATS:
        raise ValueError(f"unknown latent format {name!r} (known: {', '.join(FORMATS)})")
    bits, group = FORMATS[name]
    return replace(base, bits=bits, group_size=group)


def format_name(q: LatentQuant) -> str:
    """The name of `q`'s latent format ("int2-g64", "bf16"); "int{b}-g{g}" if not listed."""
    return "bf16" if q.bits is None else f"int{q.bits}-g{q.group_size}"


def format_label(name: str) -> str:
    """How a plan names a format to a user: INT2 g64, INT4 g64, bf16."""
    return name if name == "bf16" else name.upper().replace("-G", " g")


@dataclass(frozen=True)
class LayerPlan:
    """What a calibration file says one MLA layer's cache stores."""

    format: str  # a FORMATS name
    rotation: str  # the calibration method whose rotation it uses ("plain": none)


@dataclass(frozen=True)
class CachePlan:
    """Per MLA layer (of the whole model), the format and rotation. `gated`: chosen per layer
    by calibrate's gate; else the file's one method with the format it was fitted for."""

    layers: tuple[LayerPlan, ...]
    gated: bool
    target: float | None = None

    def quants(self, base: LatentQuant = INT2) -> list[LatentQuant]:
        return [format_quant(lp.format, base) for lp in self.layers]

    def summary(self) -> str:
        """ "61 MLA layers: 52 INT2 g64, 9 INT4 g64" (formats in the order of FORMATS)."""
        counts = {f: 0 for f in FORMATS}
        for lp in self.layers:
            counts[lp.format] = counts.get(lp.format, 0) + 1
        parts = ", ".join(f"{n} {format_label(f)}" for f, n in counts.items() if n)
        how = f"gated at {self.target:g}" if self.gated else "no gate: one format throughout"
        return f"{len(self.layers)} MLA layers: {parts} ({how})"


def plan_from_meta(meta: dict) -> CachePlan:
    """The plan in a calibration file's metadata (its "macserve" JSON): the gate's choices
    when calibrate wrote them, else the file's default method in the format it was fitted
    for on every layer. ValueError if the metadata does not say."""
    try:
        gate = meta.get("gate")
        if gate:
            layers = tuple(LayerPlan(r["choice"], r["rotation"]) for r in gate["layers"])
            for lp in layers:
                format_quant(lp.format)  # an unknown name is refused here, not at serve time
            return CachePlan(layers, True, gate.get("target"))
        fmt = format_name(LatentQuant(meta.get("bits", 2), meta.get("group_size", 64)))
        method = meta.get("default", "upproj")
        return CachePlan(tuple(LayerPlan(fmt, method) for _ in range(meta["layers"])), False)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"calibration metadata without a plan ({e!r})") from None


def read_plan(path) -> CachePlan:
    """The plan of calibration file `path`, from its safetensors header alone (no mlx):
    8 bytes of header length, then the header's JSON, whose __metadata__ holds ours."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["macserve"])
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ValueError(f"{path}: not a macserve calibration file ({e})") from None
    try:
        return plan_from_meta(meta)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
