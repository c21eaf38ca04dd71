"""The buffers an engine keeps, and their sum at a context: `Buffer` (one cache tensor of one
layer) and `Layout` (all of them, with the engine's padding). kv_layout.py builds Layouts per
engine (kv_llama.py for llama.cpp); report.py and hosts.py sum them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

CELL_PAD = 256  # llama.cpp: GGML_PAD(n_ctx, 256); mlx-lm: KVCache.step = 256


def _pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Buffer:
    """One cache tensor of one layer: `row` bytes per row, rows depending on `grow`:
    "token": one row per `every` tokens of context; "window": min(ctx, rows);
    "fixed": `rows` rows whatever the context. `model_dtype`: held in the model's compute
    dtype, counted at bf16's 2 B a value (a Mac's, a checkpoint's); the engine on a CPU host
    computes in float32 and holds it at twice that (host.py)."""

    layer: int
    what: str
    row: int
    grow: str
    every: int = 1
    rows: int = 0
    model_dtype: bool = False


@dataclass
class Layout:
    key: str
    buffers: list = field(default_factory=list)
    supported: bool = True
    reason: str = ""
    pad: int = CELL_PAD
    pad_compressed: bool = False  # llama.cpp pads every compressed cache to 256 cells too
    pad_window: bool = False  # llama.cpp pads its SWA cache; mlx-lm's ring is exactly `window`
    # "modelled": inspect's reading of the engine's code (this module); "measured": read
    # from the caches the engine itself allocates (`engine` names it; mlx_measure.py).
    origin: str = "modelled"
    engine: str = ""
    # bytes a value of the `model_dtype` buffers are counted at: bf16's 2 (a Mac's figure, a
    # bf16 checkpoint's); 4 where the engine computes in float32 (host.py `widen`)
    model_bytes: int = 2

    @property
    def per_token(self) -> Fraction:
        return sum(
            (Fraction(b.row, b.every) for b in self.buffers if b.grow == "token"), Fraction(0)
        )

    @property
    def state(self) -> int:
        return sum(
            b.row * (_pad(b.rows, self.pad) if b.grow == "window" and self.pad_window else b.rows)
            for b in self.buffers
            if b.grow != "token"
        )

    def bytes_at(self, ctx: int) -> int:
        cells = _pad(ctx, self.pad) if ctx > 0 else 0
        total = 0
        for b in self.buffers:
            if b.grow == "token":
                rows = cells if b.every == 1 else -(-cells // b.every)
                if b.every > 1 and self.pad_compressed:
                    rows = _pad(max(1, rows), self.pad)
            elif b.grow == "window":
                rows = min(cells, b.rows)
                if self.pad_window:
                    rows = _pad(rows, self.pad)
            else:
                rows = b.rows
            total += rows * b.row
        return total


class Unsupported(Exception):
    """Raised while building a Layout the engine cannot make; becomes `unsupported(...)`."""


def unsupported(key: str, reason: str) -> Layout:
    return Layout(key, supported=False, reason=reason)
