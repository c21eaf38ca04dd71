"""Planning a model across several Macs: pipeline (layers) or tensor (heads/experts) splits.

    hosts = parse_hosts("256GB,256GB,192GB", None)   # or parse_hosts(None, 3)
    rep = inspect_source("zai-org__GLM-5.json")
    p = plan_hosts(rep, hosts, weights="4bit")       # or weights=bytes; None: rep's own

The figures follow mlx-lm 0.32.2, the engine `mlx.launch ... mlx_lm.server` runs:
- pipeline (`models/pipeline.py`, `utils.sharded_load`): each rank runs a contiguous range
  of layers and caches only those; every rank also loads the embeddings, final norm and
  head ("Every stage keeps the embeddings, the final norm and the head").
- tensor (`Model.shard` in deepseek_v3/v32): q_b/o projections, per-head absorbed MLA
  weights, dense MLPs and every expert are split N ways; q_a/kv_a projections (the latent),
  norms, routers, embeddings and the head are not. The MLA latent cache is therefore NOT
  divided: every rank caches the whole latent of every layer. GQA KV heads divide by N
  when N divides them (otherwise each rank keeps them all).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ..errors import MacserveError
from ..hf_config import text_config
from .arch import MLA, Full, Sliding
from .budget import Budget, machine_budget, parse_size
from .kv_layout import as_number, layout
from .kv_layout import max_context as _max_context

# mlx_lm.convert -q: 4-bit values plus a bf16 scale and a bf16 bias per group of 64
MLX_GROUP = 64
MLX_SCALE_BITS = 32


def bits_per_weight(bits: int) -> float:
    return bits + MLX_SCALE_BITS / MLX_GROUP


def parse_hosts(memory: str | None, hosts: int | None) -> list[int | None]:
    """One RAM size per host (None: this machine's). A comma list in `memory` is one host
    per entry; `hosts` repeats one size (or this machine's) N times."""
    if memory and "," in memory:
        parts = [p.strip() for p in memory.split(",")]
        if any(not p for p in parts):
            raise MacserveError(f"--memory {memory!r}: an empty entry (try 256GB,256GB,192GB)")
        sizes = [parse_size(p) for p in parts]
        if hosts is not None and hosts != len(sizes):
            raise MacserveError(f"--hosts {hosts} but --memory lists {len(sizes)} hosts")
        return sizes
    if hosts is None:
        return [parse_size(memory) if memory else None]
    if hosts < 1:
        raise MacserveError(f"--hosts {hosts}: needs at least 1")
    return [parse_size(memory) if memory else None] * hosts


# ---------------------------------------------------------------------------------------
# parameters per layer, from config.json


@dataclass
class Params:
    """Parameter counts: `outer` = embeddings + head + final norm (on every pipeline
    rank), per trunk layer a (split, kept) pair: what tensor parallelism divides by N and
    what every rank keeps whole."""

    outer: int
    layers: list  # [(split, kept)]
    heads: int
    split_dims: dict  # name -> size that tensor parallelism divides

    @property
    def total(self) -> int:
        return self.outer + sum(s + k for s, k in self.layers)


def _experts(c: dict) -> int:
    return c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0


def _is_moe_layer(c: dict, i: int) -> bool:
    if not _experts(c):
        return False
    if i < c.get("first_k_dense_replace", 0) or i in (c.get("mlp_only_layers") or []):
        return False
    freq = c.get("moe_layer_freq") or c.get("decoder_sparse_step") or 1
    return i % freq == 0


def params_from_config(config: dict | None, n_layers: int) -> Params | None:
    """Counts for the MLA (DeepSeek-V3 family, GLM-5) and plain GQA layouts; None for any
    other layout, which is then split by layer count alone."""
    if not config:
        return None
    c = text_config(config)
    try:
        h, vocab, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
        outer = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h
        dims = {"attention heads": heads}
        layers = []
        for i in range(n_layers):
            split = kept = 0
            kept += 2 * h  # the two norms
            if c.get("kv_lora_rank"):
                nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
                lat, q_lora = c["kv_lora_rank"], c.get("q_lora_rank")
                if q_lora:
                    kept += h * q_lora + q_lora
                    split += q_lora * heads * (nope + rope)
                else:
                    split += h * heads * (nope + rope)
                kept += h * (lat + rope) + lat
                split += lat * heads * (nope + v) + heads * v * h
                if c.get("index_head_dim") and c.get("index_n_heads"):
                    ih, idim = c["index_n_heads"], c["index_head_dim"]
                    kept += (q_lora or h) * ih * idim + h * idim + h * ih + 2 * idim
            else:
                hd = c.get("head_dim") or h // heads
                kv = c.get("num_key_value_heads") or heads
                split += h * heads * hd * 2 + h * kv * hd * 2
                dims["KV heads"] = kv
            if _is_moe_layer(c, i):
                e, inter = _experts(c), c["moe_intermediate_size"]
                shared = c.get("n_shared_experts") or 0
                split += 3 * h * inter * (e + shared)
                kept += e * h
                dims["expert width"] = inter
            else:
                split += 3 * h * c["intermediate_size"]
                dims["MLP width"] = c["intermediate_size"]
            layers.append((split, kept))
    except (KeyError, TypeError):
        return None
    return Params(outer, layers, heads, dims)


# ---------------------------------------------------------------------------------------
# weights per part


@dataclass
class Weights:
    outer: int  # bytes on every host (pipeline) / kept whole (tensor)
    layers: list  # [(split bytes, kept bytes)] per trunk layer
    params: int | None  # None: not known from the config
    how: str

    @property
    def total(self) -> int:
        return round(self.outer + sum(s + k for s, k in self.layers))


def weights_split(rep, weights=None) -> Weights:
    """Bytes of each part. `weights`: bytes, "<n>bit" (from the config's parameter count
    under MLX's affine quantization), or None (what inspect found in the files)."""
    n = len(rep.shape.layers)
    p = params_from_config(rep.source.config, n) if not rep.source.is_gguf else None
    if isinstance(weights, str):
        m = re.fullmatch(r"\s*(\d+)\s*-?bits?\s*", weights, re.IGNORECASE)
        if not m:
            weights = parse_size(weights)
        else:
            if p is None:
                raise MacserveError(
                    f"--weights {weights}: no parameter count for this model "
                    "(its layout is not one inspect counts); pass a size, "
                    "e.g. --weights 380GB"
                )
            bpw = bits_per_weight(int(m.group(1)))
            return Weights(
                int(p.outer * bpw / 8),
                [(int(s * bpw / 8), int(k * bpw / 8)) for s, k in p.layers],
                p.total,
                f"{_params(p.total)} params x {bpw:g} bits ({m.group(1)}-bit "
                f"values + bf16 scale and bias per {MLX_GROUP})",
            )
    total = weights if weights is not None else rep.weights_bytes
    if total is None:
        raise MacserveError(
            "the multi-host plan needs the weights' size and a bare "
            "config.json has none: pass --weights 380GB or --weights 4bit"
        )
    if p is None:
        # No per-part counts: equal layers, nothing outside them.
        return Weights(
            0,
            [(total / n, 0)] * n,
            None,
            "spread equally over the layers (no parameter count for this layout)",
        )
    per = total / p.total
    return Weights(
        p.outer * per,
        [(s * per, k * per) for s, k in p.layers],
        p.total,
        f"{_gb(total)} spread over {_params(p.total)} params by count",
    )


UNKNOWN_NOTE = "weights unknown (a bare config): max context assumes no weights"


def apply_weights(rep, weights) -> None:
    """Make an explicit --weights the report's own, so the one-host table counts it."""
    if weights is None:
        return
    w = weights_split(rep, weights)
    rep.source.weights_bytes = w.total
    rep.notes = [n for n in rep.notes if n != UNKNOWN_NOTE]


def _gb(b):
    return f"{b / 2**30:,.1f} GB" if b >= 2**30 else f"{b / 2**20:,.1f} MB"


def _params(n):
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


# ---------------------------------------------------------------------------------------
# plans


@dataclass
class Host:
    memory_bytes: int | None
    budget: Budget
    layers: tuple  # (start, end), end exclusive
    weights_bytes: int
    kv_bytes_per_token: dict  # key -> number | None
    state_bytes: dict
    max_context: dict  # key -> int | None (0: weights alone do not fit)


@dataclass
class Split:
    mode: str  # "pipeline" | "tensor"
    hosts: list
    group_context: dict  # key -> min over hosts
    possible: bool = True
    reason: str = ""
    notes: list = field(default_factory=list)


def proportional_layers(n_layers: int, budgets: list[int]) -> list[tuple[int, int]]:
    """Contiguous ranges, counts in proportion to `budgets` (largest remainder), >= 1 each."""
    if n_layers < len(budgets):
        raise MacserveError(
            f"{len(budgets)} hosts for {n_layers} layers: at most one host per layer"
        )
    total = sum(budgets)
    exact = [n_layers * b / total for b in budgets]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(budgets)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(counts) < n_layers:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > n_layers:  # only when max(1, ...) lifted a tiny share
        j = max(range(len(counts)), key=lambda k: counts[k] - exact[k])
        counts[j] -= 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def _host(rep, shape, budget, mem, rng, weights_bytes, keys, parallel) -> Host:
    per, state, ctx = {}, {}, {}
    for k in keys:
        lay = layout(shape, k)
        per[k] = as_number(lay.per_token) if lay.supported else None
        state[k] = lay.state if lay.supported else None
        ctx[k] = (
            _max_context(shape, k, budget.budget_bytes, weights_bytes, parallel, lay)
            if lay.supported
            else None
        )
    return Host(mem, budget, rng, round(weights_bytes), per, state, ctx)


def _group(hosts, keys):
    return {
        k: (
            None
            if any(h.max_context[k] is None for h in hosts)
            else min(h.max_context[k] for h in hosts)
        )
        for k in keys
    }


def runtime_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Layer range of each host (HOSTS order = rank order) for per-host layer counts, in
    mlx-lm's pipeline order: rank 0 runs the last layers, the last rank the first ones."""
    n, out = sum(counts), []
    for r, c in enumerate(counts):
        a = sum(counts[r + 1 :])
        out.append((a, a + c))
    assert out[0][1] == n
    return out


def pipeline(rep, memory: list, w: Weights, parallel: int = 1) -> Split:
    budgets = [machine_budget(m) for m in memory]
    counts = [
        z - a
        for a, z in proportional_layers(len(rep.shape.layers), [b.budget_bytes for b in budgets])
    ]
    ranges = runtime_ranges(counts)
    keys = list(rep.layouts)
    hosts = []
    for b, m, (a, z) in zip(budgets, memory, ranges):
        sub = dataclasses.replace(rep.shape, layers=rep.shape.layers[a:z])
        wb = w.outer + sum(s + k for s, k in w.layers[a:z])
        hosts.append(_host(rep, sub, b, m, (a, z), wb, keys, parallel))
    notes = [
        "every host also holds the embeddings and head, as mlx-lm's pipeline does",
        "layers in mlx-lm's order: the first host (rank 0) runs the last layers",
    ]
    if len({b.budget_bytes for b in budgets}) > 1:
        notes.append(
            "mlx-lm splits layers evenly unless told: set SPLIT="
            + ",".join(map(str, counts))
            + " in the profile for this split"
        )
    return Split("pipeline", hosts, _group(hosts, keys), notes=notes)


def _tp_shape(shape, n: int):
    def one(l):
        if isinstance(l, (Full, Sliding)) and l.kv_heads % n == 0:
            return dataclasses.replace(l, kv_heads=l.kv_heads // n)
        return l

    return dataclasses.replace(shape, layers=[one(l) for l in shape.layers])


def tensor(rep, memory: list, w: Weights, parallel: int = 1) -> Split:
    n = len(memory)
    budgets = [machine_budget(m) for m in memory]
    keys = list(rep.layouts)
    p = params_from_config(rep.source.config, len(rep.shape.layers)) if rep.source.config else None
    notes = []
    if any(isinstance(l, MLA) for l in rep.shape.layers):
        notes.append(
            "MLA: the latent cache is not split across heads; every host caches the "
            "whole latent of every layer"
        )
    full = [l for l in rep.shape.layers if isinstance(l, (Full, Sliding))]
    if full:
        if all(l.kv_heads % n == 0 for l in full):
            notes.append(f"GQA: KV heads split {n} ways")
        else:
            notes.append(f"GQA: KV heads not divisible by {n}: every host keeps them all")
    if any(l.kind == "linear" for l in rep.shape.layers):
        notes.append("linear-attention states counted whole on every host (conservative)")
    bad = {k: v for k, v in (p.split_dims if p else {}).items() if k != "KV heads" and v % n}
    shape = _tp_shape(rep.shape, n)
    wb = w.outer + sum(s / n + k for s, k in w.layers)
    hosts = [
        _host(rep, shape, b, m, (0, len(shape.layers)), wb, keys, parallel)
        for b, m in zip(budgets, memory)
    ]
    if p is None:
        notes.append("no parameter count for this layout: weights divided by N, nothing kept whole")
    s = Split("tensor", hosts, _group(hosts, keys), notes=notes)
    if bad:
        s.possible = False
        s.reason = (
            "not divisible by " + str(n) + ": " + ", ".join(f"{k} {v:,}" for k, v in bad.items())
        )
    if len({b.budget_bytes for b in budgets}) > 1:
        s.notes.append(
            "tensor parallelism gives every host the same share: the smallest host bounds the group"
        )
    return s


def target_context(rep, ctx: int | None) -> int:
    """The context "enough" is judged by: --ctx, else 32K (or the model's limit if lower)."""
    limit = rep.shape.max_position_embeddings
    return ctx or (min(limit, 32768) if limit else 32768)


def plan_hosts(rep, memory: list, weights=None, parallel: int = 1, ctx: int | None = None) -> dict:
    """The whole plan as a plain dict (what `inspect --json` prints under `multi_host`)."""
    w = weights_split(rep, weights)
    total = w.total
    keys = list(rep.layouts)
    main_key = next((k for k in keys if rep.layouts[k].supported), None)
    biggest = max(memory, key=lambda m: machine_budget(m).budget_bytes)
    one = machine_budget(biggest)
    one_ctx = {
        k: (
            _max_context(rep.shape, k, one.budget_bytes, total, parallel, lay)
            if lay.supported
            else None
        )
        for k, lay in rep.layouts.items()
    }
    target = target_context(rep, ctx)
    enough = main_key is not None and (one_ctx[main_key] or 0) >= target
    splits = [pipeline(rep, memory, w, parallel)]
    if len(memory) > 1:
        splits.append(tensor(rep, memory, w, parallel))
    return {
        "hosts": len(memory),
        "memory_bytes": memory,
        "weights_bytes": total,
        "weights_how": w.how,
        "params": w.params,
        "parallel": parallel,
        "target_context": target,
        "main_cache": main_key,
        "one_host": {"budget_bytes": one.budget_bytes, "max_context": one_ctx, "enough": enough},
        "splits": [_as_dict(s) for s in splits],
    }


def _as_dict(s: Split) -> dict:
    return {
        "mode": s.mode,
        "possible": s.possible,
        "reason": s.reason,
        "notes": s.notes,
        "group_context": s.group_context,
        "hosts": [
            {
                "memory_bytes": h.memory_bytes,
                "budget_bytes": h.budget.budget_bytes,
                "budget_source": h.budget.source,
                "layers": list(h.layers),
                "weights_bytes": h.weights_bytes,
                "kv_bytes_per_token": h.kv_bytes_per_token,
                "state_bytes_per_sequence": h.state_bytes,
                "max_context": h.max_context,
            }
            for h in s.hosts
        ],
    }
