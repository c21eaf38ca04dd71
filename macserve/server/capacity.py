"""How many sequences the server decodes together when `--max-batch` is not given: as many
whole-context KV caches as fit in the memory budget beside the weights and the prompt cache.

A fixed 8 left the server idle under load (32 clients: 330-554 tok/s at 8 against 831 at 32,
measured with `bench serve`'s capacity scenario on the 4-layer demo model on a 2-core Linux
CPU: docs/server.md) and, on a small Mac, could promise caches it cannot hold.
So the footprint is measured on the loaded model, with the cache kind the server runs: one
sequence's caches after a prefill, then after PROBE_TOKENS more; the growth between the two is
the steady bytes per token, and a whole-context sequence is the first measurement plus that
growth to the context. Two points, not one, because the INT2 latent cache is not proportional:
its first sink + recent (+ slack) rows are bf16 and only the tokens after them are 2-bit codes,
so a short prefill (all bf16) would count INT2 at the bf16 latent's bytes and give it a fifth
of the sequences it holds at long contexts. The first probe therefore goes past those rows.

With `serve --memory S` (plan_share / fit_share / hold_to) the same measurement sizes the batch
inside S instead of the machine: the process's baseline (measured before the weights), the
weights, the sequences, the prompt cache (its bound shrunk to what is left) and a RESERVE of S
(half a prefill chunk's scratch, engine/scratch.py; half MLX's buffer cache); MLX's own
limits are set from it, and a --max-batch that does not fit is refused with the figures.

`--kv auto` (cache_kinds.auto_window) is sized on three measured figures instead of one: a
sequence at CTX with the int2 cache's own window (its least), one more bf16 window row's
bytes, and a sequence at CTX with every row bf16 (window_figures). Given a batch (`--max-batch`, a profile's PARALLEL), the window
is the longest at which the batch and the prompt cache's sequence fit; with none, the batch
is as many all-bf16 sequences as fit (at least one, then at the longest window that fits).
Without --memory the machine's budget stands in for the share the same way; with neither (a
--max-batch and no budget) nothing is sized and every row stays bf16.

`--kv-window N` (what a profile's share fitted: services/share.py, passed by `macserve run`)
gives the window instead: the server runs N and sizes (or refuses) the rest around it, so the
window `inspect`, `ls` and the page say is the one served. The share's count decides: it is
the process tree once serving, what the memory probe (services/worst_case.py) samples; the
process as loaded (loaded_baseline) is less (on the demo model 93 MB against 162-203 MiB).
A window that covers CTX is auto's unbounded one (`fitted`): no code is ever written, and
its prompt caches are kept as bf16 rows (engine/stored_codes.py).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, replace

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

from ..cache_kinds import ALL_ROWS, CacheKind, auto_window, describe_window, window_bytes
from ..engine import scratch
from ..engine.caches import CacheSpec, cache_bytes, latent_caches
from ..engine.latent_cache import RotatedLatentCache
from ..errors import MacserveError
from ..int2_format import INT2

PROBE_TOKENS = 256  # tokens between the two measurements of a sequence's caches
# Past this many rows a decode step's B per-sequence attention calls (engine.batch) cost more
# than the extra rows bring; requests beyond it wait in the queue.
MAX_AUTO_BATCH = 64
RESERVE = 0.10  # of the budget (or share), kept for a prefill chunk's scratch and MLX's cache


@dataclass(frozen=True)
class Capacity:
    max_batch: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: int  # at the whole context
    weights_bytes: int
    budget_bytes: int
    room_bytes: int  # what the budget leaves for running sequences' caches
    window: int | None = None  # --kv auto: the bf16 recent window fitted (tokens)
    ctx: int | None = None

    def describe(self) -> str:
        gb = 2**30
        return (
            f"--max-batch {self.max_batch}: {self.room_bytes / gb:.1f} GB for caches "
            f"(budget {self.budget_bytes / gb:.1f} GB - weights {self.weights_bytes / gb:.1f} GB "
            f"- prompt cache - {RESERVE:.0%} reserve) / {self.kv_bytes_per_sequence / gb:.3f} GB "
            f"per whole-context sequence ({self.kv_bytes_per_token:.0f} B per token)"
            + _auto_line(self.window, self.ctx)
        )


def _auto_line(window: int | None, ctx: int | None) -> str:
    if window is None or ctx is None:
        return ""
    return f"; --kv auto at CTX {ctx:,}: {describe_window(ctx, window)}"


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _probe_tokens(spec: CacheSpec) -> int:
    """The first probe's length: past the bf16 rows of a quantized latent cache."""
    return PROBE_TOKENS + spec.kind.bf16_rows(spec.quant)


def _fill(bundle, caches, n: int) -> int:
    """n more tokens through the model into `caches`; the bytes they then hold."""
    bundle.model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
    mx.eval([c.state for c in caches])
    return sum(cache_bytes(c) for c in caches)


def sequence_bytes(bundle, spec: CacheSpec, ctx: int) -> tuple[int, float]:
    """One sequence's cache bytes at `ctx` tokens, as allocated, and the steady bytes per
    token. Measured on fresh caches: after n1 tokens and after n1 + PROBE_TOKENS; the growth
    is rounded up to whole PROBE_TOKENS steps (mlx-lm's caches grow by 256 rows, the INT2
    codes by their block), so the figure is what the allocator holds, not less. A context
    too short for the two probes is filled whole and measured as it is."""
    n1 = _probe_tokens(spec)
    caches = bundle.caches(spec)
    fill = lambda n: _fill(bundle, caches, n)  # noqa: E731

    if ctx <= n1 + PROBE_TOKENS:  # all but one token prefilled, the last one decoded: the
        fill(ctx - 1)  # decode step's growth headroom is held too
        held = fill(1)
        return held, held / ctx
    b1 = fill(n1)
    per_token = (fill(PROBE_TOKENS) - b1) / PROBE_TOKENS
    steps = -(-(ctx - n1) // PROBE_TOKENS)
    return int(b1 + per_token * steps * PROBE_TOKENS), per_token


def window_figures(bundle, spec: CacheSpec, ctx: int) -> tuple[int, int, int]:
    """--kv auto's figures (cache_kinds.auto_window), measured on fresh caches: one sequence's
    bytes at `ctx` with the int2 cache's window (INT2.recent: the least auto keeps), the
    bytes of one more bf16 window row (over every layer), and one sequence's bytes at `ctx`
    with every row bf16. The last two from a window holding every row: PROBE_TOKENS rows,
    PROBE_TOKENS more, then one decode step (its growth headroom held, as at `ctx`): bf16
    rows grow exactly by their bytes, so the sequence at `ctx` is that plus the rows to it."""
    base, _ = sequence_bytes(bundle, spec.with_window(INT2.recent), ctx)
    if ctx <= 2 * PROBE_TOKENS + 1:  # short enough to hold whole (sequence_bytes fills it)
        full, per_token = sequence_bytes(bundle, spec.with_window(ALL_ROWS), ctx)
        return base, math.ceil(per_token), full
    caches = bundle.caches(spec.with_window(ALL_ROWS))
    first = _fill(bundle, caches, PROBE_TOKENS)
    row = math.ceil((_fill(bundle, caches, PROBE_TOKENS) - first) / PROBE_TOKENS)
    stepped = _fill(bundle, caches, 1)  # 2 x PROBE_TOKENS + 1 rows, with decode headroom
    full = stepped + row * max(0, ctx - 2 * PROBE_TOKENS - 1)
    return base, row, full


def auto_batch(
    room: int,
    figures: tuple[int, int, int],
    ctx: int,
    prompt_cache: int | None,
    max_batch: int | None,
) -> tuple[int, int]:
    """(sequences, window) --kv auto runs with in `room` bytes (what the share or budget
    leaves after the baseline, weights and reserve), on `window_figures`' (base, row, full).
    `prompt_cache`: its bytes, or None for its default bound, one more sequence at the same
    window.
    `max_batch` given: that many, at the longest window they fit; not given: as many
    all-bf16 sequences as fit (at most MAX_AUTO_BATCH), else one at the longest window. A
    room that holds not even the int2 cache gets its window (INT2.recent): the share's own
    check then refuses it with the figures, as for --kv int2."""
    extra = 1 if prompt_cache is None else 0
    left = room - (prompt_cache or 0)
    n = max_batch
    if n is None:
        fits = left // figures[2] - extra
        if fits >= 1:
            return min(MAX_AUTO_BATCH, fits), ctx
        n = 1
    return n, auto_window(ctx, n + extra, left, *figures) or INT2.recent


def size_batch(
    bundle,
    spec: CacheSpec,
    ctx: int,
    budget_bytes: int,
    prompt_cache_bytes: int,
    window: int | None = None,
) -> Capacity:
    """`window`: --kv auto's, given (--kv-window); None: fitted in the budget."""
    if spec.kind == CacheKind.AUTO:
        return _size_auto_batch(bundle, spec, ctx, budget_bytes, prompt_cache_bytes, window)
    per_seq, per_token = sequence_bytes(bundle, spec, ctx)
    per_seq = max(1, per_seq)
    w = weights_bytes(bundle.model)
    room = int(budget_bytes * (1 - RESERVE)) - w - prompt_cache_bytes
    n = max(1, min(MAX_AUTO_BATCH, room // per_seq))
    return Capacity(n, per_token, per_seq, w, budget_bytes, max(0, room))


def _size_auto_batch(bundle, spec, ctx, budget_bytes, prompt_cache_bytes, given) -> Capacity:
    figures = window_figures(bundle, spec, ctx)
    w = weights_bytes(bundle.model)
    room = int(budget_bytes * (1 - RESERVE)) - w
    n, window = auto_batch(room, figures, ctx, prompt_cache_bytes, None)
    window = given or window
    per_seq = window_bytes(ctx, window, *figures)
    room -= prompt_cache_bytes
    if given:
        n = max(1, min(MAX_AUTO_BATCH, room // per_seq))
    return Capacity(n, per_seq / ctx, per_seq, w, budget_bytes, max(0, room), window, ctx)


# -- `serve --memory S`: everything inside one share ------------------------------------------


class ShareTooSmall(MacserveError):
    """--memory cannot hold what was asked: the server refuses to start (one line, figures)."""


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MB"


@dataclass(frozen=True)
class SharePlan:
    """The share S cut into its parts: baseline (the process before the weights, measured),
    weights, max_batch whole-context caches, the prompt cache, and the reserve (RESERVE of
    S: a prefill chunk's scratch and MLX's buffer cache, half each)."""

    share_bytes: int
    baseline_bytes: int
    weights_bytes: int
    kv_bytes_per_sequence: int
    max_batch: int
    prompt_cache_bytes: int
    prompt_cache_asked: int
    window: int | None = None  # --kv auto: the bf16 recent window fitted (tokens)
    ctx: int | None = None

    @property
    def reserve_bytes(self) -> int:
        return int(self.share_bytes * RESERVE)

    @property
    def scratch_bytes(self) -> int:
        """What a prefill chunk's transient arrays may take (engine/scratch.py)."""
        return self.reserve_bytes // 2

    @property
    def buffer_cache_bytes(self) -> int:
        """MLX's buffer cache (freed buffers kept for reuse): the reserve's other half."""
        return self.reserve_bytes - self.scratch_bytes

    @property
    def mlx_limit_bytes(self) -> int:
        """What MLX may allocate: the share less the process's own baseline."""
        return self.share_bytes - self.baseline_bytes

    @property
    def kv_bytes(self) -> int:
        return self.max_batch * self.kv_bytes_per_sequence

    @property
    def free_bytes(self) -> int:
        """The share's bytes no part takes."""
        parts = self.baseline_bytes + self.weights_bytes + self.kv_bytes + self.prompt_cache_bytes
        return self.share_bytes - self.reserve_bytes - parts

    def as_dict(self) -> dict:
        return {
            "share_bytes": self.share_bytes,
            "baseline_bytes": self.baseline_bytes,
            "weights_bytes": self.weights_bytes,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "max_batch": self.max_batch,
            "kv_bytes": self.kv_bytes,
            "prompt_cache_bytes": self.prompt_cache_bytes,
            "reserve_bytes": self.reserve_bytes,
            "scratch_bytes": self.scratch_bytes,
            "buffer_cache_bytes": self.buffer_cache_bytes,
            "free_bytes": self.free_bytes,
            "window": self.window,
        }

    def describe(self) -> str:
        shrunk = ""
        if self.prompt_cache_bytes < self.prompt_cache_asked:
            shrunk = f" (shrunk from {_gb(self.prompt_cache_asked)} to what is left)"
        return (
            f"memory share {_gb(self.share_bytes)}: baseline {_gb(self.baseline_bytes)} "
            f"(measured) + weights {_gb(self.weights_bytes)} + --max-batch {self.max_batch} x "
            f"{_gb(self.kv_bytes_per_sequence)} whole-context KV + prompt cache "
            f"{_gb(self.prompt_cache_bytes)}{shrunk} + reserve {_gb(self.reserve_bytes)} "
            f"({RESERVE:.0%}: prefill scratch {_gb(self.scratch_bytes)}, MLX buffer cache "
            f"{_gb(self.buffer_cache_bytes)}); {_gb(self.free_bytes)} unused"
            + _auto_line(self.window, self.ctx)
        )


def plan_share(
    share: int,
    baseline: int,
    weights: int,
    per_seq: int,
    prompt_cache: int,
    max_batch: int | None = None,
) -> SharePlan:
    """Fit everything inside `share`: the baseline, the weights and the reserve first, then
    the sequences (`max_batch` given: that many, or refused; not given: one, then the prompt
    cache up to its bound `prompt_cache`, then as many more as fit, up to MAX_AUTO_BATCH).
    Raises ShareTooSmall with the figures when not even that fits."""
    per_seq = max(1, per_seq)
    reserve = int(share * RESERVE)
    room = share - reserve - baseline - weights
    want = max_batch or 1
    if room < want * per_seq:
        what = f"--max-batch {max_batch}" if max_batch else "one sequence"
        raise ShareTooSmall(
            f"--memory {_gb(share)} is too small for {what}: baseline {_gb(baseline)} + "
            f"weights {_gb(weights)} + {want} x {_gb(per_seq)} whole-context KV + reserve "
            f"{_gb(reserve)} ({RESERVE:.0%}) = {_gb(baseline + weights + want * per_seq + reserve)}"
            f"; give --memory at least {_gb((baseline + weights + want * per_seq) / (1 - RESERVE))}"
            + (" or a smaller --max-batch / --ctx" if max_batch else " or a smaller --ctx")
        )
    pc = max(0, min(prompt_cache, room - want * per_seq))
    n = max_batch or max(1, min(MAX_AUTO_BATCH, (room - pc) // per_seq))
    return SharePlan(share, baseline, weights, per_seq, n, pc, prompt_cache)


def fit_share(
    bundle,
    spec: CacheSpec,
    ctx: int,
    share: int,
    baseline: int,
    prompt_cache,
    max_batch,
    loaded: int | None = None,
    window: int | None = None,
) -> SharePlan:
    """`plan_share` on the loaded model: its weights and one whole-context sequence measured
    (sequence_bytes). `prompt_cache` None: the default bound, one whole-context sequence.
    --kv auto: the window too (auto_batch), in `window` ("the sequence" at that window),
    fitted beside `loaded` (loaded_baseline) where that is more than `baseline`: a window
    must not take the share's unused bytes that the process's own growth at load holds.
    `window` given (--kv-window, a profile's share's): that one, its sequences measured at
    it, and refused with the figures when they do not fit."""
    w = weights_bytes(bundle.model)
    if spec.kind == CacheKind.AUTO:
        figures = window_figures(bundle, spec, ctx)
        if window is None:
            room = share - int(share * RESERVE) - max(baseline, loaded or 0) - w
            _, window = auto_batch(room, figures, ctx, prompt_cache, max_batch)
        per_seq = window_bytes(ctx, window, *figures)
    else:
        window = None
        per_seq, _ = sequence_bytes(bundle, spec, ctx)
    pc = per_seq if prompt_cache is None else prompt_cache
    plan = plan_share(share, baseline, w, per_seq, pc, max_batch)
    return replace(plan, window=window, ctx=ctx)


def loaded_baseline(bundle) -> int:
    """The process now, less the weights: its baseline with what loading added (MLX's
    runtime, the grammar's tables of the tokenizer, the MTP layer), which the share's own
    baseline (services/baseline.py, the tree once ready, less the weights) counts too."""
    gc.collect()
    mx.clear_cache()
    return psutil.Process().memory_info().rss - weights_bytes(bundle.model)


def fitted(spec: CacheSpec, window: int | None, ctx: int | None = None) -> CacheSpec:
    """The spec a server runs once sized: --kv auto's with the window fitted (if any). A
    window that covers `ctx` (every row bf16) is auto's unbounded one, ALL_ROWS: a sequence
    never writes a code, whatever its length, and its prompt caches are stored as bf16 rows
    under one identity whatever the CTX (engine/stored_codes.py); it is what window_figures
    measures as "every row bf16"."""
    if window is None or spec.kind != CacheKind.AUTO:
        return spec
    if ctx is not None and window + spec.quant.sink >= ctx:
        window = ALL_ROWS
    elif window < INT2.recent:  # a window given by hand (--kv-window): auto is never under int2
        raise MacserveError(
            f"--kv-window {window}: under int2's own {INT2.recent} rows, a window must cover "
            f"the context ({ctx} tokens, the first {spec.quant.sink} kept bf16 apart)"
        )
    return spec.with_window(window)


def code_rows(caches) -> int:
    """Rows a sequence's latent caches hold as codes (0: every row bf16), over its layers."""
    return sum(
        c.codes_end - c.quant.sink
        for c in latent_caches(caches)
        if isinstance(c, RotatedLatentCache) and c.quantized
    )


def hold_to(plan: SharePlan) -> None:
    """MLX's own limits from the share: what it may allocate (the share less the baseline),
    its buffer cache (half the reserve), the wired limit on a Mac's GPU, and a prefill chunk's
    scratch (the reserve's other half: engine/scratch.py)."""
    scratch.set_budget(plan.scratch_bytes)
    mx.set_memory_limit(plan.mlx_limit_bytes)
    mx.set_cache_limit(plan.buffer_cache_bytes)
    if mx.metal.is_available():  # wired memory exists only on a Mac's GPU
        most = mx.device_info()["max_recommended_working_set_size"]
        mx.set_wired_limit(min(plan.mlx_limit_bytes, most))
    gc.collect()
    mx.clear_cache()  # the sizing probes' buffers
