"""Every KV cache kind the engine runs, and its facts, in one place.

A kind is what `--kv` names (`serve`, `generate`, a macserve profile's KV). Each one knows:
the row `inspect` counts it under (sizing/kv_layout.py), whether it needs a calibration
(`--rotation`) and the latent format it stores by default (int2_format.LatentQuant: bytes per
token, windows). What the prompt cache's disk tier can do with a cache is the cache class's
own (`stored_codes.py`, disk_blocks.py's `short`).

No mlx here: sizing/ and cli/ read it too. What each cache *class* stores (its arrays, its
rows of tokens) is the class's own: `state` / `from_state` on mlx-lm's cache protocol
(engine/latent_cache.py, engine/dsa_indexer.py; engine/stored_form.py saves any of them).

A string compares equal to its kind (`CacheKind.INT2 == "int2"`), so a kind parsed once can
travel where a name did.

`auto` is the INT2 cache (the calibration's per-layer formats) with a bf16 recent window as
long as the memory share allows: `auto_window` is that arithmetic, without mlx, for the
server (`serve --memory`, on the figures it measures: server/capacity.py) and for a
profile's share (on inspect's figures: services/share.py) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .int2_format import INT2, LatentQuant


@dataclass(frozen=True)
class KindFacts:
    inspect_key: str  # the cache row `inspect` counts it under
    calibrated: bool  # needs a calibration file (--rotation, or a model folder's own)
    quant: LatentQuant | None  # the latent format it stores by default; None: mlx-lm's caches
    summary: str  # one line for help and errors


class CacheKind(str, Enum):
    """`--kv`: bf16 is mlx-lm's own cache for the model; int2 the rotated INT2 latent cache;
    auto the same cache with its bf16 recent window as long as the memory share holds."""

    BF16 = "bf16"
    INT2 = "int2"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str | CacheKind) -> CacheKind:
        """The kind named `name`; ValueError naming the known ones."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"kv must be one of {known}, not {name!r}") from None

    @property
    def facts(self) -> KindFacts:
        return FACTS[self]

    @property
    def inspect_key(self) -> str:
        return self.facts.inspect_key

    @property
    def calibrated(self) -> bool:
        return self.facts.calibrated

    @property
    def latent(self) -> bool:
        """Our latent cache (engine/latent_cache.py), not mlx-lm's own caches."""
        return self.facts.quant is not None

    def bf16_rows(self, quant: LatentQuant | None = None) -> int:
        """bf16 rows one sequence holds past its quantized ones after a prefill (the sink,
        the recent window and the trim slack); 0 where every row is bf16."""
        return (quant or self.facts.quant).bf16_rows() if self.latent else 0

    def bytes_per_token(
        self, latent_dims: int, rope_dims: int, quant: LatentQuant | None = None
    ) -> int | None:
        """Bytes one MLA layer stores per token of the quantized segment; None for mlx-lm's
        caches, whose size depends on the architecture (sizing/kv_layout.py models it)."""
        q = quant or self.facts.quant
        return q.row_bytes(latent_dims, rope_dims) if q is not None else None


# auto's window before a share has sized it: every row bf16 (`generate`, `serve` with nothing to
# size against). The server replaces it with the window its share holds (server/capacity.py).
ALL_ROWS = 1 << 30
AUTO_QUANT = replace(INT2, recent=ALL_ROWS)
# a fitted window is rounded down to whole blocks of this many rows, so a few bytes more or
# less in a share do not change it (and its prompt caches' identity: disk_identity.py)
WINDOW_ALIGN = 64
# A latent cache window this long (auto's, thousands of rows) grows in LONG_WINDOW_STEP-row
# blocks, a shorter one (int2's 512) in WINDOW_STEP-row ones (engine/latent_cache.py): a decode
# step's headroom, held past CTX (sizing/kv_layout.py counts it)
WINDOW_STEP, LONG_WINDOW, LONG_WINDOW_STEP = 32, 2048, 256

FACTS = {
    CacheKind.BF16: KindFacts(
        inspect_key="mlx/bf16",
        calibrated=False,
        quant=None,
        summary="mlx-lm's own caches, bf16",
    ),
    CacheKind.INT2: KindFacts(
        inspect_key="macserve/int2",
        calibrated=True,
        quant=INT2,
        summary="the rotated INT2 latent cache (a calibration's rotations)",
    ),
    CacheKind.AUTO: KindFacts(
        inspect_key="macserve/int2",  # its smallest form; services/share.py adds the window
        calibrated=True,
        quant=AUTO_QUANT,
        summary="the rotated latent cache, bf16 as far as the memory share holds, then the "
        "calibration's formats (INT2)",
    ),
}

KIND_NAMES = tuple(k.value for k in CacheKind)


def auto_window(
    ctx: int,
    sequences: int,
    room: int,
    base: int,
    row: int,
    full: int,
    quant: LatentQuant = INT2,
) -> int | None:
    """auto's bf16 recent window (LatentQuant.recent, in tokens) for `sequences` sequences of
    `ctx` tokens in `room` bytes: `ctx` when every row fits in bf16 (one sequence all bf16:
    `full` bytes; the sink and the window then cover the context, no code is written), else
    the longest window from `quant.recent` (the int2 cache's own, the least auto keeps) up
    at which every sequence fits, in whole WINDOW_ALIGN blocks; None: not even the int2
    cache fits. A sequence at window R counts `base` (its bytes at R = quant.recent) plus
    `row` per further window row: a row's bf16 bytes, without the code it replaces (codes
    are held in blocks: fewer codes may free nothing), so the count is never under."""
    if sequences < 1:
        raise ValueError("auto_window needs at least one sequence")
    per_seq = room // sequences
    if per_seq >= full:
        return ctx
    if per_seq < base:
        return None
    widest = ctx - quant.sink - 1  # one row short of holding every row
    extra = (per_seq - base) // row if row > 0 else widest
    r = min(widest, quant.recent + extra)
    return max(quant.recent, r - r % WINDOW_ALIGN)


def window_bytes(
    ctx: int, recent: int, base: int, row: int, full: int, quant: LatentQuant = INT2
) -> int:
    """One sequence's bytes at window `recent`, on `auto_window`'s count."""
    if recent + quant.sink >= ctx:
        return full
    return base + row * max(0, recent - quant.recent)


def describe_window(ctx: int, recent: int, formats: str = "INT2", sink: int = INT2.sink) -> str:
    """What auto does with a sequence of `ctx` tokens at window `recent`, one line."""
    if recent + sink >= ctx:
        return "every row bf16 (no code written)"
    return (
        f"bf16 up to {recent + sink:,} tokens, then older rows {formats}, the first {sink} "
        "kept bf16"
    )
