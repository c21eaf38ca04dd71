"""What `macserve new` serves and how big: provider, MODEL value, context, MTP layers.

All the model reading and KV arithmetic is `inspect`'s (sizing.report, which is sources ->
arch -> kv_layout); this module only turns its report into profile choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MacserveError
from ..sizing.report import report

# Which of inspect's cache figures describe each provider's default cache.
# The engine serves bf16 unless EXTRA_ARGS asks for --kv int2, so size for what it runs.
CACHE_KEY = {"llama.cpp": "llama.cpp/f16", "mlx": "mlx/bf16", "macserve": "mlx/bf16"}


@dataclass
class Plan:
    provider: str
    model: str  # the profile's MODEL value
    n_ctx: int | None  # tokens per sequence to configure (None: leave to the server)
    mtp_layers: int
    is_gguf: bool
    cache_key: str
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
) -> Plan:
    r = report(source, quant, parallel=parallel)
    is_gguf = bool(r["is_gguf"])
    provider = provider or ("llama.cpp" if is_gguf else "mlx")
    if provider == "llama.cpp" and not is_gguf:
        raise MacserveError(
            f"{source}: llama.cpp serves GGUF files; give a .gguf or a GGUF repo with :QUANT"
        )
    if provider in ("mlx", "macserve") and is_gguf:
        raise MacserveError(
            f"{source}: {provider} serves MLX/safetensors models, not GGUF (use --provider llama.cpp)"
        )
    key = CACHE_KEY[provider]
    fits = r["max_context"].get(key)
    if ctx in (None, "auto"):
        if fits is None:
            raise MacserveError(f"{source}: {provider} cannot cache this model's layers")
        if fits <= 0:
            raise MacserveError(
                f"{source}: the weights alone do not fit the {r['budget_bytes'] / 2**30:.1f} GB budget"
            )
        n_ctx = fits
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
        provider,
        model,
        n_ctx,
        int(r.get("mtp_layers") or 0),
        is_gguf,
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
        )
    return pl
