"""The INT2 latent cache judged on a converted real model (`macserve dev transmla-kv`).

The five caches issue 42 asks about, on one calibration (`macserve calibrate`'s file, with its
gate plan): the bf16 latent (the reference), INT2 on every layer (the file's one method),
INT4 on every layer, the gate's per-layer plan (what `--kv int2` serves), and INT2 without the
bf16 sink/recent windows. Per cache, from `bench kv`'s own measures (engine/bench/kv.py's
`quality`: teacher-forced through the cache in chunks, ΔPPL, KL and top-1 against the bf16
latent, and per layer the functional error of what the cache stored; generation.py's free
greedy generations from held-out chat prompts, first divergence from bf16's). `bench kv`'s
sets compare other things (every rotation, or the windows); this is the one row set the
real-latent table needs, in one run.
"""

from __future__ import annotations

from dataclasses import replace

from ..engine.bench import generation
from ..engine.bench.kv import GATED, NO_WINDOWS, Variant, quality
from ..engine.calibration import caches_for
from ..int2_format import BF16_LATENT, INT2


def variants(default_method: str) -> list[Variant]:
    m = default_method
    return [
        Variant(f"int2 {m} (every layer)", INT2, m),
        Variant(f"int4 {m} (every layer)", replace(INT2, bits=4), m),
        Variant(GATED, INT2, "gate", default=True),
        Variant(f"int2 {m} no windows", replace(INT2, **NO_WINDOWS), m),
    ]


def measure(bundle, cal, windows, prompts, max_tokens: int, progress=None) -> list[dict]:
    """One row per cache (bf16 latent first): ΔPPL %, KL, top-1, per-layer stored error,
    bytes per token and layer, and the free-generation columns."""
    m = bundle.model
    attn = m.model.layers[0].self_attn
    rank, rope = attn.kv_lora_rank, attn.qk_rope_head_dim
    vs = variants(cal.meta.get("default", "upproj"))
    # generated tokens after a 16-token prompt are not used here (the free generations below
    # are the measure); quality needs at least one
    q = quality(m, vs, windows, cal, gen_tokens=1, prompt_tokens=16, progress=progress)
    makers = {"bf16 latent": lambda: caches_for(m, BF16_LATENT)}
    for v in vs:
        makers[v.name] = lambda v=v: caches_for(m, v.quant, cal, v.method)
    gens = generation.run(m, makers, prompts, max_tokens, bundle.eos_ids) if prompts else {}
    rows = [
        dict(
            variant="bf16 latent",
            bytes_per_token_per_layer=BF16_LATENT.bytes_per_token(rank, rope),
            ppl=q["bf16"]["ppl"],
            delta_ppl_pct=0.0,
            kl=0.0,
            top1_agreement=1.0,
            layer_errors=[],
            **gens.get("bf16 latent", {}),
        )
    ]
    for v in vs:
        r = q[v.name]
        rows.append(
            dict(
                variant=v.name,
                default=v.default,
                bytes_per_token_per_layer=v.bytes_per_token_per_layer(rank, rope, cal),
                ppl=r["ppl"],
                delta_ppl_pct=r["delta_ppl_pct"],
                kl=r["kl"],
                top1_agreement=r["top1_agreement"],
                layer_errors=r["layer_errors"],
                **gens.get(v.name, {}),
            )
        )
    return rows


ROTATIONS = ("plain", "hadamard", "upproj", "eigen-hadamard")


def gate_rows(cal) -> list[dict]:
    """Per layer, from the calibration's gate report: the latent's spectrum (top-10 share),
    INT2 g64's functional error under each rotation, INT4 g64's and bf16's best, the choice."""
    out = []
    for row in cal.meta["gate"]["layers"]:
        e = row["errors"]
        int4 = min(e["int4-g64"].items(), key=lambda kv: kv[1])
        out.append(
            dict(
                layer=row["layer"],
                top10=row["spectrum"]["top10"],
                int2=[e["int2-g64"].get(r) for r in ROTATIONS],
                int4=int4[1],
                int4_rotation=int4[0],
                bf16=min(e["bf16"].values()),
                choice=f"{row['choice']} {row['rotation']}",
            )
        )
    return out
