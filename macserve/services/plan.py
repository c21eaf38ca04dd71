"""What `macserve new` serves and how big: provider, MODEL value, context, cache type, MTP layers.

All the model reading and KV arithmetic is `inspect`'s (sizing.report, which is sources ->
arch -> kv_layout); which provider serves a format, its cache types and how sizing names them
are the providers' own facts. This module only turns the report into profile choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MacserveError
from ..sizing import host
from ..sizing.kv_layout import max_context
from ..sizing.report import inspect_source, report_of
from . import providers

FORMAT_NAMES = {"gguf": "GGUF files", "mlx": "MLX/safetensors models"}


@dataclass
class Plan:
    provider: str
    model: str  # the profile's MODEL value
    n_ctx: int | None  # tokens per sequence to configure (None: leave to the server)
    mtp_layers: int
    is_gguf: bool
    kv: str | None  # the KV key to write (None: the provider's default, not written)
    cache_key: str | None  # sizing's key for that cache (None: inspect does not model it)
    fits: int | None  # what fits in the budget for that cache (for messages)
    budget_bytes: int
    model_max: int | None = None
    notes: list[str] = field(default_factory=list)
    remote: bool = False  # a hub repo id, not a local path: `new` pulls it first


def plan(
    source: str,
    quant: str | None = None,
    provider: str | None = None,
    ctx: int | str | None = "auto",
    parallel: int = 1,
    kv: str | None = None,
    memory_bytes: int | None = None,
    device: str | None = None,
) -> Plan:
    """`memory_bytes`: a machine of that much RAM, not this one; `device`: where MLX computes
    ("cpu" | "gpu"), None: here (both as sizing/host.py and the share take them)."""
    rep = inspect_source(source, quant)
    r = report_of(rep, memory_bytes, parallel=parallel)
    is_gguf = bool(r["is_gguf"])
    fmt = "gguf" if is_gguf else "mlx"
    prov = providers.get(provider) if provider else providers.serving(fmt)[0]
    if fmt not in prov.formats:
        others = " or ".join(p.name for p in providers.serving(fmt))
        raise MacserveError(
            f"{source}: {prov.name} does not serve {FORMAT_NAMES[fmt]} (use --provider {others})"
        )
    if kv is not None and kv not in prov.cache_types:
        raise MacserveError(f"--kv {kv}: {prov.label} caches {' | '.join(prov.cache_types)}")
    key = prov.cache_types.get(kv or prov.default_kv() or "")
    fits = r["max_context"].get(key) if key else None
    lay, weights, dtype = host.held(
        rep.layouts.get(key) if key else None,
        rep.weights_bytes,
        rep.source.local_path,
        prov.float32_on_cpu,
        device,
    )
    if dtype and key and lay is not None:
        # the context the share will hold: inspect's rows are what a Mac's GPU holds
        fits = max_context(rep.shape, key, r["budget_bytes"], weights or 0, parallel, lay)
    if ctx in (None, "auto"):
        if key is not None and fits is None:
            raise MacserveError(f"{source}: {prov.name} cannot cache this model's layers")
        if fits is not None and fits <= 0:
            raise MacserveError(
                f"{source}: the weights alone do not fit the {r['budget_bytes'] / 2**30:.1f} GB budget"
            )
        n_ctx = fits  # None for a cache inspect does not model: the server's default
    else:
        n_ctx = int(ctx)
        if n_ctx < 1:
            raise MacserveError("--ctx must be a positive number or auto")
    p = Path(source).expanduser()
    remote = not p.exists()
    if not remote:
        model = str(p.resolve())
    else:
        model = f"{source}:{quant}" if quant and is_gguf and ":" not in source else source
    pl = Plan(
        prov.name,
        model,
        n_ctx,
        int(r.get("mtp_layers") or 0),
        is_gguf,
        kv,
        key,
        fits,
        r["budget_bytes"],
        r.get("model_max_context"),
        remote=remote,
    )
    if fits is not None and n_ctx > fits:
        pl.notes.append(
            f"context {n_ctx:,} is more than the {fits:,} tokens that fit "
            f"{r['budget_bytes'] / 2**30:.1f} GB ({r['budget_source']}) with {key}"
            + (f" in {dtype}" if dtype else "")
        )
    return pl
