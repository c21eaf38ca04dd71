"""`bench memory`'s cache figures: what MLX's allocator holds for one sequence's cache, INT2
against the bf16 latent (the same class, quantization off) and mlx-lm's own cache, at
DeepSeek-V3's width (one layer of the synthetic model: a layer's cache does not depend on the
others), and what that means for a whole 61-layer model: bytes per sequence, sequences of a
context that fit a cache budget, and the context one sequence reaches in it.

The allocator's figure is bench engine's `held_memory`: gc, mx.clear_cache, get_active_memory
before and after a prefill in 2,048-token chunks, the rotations (made before, shared by every
sequence) apart. It is not the codes' per-token ratio: the INT2 cache keeps its first and last
rows in bf16 (a fixed cost per sequence), and every cache grows in steps.
"""

from __future__ import annotations

from .engine import held_memory
from .setup import HELD, setup_synthetic

DEEPSEEK_V3_LAYERS = 61  # every one of them MLA (config.json: num_hidden_layers)


def held(contexts: tuple[int, ...], layers: int = DEEPSEEK_V3_LAYERS, progress=print) -> dict:
    """{ctx: {cache: {"per_token_per_layer", "per_sequence"}}} and each cache's bytes over
    INT2's, measured on one layer in the model's bf16 (what a Mac holds)."""
    s = setup_synthetic("deepseek-v3", 1)
    out: dict = {"model": s.name, "layers_counted": layers, "contexts": {}}
    for n in contexts:
        progress(f"held bytes at {n:,} tokens")
        m = held_memory(s, n, HELD)
        row = {
            w: {
                "per_token_per_layer": round(v[0] / n, 1),
                "per_sequence": v[0] * layers,
            }
            for w, v in m.items()
        }
        for w in row:
            row[w]["over_int2"] = round(row[w]["per_sequence"] / row["int2"]["per_sequence"], 2)
        out["contexts"][str(n)] = row
    out["rotation_bytes_per_layer"] = m["int2"][2] if contexts else None
    return out


def per_budget(table: dict, budget: int) -> dict:
    """For a cache budget of `budget` bytes, per measured context and cache: the whole
    sequences of that context that fit it, and the tokens of context they hold together."""
    out = {}
    for n, row in table["contexts"].items():
        out[n] = {w: {"sequences": budget // v["per_sequence"]} for w, v in row.items()}
        for v in out[n].values():
            v["tokens"] = v["sequences"] * int(n)
    return {"budget_bytes": budget, "contexts": out}
