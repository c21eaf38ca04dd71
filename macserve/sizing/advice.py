"""What `inspect` tells a user whose model does not fit: one verdict and the options that can
help, each with the context it would give, computed by the same arithmetic as the table.

weights_verdict(rep, r, memory, parallel) -> list[str]   empty when the weights fit
over_budget_warning(r) -> str | None                      one line for every row over at --ctx
"""

from __future__ import annotations

from ..errors import MacserveError
from .budget import parse_size
from .hosts import plan_hosts, weights_split
from .kv_layout import max_context

MAX_HOSTS = 16  # the most Macs a suggestion names (mlx.launch and llama.cpp RPC go further)
MACOS_RESERVE = parse_size("8GB")  # left to macOS when the wired limit is raised by hand
QUANT_BITS = (4, 3, 2)  # MLX quantizations a suggestion may name, widest first


def _gb(b: int) -> str:
    return f"{b / 2**30:,.1f} GB"


def _main_key(rep) -> str | None:
    return next((k for k, lay in rep.layouts.items() if lay.supported), None)


def weights_verdict(rep, r: dict, memory_bytes: int | None, parallel: int) -> list[str]:
    """Lines for a model whose weights alone leave no room for a cache under the budget:
    the verdict, then each option that helps (more Macs, a raised wired limit, a smaller
    quant), with the longest context it gives. Empty when any row has room."""
    key = _main_key(rep)
    weights = r["weights_bytes"]
    if key is None or not weights or any(v for v in r["max_context"].values() if v):
        return []
    budget = r["budget_bytes"]
    out = [
        f"verdict: does not fit: the weights alone ({_gb(weights)}) "
        + ("exceed" if weights > budget else "fill")
        + f" the {_gb(budget)} GPU budget; no context is left for a cache. What can help:"
    ]
    for n in range(2, MAX_HOSTS + 1):
        mh = plan_hosts(rep, [memory_bytes] * n, None, parallel)
        ctx = mh["splits"][0]["group_context"].get(key) or 0
        if ctx > 0:
            each = "this Mac's" if memory_bytes is None else _gb(memory_bytes)
            out.append(
                f"  - {n} Macs of {each} memory (inspect --hosts {n}): max ctx {ctx:,} with {key}"
            )
            break
    else:
        out.append(f"  - no split over {MAX_HOSTS} Macs of this size holds it")
    total = r["total_memory_bytes"]
    raised = total - MACOS_RESERVE
    if raised > budget:
        ctx = max_context(rep.shape, key, raised, weights, parallel, rep.layouts[key])
        mb = raised // 2**20
        if ctx > 0:
            out.append(
                f"  - a raised GPU wired limit, `sudo sysctl iogpu.wired_limit_mb={mb}` "
                f"(RAM less 8 GB for macOS): max ctx {ctx:,} with {key}"
            )
        else:
            out.append(
                f"  - not a raised wired limit: even {_gb(raised)} (RAM less 8 GB for "
                "macOS) does not hold the weights"
            )
    out += _smaller_quant(rep, key, weights, budget, parallel)
    return out


def _smaller_quant(rep, key: str, weights: int, budget: int, parallel: int) -> list[str]:
    if rep.source.is_gguf:
        return [f"  - a smaller GGUF quant than this {_gb(weights)} one (--quant)"]
    for bits in QUANT_BITS:
        try:
            w = weights_split(rep, f"{bits}bit").total
        except MacserveError:
            return []  # no parameter count for this layout: nothing honest to suggest
        if w >= weights * 0.95:
            continue  # not smaller than what is there
        ctx = max_context(rep.shape, key, budget, w, parallel, rep.layouts[key])
        if ctx > 0:
            return [f"  - an MLX {bits}-bit quantization (~{_gb(w)}): max ctx {ctx:,} with {key}"]
    return [f"  - not a smaller MLX quantization: even {QUANT_BITS[-1]}-bit does not fit"]


def over_budget_warning(r: dict) -> str | None:
    """One warning for all the rows over the budget at --ctx (was one per row)."""
    over = r["over_budget"]
    if not over:
        return None
    ctx, parallel = r["ctx"], r["parallel"]
    needs = ", ".join(f"{k} {_gb(r['memory_at_context'][k][str(ctx)])}" for k in over)
    room = [k for k in over if r["max_context"].get(k)]
    advice = (
        "lower --ctx or --parallel, or raise iogpu.wired_limit_mb"
        if room
        else "the weights alone do not fit: see the verdict above"
    )
    return (
        f"WARNING: --ctx {ctx:,} x {parallel} is over the {_gb(r['budget_bytes'])} GPU "
        f"budget with {needs}: expect swapping or a kernel panic; {advice}"
    )
