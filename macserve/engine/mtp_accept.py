"""What an MTP draft round keeps, and the record of it: the exact acceptance rules (greedy: the
longest prefix equal to the trunk's argmax; sampled: lossless rejection sampling,
`verify_sampled`), a token picked from logits, the per-position draft statistics
(`DraftStats`), and the exact rollback of rejected rows (`trim_all`: a cache that cannot roll
back exactly is an error, never a silent drift).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


def trim_all(caches, n: int) -> None:
    """Roll every cache back n tokens, exactly, or fail loudly."""
    for c in caches:
        got = c.trim(n)
        if got != n:
            raise RuntimeError(
                f"a cache could roll back {got} of {n} tokens; generation "
                "state would be inconsistent"
            )


@dataclass
class DraftStats:
    k: int
    proposed: list[int] = field(default_factory=list)  # per draft position: times it was checked
    accepted: list[int] = field(default_factory=list)  # per draft position: times it was accepted
    rounds: int = 0
    disabled_after: int | None = None

    def __post_init__(self):
        self.proposed = [0] * self.k
        self.accepted = [0] * self.k

    @property
    def draft_tokens(self) -> int:
        return sum(self.proposed)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    def per_position(self) -> list[float | None]:
        return [a / p if p else None for a, p in zip(self.accepted, self.proposed)]


def probs(logits: mx.array, temperature: float) -> np.ndarray:
    """Softmax of `logits / temperature` in float64 (rows on the last axis)."""
    x = np.array(logits.astype(mx.float32), dtype=np.float64) / temperature
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return x / x.sum(axis=-1, keepdims=True)


def pick(logits_row: mx.array, temperature: float, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax at temperature 0, else a draw."""
    if temperature <= 0:
        return int(mx.argmax(logits_row).item())
    p = probs(logits_row, temperature)
    return int(rng.choice(len(p), p=p))


def verify_sampled(
    p_rows: list[np.ndarray],
    q_rows: list[np.ndarray],
    drafts: list[int],
    p_next: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al., Chen et al.): returns (accepted, token).

    Draft j, drawn from q_j, is kept with probability min(1, p_j/q_j); the first refusal is
    replaced by a draw from (p_j - q_j)+ renormalized; if all are kept, the extra token comes
    from p_next. The emitted tokens are then distributed exactly as sampling from p.
    """
    for j, d in enumerate(drafts):
        p, q = p_rows[j], q_rows[j]
        if rng.random() < min(1.0, p[d] / max(q[d], 1e-300)):
            continue
        resid = np.maximum(p - q, 0.0)
        total = resid.sum()
        resid = resid / total if total > 0 else p
        return j, int(rng.choice(len(resid), p=resid))
    return len(drafts), int(rng.choice(len(p_next), p=p_next))
