"""A profile's memory share: the most its server's process tree may hold, and what it is made of.

It replaces the old footprint (weights + ONE sequence's cache at CTX), which counted neither
the sequences a server batches, nor its in-memory prompt cache, nor the process itself, nor
prefill scratch. A share counts all five:

    weights + kv_bytes x PARALLEL + prompt cache + baseline, plus RESERVE of the share
    (at least MIN_RESERVE)

- kv_bytes: one whole-context sequence's cache at CTX (inspect's figure for the cache kind);
- PARALLEL: sequences served at once (the profile's key, default 1; with MEMORY and no
  PARALLEL, as many whole-context sequences as fit);
- the prompt cache: every provider's in-memory prompt cache is bounded to one whole-context
  sequence's cache (rounded up to a whole MiB, llama-server's unit);
- baseline: the server process itself (runtime, buffers), measured once per provider and model
  on this machine after a start (baseline.py), assumed until then;
- RESERVE: prefill scratch and the allocator's slack, a fixed fraction of the share, but
  never less than MIN_RESERVE: a server under load grows by a fixed amount above the idle
  figure its baseline is measured at (request threads, tokenizer and HTTP buffers, MLX's
  buffer cache), which 10 % of a small model's share does not cover.

KV=auto (the engine's rotated latent cache, bf16 as far as the share holds: cache_kinds.py)
counts, without MEMORY, every row bf16 (the share is what CTX x PARALLEL needs in bf16, and
the server then writes no code) unless that is over the machine's budget, which is then its
share as a MEMORY would be; with MEMORY, its window is fitted in the share on inspect's
figures (sizing/kv_layout.auto_figures): PARALLEL sequences plus the prompt cache's one at
the longest window that fits (PARALLEL not set: as many all-bf16 sequences as fit, else one).
`window` and `kv_note` say what it will do; the server fits its own window on measured
figures (server/capacity.py), which `/health` reports.

With MEMORY= the share IS that figure, and the parts must fit in it. Each provider turns the
share into its server's own limits (`Share.limits()` -> providers' `Limits`, which
`Provider.argv` renders): the engine `--memory`, llama-server `-c -np --cache-ram`,
mlx_lm.server its concurrency and prompt-cache flags and MLX's own limits. The router admits
the sum of shares; doctor and the web page show them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..cache_kinds import CacheKind, auto_window, describe_window, window_bytes
from ..errors import MacserveError
from ..hf_config import text_config
from ..int2_format import INT2
from ..sizing import host
from ..sizing.budget import machine_budget
from ..sizing.kv_layout import auto_figures
from ..sizing.report import inspect_source
from . import baseline, providers
from .profiles import Profile, ProfileStore
from .providers.base import Limits

RESERVE = 0.10  # of the share: prefill scratch + the allocator's cache (the engine's contract)
MIB = 2**20
# mlx_lm.server on the demo model grew 24.5 MB above its idle figure under load (8 clients at
# CTX 512, PARALLEL 2: tests/test_memory_real.py) against a 15 MB 10 % reserve: 1.04-1.08x its
# share. A floor of 32 MiB covers it; on a model of GBs the 10 % is the larger term.
MIN_RESERVE = 32 * MIB
# the most derived from MEMORY: the engine's own cap on a batch (server/capacity.py), past which
# a decode step's per-sequence attention calls cost more than the extra rows bring
MAX_PARALLEL = 64
PREFILL_STEP = 2048  # mlx-lm's default chunk: the most a share ever asks for


@dataclass(frozen=True)
class Share:
    name: str
    weights_bytes: int | None
    kv_bytes: int | None  # ONE sequence's cache at ctx (inspect's figure for the cache kind)
    parallel: int  # sequences served at once: PARALLEL, or derived from MEMORY, default 1
    prompt_cache_bytes: int  # the in-memory prompt cache's bound (RAM)
    baseline_bytes: int  # the server process itself, measured once per provider+model (stored)
    baseline_source: str  # "measured <date>" | "assumed (not measured yet)"
    reserve_bytes: int  # prefill scratch + allocator slack: RESERVE of the share, >= MIN_RESERVE
    ctx: int | None
    cache_key: str | None
    memory_bytes: int | None  # MEMORY= set by the user: then the share IS this
    source: str  # "MEMORY=24GB" | "CTX x PARALLEL"
    note: str = ""
    error: str | None = None
    # prompt tokens per prefill chunk whose scratch fits the reserve at ctx (mlx_lm.server's
    # --prefill-step-size; the engine chooses its own chunk within --memory)
    prefill_step: int = PREFILL_STEP
    window: int | None = None  # KV=auto: its bf16 recent window in tokens (CTX: all bf16)
    # the engine's dtype here where it is not inspect's bf16 (sizing/host.py): "float32 on
    # this CPU host" (its weights and the caches in the model's dtype counted twice)
    dtype: str | None = None

    @property
    def kv_note(self) -> str | None:
        """KV=auto: what it does with a sequence at CTX x PARALLEL in this share, one line."""
        if self.window is None or self.ctx is None:
            return None
        return f"KV=auto at CTX {self.ctx:,} x {self.parallel}: " + describe_window(
            self.ctx, self.window, "INT2 (the calibration's formats)"
        )

    @property
    def kv_total_bytes(self) -> int | None:
        return None if self.kv_bytes is None else self.kv_bytes * self.parallel

    @property
    def share_bytes(self) -> int | None:
        """The whole share; None when it is unknown (then `error` says why)."""
        if self.error is not None:
            return None
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.weights_bytes is None or self.kv_bytes is None:
            return None
        return self.parts_bytes + self.reserve_bytes

    @property
    def parts_bytes(self) -> int:
        """Everything but the reserve (unknown parts as 0)."""
        return (
            (self.weights_bytes or 0)
            + (self.kv_total_bytes or 0)
            + self.prompt_cache_bytes
            + self.baseline_bytes
        )

    def as_dict(self) -> dict:
        """Every field, plus kv_total_bytes and share_bytes (JSON: `ls --json`, the router)."""
        d = asdict(self)
        d["note"] = self.note or None
        d["kv_total_bytes"] = self.kv_total_bytes
        d["share_bytes"] = self.share_bytes
        d["kv_note"] = self.kv_note
        return d

    def limits(self) -> Limits:
        """What the provider renders as its server's own flags (providers/base.py `Limits`)."""
        return Limits(
            share_bytes=self.share_bytes,
            ctx=self.ctx,
            parallel=self.parallel,
            kv_bytes=self.kv_bytes,
            prompt_cache_bytes=self.prompt_cache_bytes,
            reserve_bytes=self.reserve_bytes,
            prefill_step=self.prefill_step,
            baseline_bytes=self.baseline_bytes,
            why_unknown=self.error or (None if self.share_bytes else "its share is unknown"),
            window=self.window,
        )


def unknown(name: str, error: str) -> Share:
    """The share of a profile that cannot even be read (one broken profile among others)."""
    return Share(name, None, None, 1, 0, 0, "", 0, None, None, None, "", error=error)


def share(name: str) -> Share:
    return share_of(ProfileStore().load(name))


def with_reserve(parts: int) -> int:
    """The share whose reserve is what is left over after `parts`."""
    return max(math.ceil(parts / (1 - RESERVE)), parts + MIN_RESERVE)


def reserve_for(memory: int) -> int:
    """The reserve of a share of `memory` bytes (MEMORY= by hand)."""
    return max(math.ceil(memory * RESERVE), MIN_RESERVE)


def fit_parallel(memory: int, fixed: int, kv: int) -> int:
    """Whole-context sequences that fit in `memory` after `fixed` (weights, prompt cache,
    baseline) and the reserve, at most MAX_PARALLEL; 0: not even one."""
    room = memory - reserve_for(memory) - fixed
    return min(MAX_PARALLEL, max(0, room // kv)) if kv > 0 else 0


def prompt_cache_bound(kv_bytes: int | None) -> int:
    """The in-memory prompt cache's bound: one whole-context sequence's cache, in whole MiB."""
    return math.ceil(kv_bytes / MIB) * MIB if kv_bytes else 0


def scratch_per_token(config: dict | None, ctx: int) -> int | None:
    """Prefill scratch per prompt token of a chunk at position `ctx`, one layer at a time:
    the attention scores (query heads x ctx, float32, as an unfused attention materializes
    them) and the MLP's and the residual stream's activations (float32). None: not a config."""
    if not config:
        return None
    c = text_config(config)
    heads = c.get("num_attention_heads")
    hidden = c.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int):
        return None
    mlp = max(
        (
            v
            for k in ("intermediate_size", "moe_intermediate_size")
            if isinstance(v := c.get(k), int)
        ),
        default=4 * hidden,
    )
    return 4 * (heads * ctx + 3 * mlp + 4 * hidden)


def prefill_step(reserve: int, per_token: int | None) -> int:
    """The longest chunk (at most PREFILL_STEP) whose scratch fits `reserve`, at least 1."""
    if not per_token:
        return PREFILL_STEP
    return max(1, min(PREFILL_STEP, reserve // per_token))


def _gib(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MIB:.1f} MiB"


def too_small(s: Share) -> str | None:
    """Why MEMORY cannot hold weights + PARALLEL sequences (+ prompt cache, baseline,
    reserve), with the figures; None when it fits (or MEMORY is not set)."""
    if s.memory_bytes is None or s.weights_bytes is None or s.kv_bytes is None:
        return None
    need = with_reserve(
        s.weights_bytes + s.kv_bytes * s.parallel + s.prompt_cache_bytes + s.baseline_bytes
    )
    if need <= s.memory_bytes:
        return None
    return (
        f"{s.source} is too small for {s.parallel} sequence(s) at CTX {s.ctx}: it needs "
        f"{_gib(need)} (weights {_gib(s.weights_bytes)} + cache {_gib(s.kv_bytes)} x "
        f"{s.parallel} + prompt cache {_gib(s.prompt_cache_bytes)} + baseline "
        f"{_gib(s.baseline_bytes)} + {RESERVE:.0%} reserve, at least {_gib(MIN_RESERVE)}): "
        "raise MEMORY, or lower CTX" + (" or PARALLEL" if s.parallel > 1 else "")
    )


def share_of(profile: Profile, device: str | None = None) -> Share:
    """A profile's share, saved or not (the web page and `set` size a change before making
    it). Never raises for a model it cannot size: `error` says why (share_bytes is None).
    `device`: where MLX computes ("cpu" | "gpu": sizing/host.py), None: on this host."""
    p = providers.typed(profile)
    prov = providers.for_profile(p)
    memory = p.memory
    s = Share(
        name=p.name,
        weights_bytes=None,
        kv_bytes=None,
        parallel=p.parallel or 1,
        prompt_cache_bytes=0,
        baseline_bytes=0,
        baseline_source="",
        reserve_bytes=0,
        ctx=p.ctx,
        cache_key=None,
        memory_bytes=memory,
        source=f"MEMORY={p.values.get('MEMORY')}" if memory is not None else "CTX x PARALLEL",
    )
    if not prov.serves_model:
        return replace(s, note=prov.footprint_note)
    bl, bl_source = baseline.lookup(prov.name, p.model, prov.assumed_baseline)
    s = replace(s, cache_key=prov.cache_key(p), baseline_bytes=bl, baseline_source=bl_source)
    try:
        rep = inspect_source(p.model)
    except MacserveError as e:
        return replace(s, error=f"{p.model}: {e}")
    ctx, notes = p.ctx, []
    if ctx is None:
        ctx = rep.shape.max_position_embeddings
        notes.append("no context set: counted at the model's limit")
    if prov.context_args(1) is None:
        notes.append(f"{prov.label} has no context flag: macserve refuses longer prompts")
    if p.multi_host:
        notes.append("the whole model, before it is split over HOSTS")
    # what the server really holds here: the engine in float32 on MLX's CPU (sizing/host.py)
    lay, weights, dtype = host.held(
        rep.layouts.get(s.cache_key) if s.cache_key else None,
        rep.weights_bytes,
        rep.source.local_path,
        prov.float32_on_cpu,
        device,
    )
    if dtype:
        notes.append(f"the engine's weights and caches in {dtype}")
        s = replace(s, dtype=dtype)
    kv = lay.bytes_at(ctx) if lay is not None and lay.supported and ctx else None
    auto = None
    if lay is not None and kv is not None and ctx and (p.kv or prov.default_kv()) == CacheKind.AUTO:
        auto = auto_figures(lay, ctx)
        kv = auto[2]  # every row bf16: what CTX x PARALLEL needs when no MEMORY bounds it
        s = replace(s, window=ctx)
    per_token = scratch_per_token(rep.source.config, ctx) if ctx else None
    s = replace(s, weights_bytes=weights, kv_bytes=kv, ctx=ctx, prompt_cache_bytes=0)
    s = replace(s, prompt_cache_bytes=prompt_cache_bound(kv))
    unknown = None
    if kv is None:
        unknown = f"inspect does not model a {p.kv or prov.default_kv()} cache of {p.model}"
    elif weights is None:
        unknown = f"the weights of {p.model} are unknown"
    if memory is None and auto is not None and not unknown:
        budget = machine_budget().budget_bytes
        if with_reserve(s.parts_bytes) > budget:
            # all bf16 would not fit this machine: the budget bounds it, as serve's does
            notes.append("KV=auto all bf16 is over this machine's budget: fitted in it")
            s = replace(s, memory_bytes=budget, source="this machine's budget")
            s = fit_window(replace(s, reserve_bytes=reserve_for(budget)), auto, budget)
            s = replace(s, note="; ".join(notes), error=too_small(s))
            return replace(s, prefill_step=prefill_step(s.reserve_bytes, per_token))
    if memory is None:
        if unknown:
            why = f"{unknown}: set MEMORY= to give it a share by hand"
            return replace(s, note="; ".join(notes), error=why)
        reserve = with_reserve(s.parts_bytes) - s.parts_bytes
        step = prefill_step(reserve, per_token)
        return replace(s, note="; ".join(notes), reserve_bytes=reserve, prefill_step=step)
    s = replace(s, reserve_bytes=reserve_for(memory))
    if unknown:
        notes.append(f"{unknown}: the share is MEMORY alone")
    elif p.parallel is None:
        assert kv is not None and weights is not None
        n = fit_parallel(memory, weights + s.prompt_cache_bytes + bl, kv)
        s = replace(s, parallel=max(1, n))
        capped = " (the most it derives)" if n == MAX_PARALLEL else ""
        bf16 = " in bf16" if auto else ""
        notes.append(f"PARALLEL={max(1, n)} derived from MEMORY{bf16}{capped}")
        if auto and n == 0:
            s = fit_window(s, auto, memory)
    elif auto:
        s = fit_window(s, auto, memory)
    s = replace(s, note="; ".join(notes), error=too_small(s))
    return replace(s, prefill_step=prefill_step(s.reserve_bytes, per_token))


def fit_window(s: Share, figures: tuple[int, int, int], memory: int) -> Share:
    """KV=auto in MEMORY: the longest bf16 window at which PARALLEL sequences and the prompt
    cache's one fit beside the weights, baseline and reserve (a MiB kept for the prompt
    cache's rounding); none fits: int2's own (too_small then says so with the figures)."""
    assert s.ctx is not None and s.weights_bytes is not None
    room = memory - s.reserve_bytes - s.weights_bytes - s.baseline_bytes
    full = figures[2]
    if s.parallel * full + prompt_cache_bound(full) <= room:
        w = s.ctx
    else:
        w = auto_window(s.ctx, s.parallel + 1, room - MIB, *figures) or INT2.recent
    kv = window_bytes(s.ctx, w, *figures)
    return replace(s, kv_bytes=kv, prompt_cache_bytes=prompt_cache_bound(kv), window=w)


def check(profile: Profile) -> Share:
    """`new` and `set`: a MEMORY that cannot hold the model is refused with the figures."""
    s = share_of(profile)
    why = too_small(s)
    if why:
        raise MacserveError(why)
    return s


def record_baseline(profile: Profile, pid: int | None) -> None:
    """Once a start is ready (health.wait_ready): the first time this provider serves this
    model here, store its process tree's resident bytes less the weights (baseline.py). A
    measurement that cannot be made is skipped: it never fails a start."""
    p = providers.typed(profile)
    prov = providers.for_profile(p)
    # one host's tree is not a multi-host server's baseline
    if pid is None or not prov.serves_model or p.multi_host:
        return
    try:
        if baseline.measured(prov.name, p.model):
            return
        rss = baseline.tree_rss(pid)
        s = share_of(p)
        held = s.weights_bytes
        if held is not None and prov.holds_cache_at_start:
            held = None if s.kv_total_bytes is None else held + s.kv_total_bytes
        if rss and held is not None:
            baseline.record(prov.name, p.model, rss, held)
    except (MacserveError, OSError):
        return
