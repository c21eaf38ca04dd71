"""`inspect` end to end: source -> shape -> per-engine layouts -> a plan for a machine.

Public API (what `macserve new` calls to size a context):

    rep = inspect_source("org/name:Q4_K_M")        # or a folder, config.json, .gguf
    p = plan(rep, memory_bytes=None, parallel=1, ctx=None)
    n = max_context(rep, "llama.cpp/q8_0", p.budget.budget_bytes, parallel=2)

`inspect_source(source, quant=None) -> Report`: what the model is and what each engine
caches for it (no machine involved). `plan(report, memory_bytes=None, parallel=1, ctx=None)
-> Plan`: the budget of this Mac (or of `memory_bytes` of RAM), the max context per cache
type and the memory at 8K/32K/128K/max (and `ctx`). `report(...) -> dict` is both, as the
plain dict `inspect --json` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MacserveError
from ..hf_config import text_config
from ..int2_format import SHIPPED_ROTATION, read_plan
from . import host
from .arch import ModelShape
from .arch_config import shape_from_config
from .arch_gguf import shape_from_gguf
from .budget import Budget, machine_budget
from .kv_buffers import Layout
from .kv_layout import CACHE_KEYS, as_number, engine_notes, layout, measured_layout
from .kv_layout import max_context as _max_context
from .mlx_measure import measure as measure_mlx
from .model_source import ModelSource, read_gguf_file
from .sources import resolve

TABLE_CONTEXTS = (8192, 32768, 131072)
ENGINE_MLX = ("mlx", "macserve")  # the rows of caches mlx-lm's arrays hold (not llama.cpp's)


@dataclass
class Report:
    source: ModelSource
    shape: ModelShape
    layouts: dict  # cache key -> Layout (trunk layers)
    mtp_layouts: dict  # cache key -> Layout (MTP layers alone; not in the trunk figures)
    notes: list = field(default_factory=list)
    int2_plan: str | None = None  # what the macserve/int2 row counts: a calibration's plan

    @property
    def weights_bytes(self) -> int | None:
        return self.source.weights_bytes

    def supported(self) -> list[str]:
        return [k for k, lay in self.layouts.items() if lay.supported]


@dataclass
class Plan:
    budget: Budget
    parallel: int
    max_context: dict  # key -> int | None
    at_context: dict  # key -> {ctx: total bytes (weights + parallel x cache)}
    ctx: int | None
    over_budget: list  # keys whose `ctx` does not fit


def shape_of(src: ModelSource) -> ModelShape:
    return shape_from_gguf(src.gguf_meta) if src.is_gguf else shape_from_config(src.config)


def inspect_source(source: str, quant: str | None = None, measure: bool = True) -> Report:
    """`measure`: the mlx/bf16 row from mlx-lm's own caches (mlx_measure.py) where mlx-lm
    has the model type; False keeps every row modelled (and mlx unimported)."""
    src = resolve(source, quant)
    try:
        shape = shape_of(src)
    except MacserveError as e:
        if not measure or src.is_gguf:
            raise
        return _measured_only(src, e)
    keys = [k for k in CACHE_KEYS if not (src.is_gguf and not k.startswith("llama.cpp"))]
    lays = {k: layout(shape, k) for k in keys}
    mtp = {k: layout(shape, k, mtp=True) for k in keys} if shape.mtp_layers else {}
    notes = engine_notes(shape)
    if measure and not src.is_gguf:
        notes += _measure_mlx(src.config, lays)
    if src.weights_bytes is None:
        notes.append("weights unknown (a bare config): max context assumes no weights")
    if quant and not src.is_gguf:
        notes.append(
            f"--quant {quant} ignored: it picks among GGUF files, and this source is a "
            "config (for MLX weights of another size, --weights 4bit or a size)"
        )
    plan = _int2_plan(src, shape, lays, notes) if "macserve/int2" in lays else None
    return _in_checkpoint_dtype(Report(src, shape, lays, mtp, notes, plan))


def _in_checkpoint_dtype(rep: Report) -> Report:
    """mlx-lm computes in a local checkpoint's own dtype (host.py): a float32 one holds its
    mlx-lm caches (the mlx and macserve rows' buffers in the model's dtype) at 4 B a value,
    not the bf16 they are counted at. llama.cpp's rows store their own types."""
    value = host.checkpoint_bytes(rep.source.local_path) if not rep.source.is_gguf else None
    if value is None or value == 2:
        return rep
    for lays in (rep.layouts, rep.mtp_layouts):
        for k, lay in lays.items():
            if k.split("/")[0] in ENGINE_MLX:
                lays[k] = host.widen(lay, value)
    name = host.DTYPE_NAMES.get(value, f"{value}-byte")
    rep.notes.append(
        f"this checkpoint is {name}: mlx-lm computes in it (its load casts nothing), so the "
        f"mlx and macserve rows count its caches in {name}"
    )
    return rep


def _int2_plan(src: ModelSource, shape: ModelShape, lays: dict, notes: list) -> str | None:
    """A model folder that holds a calibration file: the macserve/int2 row counts the formats
    its plan names per layer (what the engine will store); without one, INT2 g64 on every
    MLA layer, labelled uncalibrated (calibrate may choose wider formats)."""
    if not lays["macserve/int2"].supported:
        return None
    folder = Path(src.local_path) if src.local_path else None
    cal = folder / SHIPPED_ROTATION if folder and folder.is_dir() else None
    if cal is None or not cal.is_file():
        return "uncalibrated: INT2 g64 on every MLA layer (macserve calibrate measures a plan)"
    try:
        plan = read_plan(cal)
    except ValueError as e:
        notes.append(f"macserve/int2 uncalibrated: {e}")
        return "uncalibrated: the calibration file is unreadable"
    lay = layout(shape, "macserve/int2", plan=plan.quants())
    if not lay.supported:
        notes.append(f"macserve/int2 uncalibrated: {SHIPPED_ROTATION}: {lay.reason}")
        return "uncalibrated: the calibration does not fit this model"
    lays["macserve/int2"] = lay
    return f"{SHIPPED_ROTATION}: {plan.summary()}"


def _measured_only(src: ModelSource, why: MacserveError) -> Report:
    """A config inspect cannot classify but mlx-lm can build: the mlx row alone, measured;
    the other rows say why they are missing. Neither: the classification error stands."""
    m = measure_mlx(src.config)
    if not m.ok:
        raise why
    tc = text_config(src.config)
    limit = tc.get("max_position_embeddings")
    shape = ModelShape(
        str(src.config.get("model_type")),
        [],
        max_position_embeddings=limit if isinstance(limit, int) and limit > 0 else None,
    )
    reason = "inspect cannot classify this config's layers (see the note)"
    lays = {k: Layout(k, supported=False, reason=reason) for k in CACHE_KEYS}
    lays["mlx/bf16"] = measured_layout(m)
    notes = [f"layers not classified ({why}); the mlx/bf16 row is {m.engine}'s own allocation"]
    if src.weights_bytes is None:
        notes.append("weights unknown (a bare config): max context assumes no weights")
    return _in_checkpoint_dtype(Report(src, shape, lays, {}, notes))


def _measure_mlx(config: dict, lays: dict) -> list[str]:
    """Replace the modelled mlx/bf16 layout by what mlx-lm allocates; notes on what differs."""
    m = measure_mlx(config)
    if not m.ok:
        # No module: engine_notes already says so. A module that fails on this config: say why.
        return [f"mlx/bf16 modelled: {m.reason}"] if m.module else []
    modelled = lays["mlx/bf16"]
    got = measured_layout(m)
    lays["mlx/bf16"] = got
    if not modelled.supported:
        return [f"mlx/bf16 measured in {m.engine}; inspect's own model: {modelled.reason}"]
    if (modelled.per_token, modelled.state) != (got.per_token, got.state):
        return [
            f"inspect's own model of {m.engine} ({as_number(modelled.per_token):,} B/token, "
            f"{modelled.state:,} B/sequence) differs from what it allocates; the measured "
            "figures are shown"
        ]
    return []


def max_context(report: Report, cache_key: str, budget_bytes: int, parallel: int = 1) -> int:
    """Longest context per sequence for `parallel` sequences beside the weights (0: none
    fits). Raises MacserveError when that engine cannot cache this model."""
    lay: Layout = report.layouts.get(cache_key) or layout(report.shape, cache_key)
    if not lay.supported:
        raise MacserveError(f"{cache_key}: {lay.reason}")
    return _max_context(
        report.shape, cache_key, budget_bytes, report.weights_bytes or 0, parallel, lay
    )


def plan(
    report: Report, memory_bytes: int | None = None, parallel: int = 1, ctx: int | None = None
) -> Plan:
    budget = machine_budget(memory_bytes)
    weights = report.weights_bytes or 0
    fits, table, over = {}, {}, []
    for k, lay in report.layouts.items():
        if not lay.supported:
            fits[k], table[k] = None, None
            continue
        fits[k] = _max_context(report.shape, k, budget.budget_bytes, weights, parallel, lay)
        points = list(TABLE_CONTEXTS) + [fits[k]] + ([ctx] if ctx else [])
        table[k] = {n: weights + parallel * lay.bytes_at(n) for n in points}
        if ctx and table[k][ctx] > budget.budget_bytes:
            over.append(k)
    return Plan(budget, parallel, fits, table, ctx, over)


def report(
    source: str,
    quant: str | None = None,
    memory_bytes: int | None = None,
    parallel: int = 1,
    ctx: int | None = None,
    measure: bool = True,
) -> dict:
    return report_of(inspect_source(source, quant, measure), memory_bytes, parallel, ctx)


def report_of(
    rep: Report, memory_bytes: int | None = None, parallel: int = 1, ctx: int | None = None
) -> dict:
    """`report` for a Report already in hand (inspect --hosts resolves the source once)."""
    p = plan(rep, memory_bytes, parallel, ctx)
    shape = rep.shape

    def per_key(fn):
        return {k: (fn(lay) if lay.supported else None) for k, lay in rep.layouts.items()}

    layers = shape.counts()
    return {
        "source": rep.source.name,
        "format": rep.source.kind,
        "is_gguf": rep.source.is_gguf,
        "model_type": shape.model_type,
        "layers": layers,
        "indexers": shape.indexers(),
        "kv_bytes_per_token": per_key(lambda l: as_number(l.per_token)),
        "state_bytes_per_sequence": per_key(lambda l: l.state),
        "max_context": p.max_context,
        "unsupported": {k: lay.reason for k, lay in rep.layouts.items() if not lay.supported},
        "row_source": {k: lay.origin for k, lay in rep.layouts.items()},
        "measured_with": {k: lay.engine for k, lay in rep.layouts.items() if lay.engine},
        "mtp": {
            "layers": len(shape.mtp_layers),
            "kv_bytes_per_token": {
                k: as_number(l.per_token) if l.supported else None
                for k, l in rep.mtp_layouts.items()
            },
        },
        "mtp_layers": len(shape.mtp_layers),
        "model_max_context": shape.max_position_embeddings,
        "weights_bytes": rep.weights_bytes,
        "budget_bytes": p.budget.budget_bytes,
        "budget_source": p.budget.source,
        "total_memory_bytes": p.budget.total_bytes,
        "wired_limit_bytes": p.budget.wired_limit_bytes,
        "parallel": parallel,
        "ctx": ctx,
        "memory_at_context": {
            k: ({str(n): b for n, b in t.items()} if t else None) for k, t in p.at_context.items()
        },
        "over_budget": p.over_budget,
        "notes": rep.notes,
        "int2_plan": rep.int2_plan,
        # macserve's engine on this host where it differs from the rows (float32 on a CPU)
        "engine_host": host.engine_on_host(rep.layouts, rep.weights_bytes, rep.source.local_path),
        # the dtype the mlx and macserve rows count mlx-lm's caches in: the checkpoint's
        "rows_dtype": host.DTYPE_NAMES.get(_rows_bytes(rep), "bf16"),
        "files": rep.source.files,
        "gguf_header_bytes_read": rep.source.header_bytes_read or None,
    }


def _rows_bytes(rep: Report) -> int:
    lay = rep.layouts.get("mlx/bf16")
    return lay.model_bytes if lay is not None else 2


@dataclass(frozen=True)
class MlxCheck:
    """inspect's modelled mlx/bf16 layout of a config against what mlx-lm allocates."""

    model_type: str
    module: str | None
    measured: tuple | None  # (B/token, B/sequence), None when not measured
    modelled: tuple | None  # (B/token, B/sequence), None when inspect cannot model it
    why: str = ""  # why one side is missing

    @property
    def agree(self) -> bool:
        return self.measured is not None and self.measured == self.modelled


def mlx_check(config: dict) -> MlxCheck:
    """For `macserve dev mlx-check`: measure (never from the on-disk cache) and model."""
    mt = str(config.get("model_type"))
    m = measure_mlx(config, use_cache=False)
    measured = (as_number(m.per_token), m.fixed) if m.ok else None
    why = "" if m.ok else f"measure: {m.reason}"
    try:
        lay = layout(shape_from_config(config), "mlx/bf16")
        modelled = (as_number(lay.per_token), lay.state) if lay.supported else None
        if not lay.supported:
            why = why or f"model: {lay.reason}"
    except MacserveError as e:
        modelled, why = None, why or f"model: {e}"
    return MlxCheck(mt, m.module, measured, modelled, why)


def llama_bytes_at(source, ctx: int, cache_key: str = "llama.cpp/f16") -> tuple:
    """inspect's llama.cpp figures at `-c ctx -np 1` for `source` (a config dict, or a .gguf
    path whose header is read as `inspect` reads it), for `macserve dev llama-truth`: (total
    cache bytes, bytes per token), or (None, reason) if unsupported."""
    if isinstance(source, dict):
        shape = shape_from_config(source)
    else:
        shape = shape_from_gguf(read_gguf_file(source).gguf_meta)
    lay = layout(shape, cache_key)
    if not lay.supported:
        return None, lay.reason
    return lay.bytes_at(ctx), lay.per_token
