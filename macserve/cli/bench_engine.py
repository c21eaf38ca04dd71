"""`bench engine`: the INT2 cache against mlx-lm's bf16 cache at real width, on a model folder
or a synthetic model with random weights (docs/int2-latent-cache.md), and its printed report.
"""

from __future__ import annotations

import json

import click

from .. import env
from ..errors import MacserveError
from .engine import held_out_prompts
from .lazy import lazy

engine_bench = lazy("macserve.engine.bench.engine")
bench_setup = lazy("macserve.engine.bench.setup")
engine_model = lazy("macserve.engine.model")
prefill_scratch = lazy("macserve.engine.bench.prefill_scratch")
budget = lazy("macserve.sizing.budget")
mtp_bench = lazy("macserve.engine.bench.mtp")


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter("comma-separated token counts", param_hint=what) from None


@click.command("engine")
@click.argument("model", required=False, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--synthetic",
    type=click.Choice(["deepseek-v3", "deepseek-v3.2"]),
    help="a real-width model with random weights, made now (no MODEL needed)",
)
@click.option(
    "--layers",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="trunk layers of the synthetic model",
)
@click.option("--prefill-contexts", default="8192,32768", show_default=True)
@click.option("--held-contexts", default="1024,4096,32768", show_default=True)
@click.option("--decode-contexts", default="4096,32768", show_default=True)
@click.option(
    "--projection-contexts",
    default="8192,32768,131072",
    show_default=True,
    help="contexts of the Mac projection from bytes moved",
)
@click.option(
    "--mac-bandwidth",
    type=click.FloatRange(min=1, min_open=False),
    default=819,
    show_default=True,
    help="GB/s of the Mac the projection is for (M3 Ultra: 819)",
)
@click.option(
    "--mac-tflops",
    type=click.FloatRange(min=0.1),
    default=28,
    show_default=True,
    help="TFLOP/s assumed for its GPU's matrix products (the projection's roofline)",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(2),
    default=2048,
    show_default=True,
    help="the chunk compared against single steps",
)
@click.option(
    "--bf16-chunk-tokens",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="also compare a chunk of this many tokens with single steps with the model in bf16 "
    "(only where the engine computes in float32, a CPU; slow there)",
)
@click.option(
    "--acceptance",
    type=click.FloatRange(0, 1),
    help="MTP acceptance for the projection [default: measured on the demo model]",
)
@click.option(
    "--scratch",
    is_flag=True,
    help="only this: one prefill chunk's scratch by MLX's allocator at each --scratch-contexts "
    "position, the chunk picked for a `serve --memory` share's reserve, per cache",
)
@click.option("--scratch-contexts", default="32768,131072", show_default=True)
@click.option(
    "--scratch-reserve",
    default="2GB",
    show_default=True,
    help="the share's reserve (10% of --memory); a chunk's scratch gets half of it",
)
@click.option(
    "--decode-only",
    is_flag=True,
    help="only decode tok/s at --decode-contexts: INT2 (and read as before issue 45), the "
    "bf16-latent cache and mlx-lm's, interleaved rounds",
)
@click.option("--json", "as_json", is_flag=True)
def bench_engine(
    model,
    synthetic,
    layers,
    prefill_contexts,
    held_contexts,
    decode_contexts,
    projection_contexts,
    mac_bandwidth,
    mac_tflops,
    chunk_tokens,
    bf16_chunk_tokens,
    acceptance,
    scratch,
    scratch_contexts,
    scratch_reserve,
    decode_only,
    as_json,
):
    """The INT2 cache against mlx-lm's bf16 cache at real width: conversions, prefill memory,
    held bytes, chunk vs steps, decode speed, MTP costs (docs/int2-latent-cache.md)."""
    if (model is None) == (synthetic is None):
        raise MacserveError("give a MODEL folder or --synthetic deepseek-v3")
    contexts = {
        "prefill": _ints(prefill_contexts, "--prefill-contexts"),
        "held": _ints(held_contexts, "--held-contexts"),
        "decode": _ints(decode_contexts, "--decode-contexts"),
        "projection": _ints(projection_contexts, "--projection-contexts"),
    }
    if scratch:
        _scratch(model, synthetic, layers, scratch_contexts, scratch_reserve, as_json)
        return
    if acceptance is None and not decode_only:
        acceptance = _demo_acceptance()
    setup = _setup(model, synthetic, layers)
    res = engine_bench.run(
        setup,
        contexts,
        acceptance,
        chunk_tokens,
        progress=lambda m: click.echo(f"... {m}", err=True),
        bf16_chunk_tokens=bf16_chunk_tokens,
        mac={"bandwidth": mac_bandwidth * 1e9, "flops": mac_tflops * 1e12},
        decode_only=decode_only,
    )
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    if decode_only:
        click.echo(f"{res['model']}, computing in {res['dtype']}")
        _print_decode(res)
        return
    _print_engine(res)


def _setup(model, synthetic, layers):
    if synthetic:
        return bench_setup.setup_synthetic(synthetic, layers)
    return bench_setup.setup_folder(model)


def _scratch(model, synthetic, layers, contexts, reserve, as_json) -> None:
    setup = _setup(model, synthetic, layers)
    bench_setup.to_dtype(setup, bench_setup.engine_dtype())
    res = prefill_scratch.run(
        setup,
        _ints(contexts, "--scratch-contexts"),
        budget.parse_size(reserve),
        progress=lambda m: click.echo(f"... {m}", err=True),
    )
    res["model"] = setup.name
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    click.echo(
        f"{res['model']}: one prefill chunk's scratch (MLX's peak over the chunk less what was "
        f"held before it) against a reserve of {_gb(res['reserve_bytes'])}, half of it the "
        f"chunk's budget ({_gb(res['budget_bytes'])})"
    )
    click.echo(
        f"{'context':>8} {'chunk':>6} {'bf16 peak':>10} {'int2 peak':>10} {'modelled':>10} "
        f"{'budget':>9}  mlx-lm's own 2,048 chunk (not run, lower bound)"
    )
    for n, row in res["contexts"].items():
        ok = max(row["bf16"], row["int2"]) <= res["budget_bytes"]
        click.echo(
            f"{int(n):>8,} {row['chunk']:>6,} {_gb(row['bf16']):>10} {_gb(row['int2']):>10} "
            f"{_gb(row['modelled_bytes']):>10} {_gb(res['budget_bytes']):>9}  "
            f">{_gb(row['unbounded_lower_bound'])}{'' if ok else '  OVER BUDGET'}"
        )


def _gb(b):
    return "n/a" if b is None else f"{b / 2**30:.2f} GB"


def _print_engine(r: dict) -> None:
    click.echo(f"{r['model']}, computing in {r['dtype']}")
    up = r["upcasts"]
    click.echo(
        f"conversions a bf16 decode step's attention adds reading its cache: "
        f"int2 {up['attention_read']['int2']}, bf16 {up['attention_read']['bf16']} "
        f"(whole step: {up['whole_step']['int2']} / {up['whole_step']['bf16']}; "
        f"logits {up['logits_dtype']['int2']})"
    )
    click.echo(
        f"{'context':>8} {'int2 peak':>10} {'bf16 peak':>10} {'int2 transient':>15} "
        f"{'bf16 transient':>15}  (last 2,048-token prefill chunk)"
    )
    for n, peak in r["prefill_peak_bytes"].items():
        tr = r["prefill_transient_bytes"][n]
        bf = (
            _gb(peak["bf16"])
            if peak["bf16"] is not None
            else f">{_gb(r['bf16_prefill_transient_lower_bound'][n])}*"
        )
        click.echo(
            f"{int(n):>8,} {_gb(peak['int2']):>10} {bf:>10} {_gb(tr['int2']):>15} "
            f"{_gb(tr['bf16']):>15}"
        )
    click.echo(
        "bf16: mlx-lm's cache, read in blocks of keys by the engine (mlx-lm's own attention "
        "materializes at least bf16_prefill_transient_lower_bound)"
    )
    held, nb = r["held_bytes_per_token_per_layer"], r["nbytes_per_token_per_layer"]
    click.echo(
        "bytes per token per layer held by the allocator (nbytes): "
        + ", ".join(
            f"{int(n):,}: " + " / ".join(f"{w} {v[w]:.0f} ({nb[n][w]:.0f})" for w in v)
            for n, v in held.items()
        )
        + f"; rotation {r['rotation_bytes_per_layer']:,} B per layer, apart"
    )
    cs = r["chunk_vs_steps_max_logit_diff"]
    click.echo(
        f"chunk vs single steps, max |log-prob diff|: int2 {cs['int2']:.3g}, "
        f"bf16 {cs['bf16']:.3g}, bf16-stored latent {cs['bf16_latent']:.3g}"
    )
    if "chunk_vs_steps_bf16_model" in r:
        cb = r["chunk_vs_steps_bf16_model"]
        click.echo(
            f"the same, model in bf16: int2 {cb['int2']:.3g}, bf16 {cb['bf16']:.3g}, "
            f"bf16-stored latent {cb['bf16_latent']:.3g}"
        )
    _print_decode(r)
    ap = r["attention_parts"]
    click.echo(
        f"one layer's attention read at {ap['context']:,}, ms: "
        + ", ".join(f"{k} {v:.1f}" for k, v in ap["ms"].items())
        + f" (sdpa / folded {ap['sdpa_vs_folded']:.1f}x, int2 / bf16-latent "
        f"{ap['int2_vs_bf16_latent']:.2f}x, unpack {ap['unpack_share_of_int2']:.0%} of int2)"
    )
    p = r["mac_projection"]
    a = p["assumptions"]
    click.echo(
        f"PROJECTION, not measured: {a['model']}, {a['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"{a['gpu_flops_per_s'] / 1e12:.0f} TFLOP/s assumed; weights "
        f"{a['weight_bytes_per_token'] / 1e9:.1f} GB per token"
    )
    click.echo(
        f"{'context':>8} {'attn MB/layer int2 / mlx-lm':>28} {'memory-bound tok/s':>22} "
        f"{'ratio':>6} {'roofline tok/s':>16} {'ratio':>6}  attention bound by"
    )
    for n, row in p["contexts"].items():
        i, b = row["int2"], row["bf16"]
        click.echo(
            f"{int(n):>8,} {i['bytes_per_product'] / 1e6:>13.1f} / {b['bytes_per_product'] / 1e6:<12.1f} "
            f"{i['tok_s_memory_bound']:>9.1f} / {b['tok_s_memory_bound']:<10.1f} "
            f"{row['int2_vs_mlx_lm_memory_bound']:>5.2f}x "
            f"{i['tok_s_roofline']:>7.1f} / {b['tok_s_roofline']:<6.1f} "
            f"{row['int2_vs_mlx_lm_roofline']:>5.2f}x  {i['attention_bound']} / {b['attention_bound']}"
        )
    m = r["mtp"]
    if "verify_cost_ratio" in m:
        click.echo(
            f"MTP: verify 2 tokens / 1 = {m['verify_cost_ratio']:.2f}, MTP layer / trunk "
            f"layer = {m['mtp_layer_cost_ratio']:.2f}, acceptance {m['acceptance']}, "
            f"projected k=1 speedup for {m['trunk_layers']} layers: "
            f"{m.get('projected_speedup_k1', float('nan')):.2f}x"
        )


def _print_decode(r: dict) -> None:
    click.echo(
        "decode tok/s (this CPU, medians of interleaved rounds): "
        + ", ".join(
            f"{int(n):,}: int2 {v['int2']:.2f} (read as before: {v['int2_previous']:.2f}) / "
            f"bf16-latent {v['bf16_latent']:.2f} / mlx-lm {v['bf16']:.2f} (int2 vs "
            f"bf16-latent {v['int2_vs_bf16_latent']:.2f}x, before "
            f"{v['int2_previous_vs_bf16_latent']:.2f}x; vs mlx-lm {v['int2_vs_mlx_lm']:.2f}x)"
            for n, v in r["decode_tok_s"].items()
        )
    )
    click.echo(
        "by a step's CPU time (20th percentile): "
        + ", ".join(
            f"{int(n):,}: int2 vs bf16-latent {v['cpu_int2_vs_bf16_latent']:.2f}x, before "
            f"{v['cpu_int2_previous_vs_bf16_latent']:.2f}x"
            for n, v in r["decode_tok_s"].items()
        )
    )
    cut = {n: v for n, v in r["decode_tok_s"].items() if "pieces_vs_whole" in v}
    if not cut:
        return
    click.echo(
        "segments read in pieces vs whole (wall; by CPU time): "
        + ", ".join(
            f"{int(n):,}: int2 {v['pieces_vs_whole']['int2']:.2f}x; "
            f"{v['cpu_pieces_vs_whole']['int2']:.2f}x, bf16-latent "
            f"{v['pieces_vs_whole']['bf16_latent']:.2f}x; "
            f"{v['cpu_pieces_vs_whole']['bf16_latent']:.2f}x (int2 vs bf16-latent both whole, "
            f"CPU time: {v['cpu_int2_vs_bf16_latent_whole']:.2f}x)"
            for n, v in cut.items()
        )
    )


def _demo_acceptance() -> float:
    """MTP k=1 acceptance on the demo model's held-out text (greedy, 8 prompts)."""
    bundle = engine_model.load(env.DEMO_MODEL)
    ps = held_out_prompts(bundle.tokenizer, 8, 64)
    row = mtp_bench.run(bundle.model, bundle.mtp(), ps, 1, 64, lambda: bundle.caches())
    return row["acceptance_per_position"][0]
