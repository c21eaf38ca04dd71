"""The measurement behind the disk tier's block size N (`macserve dev disk-blocks`).

For each N, on one model and cache kind, in one process: a long prompt's end-of-prompt
snapshot written to an empty disk tier (seconds, files, bytes), a follow-up turn's snapshot
(the same prompt and `turn` more tokens) written after it (seconds, bytes: only the blocks the
first had not, and a tail), and the follow-up read back by a new tier (a restart). Each time is
also given against storing whole prefixes (one file per entry, N past the prompt's length),
measured in the same run. Granularity: the tokens a bf16 chat that shares only a prefix with
a stored one prefills again, N - 1 at most (INT2: see disk_blocks.py).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..engine.caches import CacheSpec, clone
from .disk_cache import DiskTier
from .disk_identity import identity
from .prompt_cache import PromptCache


@dataclass
class Row:
    block: int  # N; 0: whole prefixes
    write_s: float
    files: int
    bytes: int
    followup_write_s: float
    followup_bytes: int  # bytes the follow-up turn added on disk
    load_s: float


def _write(pc: PromptCache, ids: list[int], caches: list) -> float:
    t = time.perf_counter()
    pc.insert(ids, [clone(c) for c in caches])
    pc.disk.flush(600)
    return time.perf_counter() - t


def measure(bundle, spec: CacheSpec, tokens: int, turn: int, sizes: list[int], repeat: int = 5):
    """[Row] for each N in `sizes` and whole prefixes (block 0), medians of `repeat` runs."""
    text = "To be, or not to be, that is the question. " * (tokens // 4 + turn)
    ids = bundle.tokenizer.encode(text, add_special_tokens=False)[: tokens + turn]
    if len(ids) < tokens + turn:
        raise ValueError(f"the prompt came to {len(ids)} tokens, not {tokens + turn}")
    first, follow = ids[:tokens], ids
    caches = bundle.caches(spec)
    bundle.model(mx.array([first]), cache=caches)
    mx.eval([c.state for c in caches])
    snap1 = [clone(c) for c in caches]
    bundle.model(mx.array([follow[tokens:]]), cache=caches)
    mx.eval([c.state for c in caches])
    snap2 = caches
    ident = identity(bundle, spec)
    rows = []
    for n in [sizes[0], 0, *sizes]:  # the first pass warms MLX's kernels up: dropped
        runs = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as d:

                def tier(n=n, d=d):
                    block = n or 10 * len(follow)  # past the prompt: one file per entry
                    fresh = lambda: bundle.caches(spec)  # noqa: E731
                    return DiskTier(Path(d), 2**40, ident, fresh, None, block_tokens=block)

                pc = PromptCache(2**40, tier())
                w1 = _write(pc, first, snap1)
                files, b1 = pc.disk.stats()["blocks"] + 1, pc.disk.stats()["bytes"]
                w2 = _write(pc, follow, snap2)
                b2 = pc.disk.stats()["bytes"] - b1
                again = PromptCache(2**40, tier())
                t = time.perf_counter()
                hit = again.fetch(follow + ids[:1])
                load = time.perf_counter() - t
                if hit is None or hit.cached != len(follow):
                    raise RuntimeError(f"N={n}: the follow-up was not read back whole")
                pc.disk.close(), again.disk.close()
                runs.append(Row(n, w1, files, b1, w2, b2, load))
        rows.append(_median(runs))
    return rows[1:]


def _median(runs: list[Row]) -> Row:
    def med(k):
        v = sorted(getattr(r, k) for r in runs)
        return v[len(v) // 2]

    return Row(
        runs[0].block,
        med("write_s"),
        runs[0].files,
        runs[0].bytes,
        med("followup_write_s"),
        runs[0].followup_bytes,
        med("load_s"),
    )
