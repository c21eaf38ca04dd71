"""Every KV cache kind the engine runs, and its facts, in one place.

A kind is what `--kv` names (`serve`, `generate`, a macserve profile's KV). Each one knows:
the row `inspect` counts it under (sizing/kv_layout.py), whether it needs a calibration
(`--rotation`), the latent format it stores by default (int2_format.LatentQuant: bytes per
token, windows), and what the prompt cache's disk tier can do with it (whether a prefix of
whole blocks is a cache state on its own: disk_blocks.py).

No mlx here: sizing/ and cli/ read it too. What each cache *class* stores (its arrays, its
rows of tokens) is the class's own: `state` / `from_state` on mlx-lm's cache protocol
(engine/latent_cache.py, engine/dsa_indexer.py; engine/stored_form.py saves any of them).

A string compares equal to its kind (`CacheKind.INT2 == "int2"`), so a kind parsed once can
travel where a name did.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .int2_format import INT2, LatentQuant


@dataclass(frozen=True)
class KindFacts:
    inspect_key: str  # the cache row `inspect` counts it under
    calibrated: bool  # needs a calibration file (--rotation, or a model folder's own)
    quant: LatentQuant | None  # the latent format it stores by default; None: mlx-lm's caches
    disk_cuttable: bool  # the disk tier may end a chain at a block boundary (rows alone)
    summary: str  # one line for help and errors


class CacheKind(str, Enum):
    """`--kv`: bf16 is mlx-lm's own cache for the model; int2 the rotated INT2 latent cache."""

    BF16 = "bf16"
    INT2 = "int2"

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


FACTS = {
    CacheKind.BF16: KindFacts(
        inspect_key="mlx/bf16",
        calibrated=False,
        quant=None,
        disk_cuttable=True,
        summary="mlx-lm's own caches, bf16",
    ),
    CacheKind.INT2: KindFacts(
        inspect_key="macserve/int2",
        calibrated=True,
        quant=INT2,
        # Its state after P tokens holds tokens [P - recent, P) in bf16, which a longer
        # snapshot holds as codes: a chain is entered through a tail only.
        disk_cuttable=False,
        summary="the rotated INT2 latent cache (a calibration's rotations)",
    ),
}

KIND_NAMES = tuple(k.value for k in CacheKind)
