"""`inspect` end to end: source -> shape -> per-engine figures -> a plain report dict."""

from __future__ import annotations

from .arch import ModelShape, shape_from_config, shape_from_gguf
from .memory import (CACHE_KEYS, kv_bytes_per_token, machine_budget, max_context,
                     state_bytes_per_sequence)
from .sources import ModelSource, resolve

TABLE_CONTEXTS = (8192, 32768, 131072)


def shape_of(src: ModelSource) -> ModelShape:
    return shape_from_gguf(src.gguf_meta) if src.is_gguf else shape_from_config(src.config)


def report(source: str, quant: str | None = None, memory_bytes: int | None = None,
           parallel: int = 1, ctx: int | None = None) -> dict:
    src = resolve(source, quant)
    shape = shape_of(src)
    budget = machine_budget(memory_bytes)
    keys = [k for k in CACHE_KEYS if not (src.is_gguf and k.startswith("mlx"))]
    per = {k: kv_bytes_per_token(shape, k) for k in keys}
    state = {k: state_bytes_per_sequence(shape, k) for k in keys}
    fits = {k: max_context(shape, k, budget.budget_bytes, src.weights_bytes, parallel) for k in keys}
    def total(k, n):
        if per[k] is None or state[k] is None:
            return None
        return src.weights_bytes + parallel * (state[k] + n * per[k])
    contexts = list(TABLE_CONTEXTS) + ([ctx] if ctx else [])
    table = {k: {str(n): total(k, n) for n in contexts} for k in keys}
    counts = shape.counts()
    indexers = sum(1 for l in shape.layers if getattr(l, "indexer", 0) and not l.indexer_shared)
    if indexers:
        counts["mla_indexer_owned"] = indexers
    return {
        "source": src.name,
        "model_type": shape.model_type,
        "layers": counts,
        "kv_bytes_per_token": per,
        "state_bytes_per_sequence": state,
        "max_context": fits,
        "model_max_context": shape.max_position_embeddings,
        "weights_bytes": src.weights_bytes,
        "budget_bytes": budget.budget_bytes,
        "budget_source": budget.source,
        "total_memory_bytes": budget.total_bytes,
        "wired_limit_bytes": budget.wired_limit_bytes,
        "parallel": parallel,
        "memory_at_context": table,
        "ctx": ctx,
        "mtp_layers": len(shape.mtp_layers),
        "gguf_header_bytes_read": src.header_bytes_read or None,
        "is_gguf": src.is_gguf,
    }
