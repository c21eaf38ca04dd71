"""Several sequences decoded together, each with its own caches."""

from __future__ import annotations


class SequenceBatch:
    """One layer's caches for several sequences decoded together: the model runs its
    projections and MLPs once for all of them (B rows), and the MLA attention, patched by
    mla_attention.install, attends row b through cache b (each at its own offset)."""

    def __init__(self, caches: list):
        self.caches = list(caches)

    @property
    def offset(self) -> int:  # mlx-lm reads cache[0].offset for masks; rows are 1 token
        return self.caches[0].offset
