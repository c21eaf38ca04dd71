"""The engine's benchmarks `bench kv|mtp|dsa` (docs/engine.md); `bench engine` is
cli/bench_engine.py, `bench serve` cli/bench_serve.py. Each prints ratios against a baseline measured in the same run.

Where no --data is given, the text comes from the demo model's corpus (dev/tiny/data.py): its
training plays to calibrate on, its held-out plays to measure on.
"""

from __future__ import annotations

import json

import click

from ..cache_kinds import AUTO_QUANT, KIND_NAMES
from ..errors import MacserveError
from .engine import held_out_chats, held_out_prompts, load_mla, progress_bar, text_windows
from .lazy import lazy

caches = lazy("macserve.engine.caches")
calibration = lazy("macserve.engine.calibration")
dsa_bench = lazy("macserve.engine.bench.dsa")
engine_model = lazy("macserve.engine.model")
gate = lazy("macserve.engine.gate")
int2_format = lazy("macserve.int2_format")
gen_bench = lazy("macserve.engine.bench.generation")
kv_bench = lazy("macserve.engine.bench.kv")
e2e_bench = lazy("macserve.engine.bench.decode_e2e")
mla_attention = lazy("macserve.engine.mla_attention")
mtp_auto = lazy("macserve.engine.mtp_auto")
mtp_bench = lazy("macserve.engine.bench.mtp")

KV_SETS = ("all", "gate", "windows")  # engine/bench/kv.py's SETS, not imported: it loads mlx


@click.command("kv")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--rotation",
    type=click.Path(exists=True, dir_okay=False),
    help="calibration file (default: the model folder's latent-rotation.safetensors, "
    "else calibrate now on the training plays)",
)
@click.option(
    "--data",
    type=click.Path(exists=True, dir_okay=False),
    help="held-out text (default: the demo model's held-out plays)",
)
@click.option("--windows", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--gen-tokens", type=int, default=256, show_default=True)
@click.option("--contexts", default="1024,4096,16384", show_default=True)
@click.option(
    "--variants",
    "which",
    type=click.Choice(KV_SETS),
    default="all",
    show_default=True,
    help="all: every rotation and option; gate: uniform INT2 and INT4 against the "
    "calibration's per-layer plan; windows: the served cache at sink 64/128 x recent 256/512 "
    "and with no codes (a control)",
)
@click.option(
    "--gen-prompts",
    type=click.IntRange(0),
    default=4,
    show_default=True,
    help="held-out chat prompts each cache generates from freely (greedy, until end of turn "
    "or --gen-max-tokens), set against bf16's generation; 0 skips",
)
@click.option("--gen-prompt-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--gen-max-tokens", type=click.IntRange(1), default=700, show_default=True)
@click.option(
    "--e2e-prompt-tokens",
    type=click.IntRange(1),
    default=700,
    show_default=True,
    help="end-to-end decode: the held-out prompt's length (past sink 64 + recent 512, so "
    "the INT2 cache decodes over codes)",
)
@click.option("--e2e-tokens", type=click.IntRange(2), default=128, show_default=True)
@click.option("--e2e-rounds", type=click.IntRange(1), default=5, show_default=True)
@click.option(
    "--e2e",
    is_flag=True,
    help="only this: end-to-end decode tok/s of mlx-lm's bf16 cache, the bf16 latent cache "
    "and INT2 after a held-out prompt, interleaved rounds (no quality rows)",
)
@click.option("--json", "as_json", is_flag=True)
def bench_kv(
    model,
    rotation,
    data,
    windows,
    seq_len,
    gen_tokens,
    contexts,
    which,
    gen_prompts,
    gen_prompt_tokens,
    gen_max_tokens,
    e2e_prompt_tokens,
    e2e_tokens,
    e2e_rounds,
    e2e,
    as_json,
):
    """Quality and decode speed of every latent-cache variant vs the bf16 latent cache, and
    end-to-end decode tokens/s of mlx-lm's bf16 cache, the bf16 latent cache and INT2."""
    b = load_mla(model)
    m, tok = b.model, b.tokenizer
    rotation = rotation or caches.shipped_rotation(model)
    if rotation is not None:
        cal = b.calibration(rotation)
        if which == "gate" and cal.default_method != "gate":
            raise MacserveError(
                f"{rotation}: no gate plan in this calibration (make one with macserve calibrate)"
            )
    else:  # no calibration given or shipped: fit one now on the training plays
        stats = calibration.collect(
            m,
            text_windows(tok, None, 8, seq_len, held_out=False),
            progress=progress_bar("calibrating"),
        )
        cal = calibration.fit(stats, int2_format.INT2)
        if which == "gate":
            rope = mla_attention.mla_attentions(m)[0].qk_rope_head_dim
            gate.attach(cal, gate.gate(stats, rope), gate.DEFAULT_TARGET)
    if e2e:
        res = _end_to_end(b, cal, e2e_prompt_tokens, e2e_tokens, e2e_rounds)
        if as_json:
            click.echo(json.dumps(res, indent=1))
        else:
            _print_e2e(res)
        return
    ws = text_windows(tok, data, windows, seq_len + 1, held_out=data is None)
    try:
        ctxs = [int(c) for c in contexts.split(",")]
    except ValueError:
        raise MacserveError(f"--contexts: comma-separated integers, not {contexts!r}") from None
    prompts = held_out_chats(tok, data, gen_prompts, gen_prompt_tokens) if gen_prompts else []
    try:
        table = kv_bench.rows(
            m,
            cal,
            ws,
            contexts=ctxs,
            gen_tokens=gen_tokens,
            progress=progress_bar("evaluating"),
            gen_progress=progress_bar("generating"),
            which=which,
            gen_prompts=prompts,
            gen_max_tokens=gen_max_tokens,
            eos=b.eos_ids,
        )
    except gen_bench.TooLong as e:
        raise MacserveError(f"--gen-prompt-tokens/--gen-max-tokens: {e}") from None
    if as_json:
        click.echo(json.dumps(table, indent=1))
        return
    longest = max(ctxs)
    at = f"{longest // 1024}K" if longest % 1024 == 0 else str(longest)
    click.echo(
        f"{'variant':<36} {'B/tok/layer':>11} {'dPPL%':>7} {'KL':>8} {'top1':>6} "
        f"{'greedy':>6} {'err max':>8} {'speed@' + at:>9}"
    )
    for r in table:
        mark = " *" if r["default"] else ""
        ok = {True: " ok", False: " >", None: ""}[r["within_target"]]
        click.echo(
            f"{r['variant'] + mark:<36} {r['bytes_per_token_per_layer']:>11.1f} "
            f"{r['delta_ppl_pct']:>7.2f} {r['kl']:>8.4f} {r['top1_agreement']:>6.3f} "
            f"{r['greedy_agreement']:>6.3f} {r['max_layer_error']:>8.4f}{ok:<3} "
            f"{r['decode_speed_ratio']:>5.2f}x"
        )
    if "gen_length" in table[0]:
        click.echo(
            f"free generation, {table[0]['gen_prompts']} held-out chat prompts of "
            f"{gen_prompt_tokens} tokens, greedy, up to {gen_max_tokens} tokens:"
        )
        click.echo(
            f"  {'variant':<36} {'first diverge':>13} {'identical':>9} {'length':>7} {'EOT':>5}"
        )
        for r in (r for r in table if "gen_length" in r):
            click.echo(
                f"  {r['variant']:<36} {r['gen_first_divergence']:>13.0f} "
                f"{r['gen_identical']:>9.2f} {r['gen_length']:>7.1f} {r['gen_end_of_turn']:>5.2f}"
            )
        click.echo(
            "  first diverge: median first position differing from bf16's generation "
            "(an identical one counts as its length); EOT: share ended by end of turn"
        )
    if table[0]["target"] is not None:
        click.echo(
            f"err max: the worst layer's functional error on the held-out text, from the real "
            f"caches (engine/gate.py); ok / > : within / over the gate's target "
            f"{table[0]['target']:g}"
        )
    if which == "gate":
        for r in table[1:]:
            errs = ", ".join(f"{e:.4f}" for e in r["layer_errors"])
            click.echo(f"  {r['variant'].split(' (')[0]:<12} per layer: {errs}")
    bf = table[0]["decode_tokens_per_s"]
    click.echo(
        "bf16 latent decode tok/s: "
        + ", ".join(f"{c}: {bf[c]:.1f}" for c in ctxs)
        + "; * = default"
    )


def _end_to_end(b, cal, prompt_tokens: int, tokens: int, rounds: int) -> dict:
    """Decode tokens/s of a greedy generation after a held-out prompt, per cache, as
    `macserve generate` runs it (engine/bench/decode_e2e.py)."""
    m = b.model
    room = (b.max_context or prompt_tokens + tokens) - tokens
    if prompt_tokens > room:
        raise MacserveError(f"--e2e-prompt-tokens: at most {room} for this model's context")
    makers = {
        "bf16 (mlx-lm)": lambda: b.caches(),
        "bf16 latent": lambda: calibration.caches_for(m, int2_format.BF16_LATENT),
        "int2": lambda: calibration.caches_for(m, int2_format.INT2, cal, cal.default_method),
        # --kv auto where no share bounds it (generate, a serve with the room): the same
        # latent cache with every row in its bf16 window, the calibration's formats unused
        "auto, no share (all bf16)": lambda: calibration.caches_for(
            m, AUTO_QUANT, cal, cal.default_method
        ),
    }
    makers["int2, query-first read"] = makers["int2"]
    makers["int2, previous read"] = makers["int2"]
    prompt = held_out_prompts(b.tokenizer, 1, prompt_tokens)[0]
    modes = {
        "int2, query-first read": e2e_bench.query_first,
        "int2, previous read": e2e_bench.previous_read,
    }
    res = e2e_bench.run(m, makers, prompt, tokens, rounds, modes)
    return {"prompt_tokens": len(prompt), "tokens": tokens, "rounds": rounds, "caches": res}


def _print_e2e(e2e: dict) -> None:
    click.echo(
        f"end to end: decode tok/s of {e2e['tokens']} greedy tokens after a "
        f"{e2e['prompt_tokens']}-token held-out prompt, median of {e2e['rounds']} interleaved "
        "rounds (ratio: median of each round's ratio to mlx-lm's bf16 cache); by CPU time: "
        "a step's, 20th percentile of all rounds' steps (steadier on a shared machine)"
    )
    for name, r in e2e["caches"].items():
        codes = "" if r["code_rows"] is None else f"  code rows {r['code_rows']}"
        click.echo(
            f"  {name:<26} {r['tok_s']:>7.1f} tok/s {r['ratio']:>5.2f}x   by CPU time "
            f"{r['cpu_tok_s']:>7.1f} tok/s {r['cpu_ratio']:>5.2f}x{codes}"
        )
    click.echo(
        "  int2, query-first read: the same cache's decode step scoring q @ rows^T on freshly "
        "reshaped codes (before the rows-first products); int2, previous read: as before "
        "issue 45 (segments merged by online softmax, codes dequantized by unfused ops, a "
        "quantization every step); both in the same rounds"
    )


@click.command("dsa")
@click.option(
    "--contexts",
    default="4096,16384",
    show_default=True,
    help="cached tokens before the timed decode steps",
)
@click.option("--json", "as_json", is_flag=True)
def bench_dsa(contexts, as_json):
    """DSA decode on the INT2 cache: top-k rows only vs every row masked (a random model with
    DeepSeek-V3.2's cache dims; speed does not depend on trained weights)."""
    try:
        ctxs = [int(c) for c in contexts.split(",")]
    except ValueError:
        raise click.BadParameter("comma-separated token counts", param_hint="--contexts") from None
    rows = dsa_bench.run(ctxs)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        click.echo(
            f"context {r['context']:,} (top-{r['index_topk']:,}): sparse "
            f"{r['tokens_per_s_sparse']:.1f} tok/s, masked {r['tokens_per_s_masked']:.1f} "
            f"tok/s, speedup {r['speedup']:.2f}x"
        )


@click.command("mtp")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-k",
    "ks",
    type=int,
    multiple=True,
    default=[1, 2, 3],
    show_default=True,
    help="draft lengths to measure",
)
@click.option("--prompts", type=int, default=8, show_default=True)
@click.option("--prompt-tokens", type=int, default=64, show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True, help="generated per prompt")
@click.option("--kv", type=click.Choice(KIND_NAMES), default="bf16", show_default=True)
@click.option("--rotation", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--llama-server",
    "llama_url",
    help="URL of a llama-server running the GGUF twin "
    "with --spec-type draft-mtp: its acceptance on the same prompts is reported",
)
@click.option("--json", "as_json", is_flag=True)
def bench_mtp(model, ks, prompts, prompt_tokens, tokens, kv, rotation, llama_url, as_json):
    """MTP drafting vs plain decoding: acceptance per position and decode tokens/s."""
    bundle = engine_model.load(model)
    spec = caches.CacheSpec.for_model(model, kv, rotation)
    mtp = bundle.mtp()
    ps = held_out_prompts(bundle.tokenizer, prompts, prompt_tokens)
    rows = []
    for k in ks:
        if not 1 <= k <= 3:
            raise MacserveError(f"-k must be 1..3, not {k}")
        rows.append(mtp_bench.run(bundle.model, mtp, ps, k, tokens, lambda: bundle.caches(spec)))
    if llama_url:
        texts = [bundle.tokenizer.decode(p) for p in ps]
        ref = mtp_bench.llama_server_acceptance(llama_url, texts, tokens)
        for r in rows:
            r["llama_server"] = ref
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        acc = ", ".join("n/a" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"])
        click.echo(
            f"k={r['k']}: acceptance per position [{acc}], plain {r['tokens_per_s_plain']:.1f} "
            f"tok/s, MTP {r['tokens_per_s_mtp']:.1f} tok/s, speedup {r['speedup']:.2f}x (median "
            f"per prompt), "
            f"greedy identical {r['greedy_identical_prompts']}/{r['prompts']}"
        )
        a = r["auto"]
        best = max(r["tokens_per_s_plain"], r["tokens_per_s_mtp"])
        click.echo(
            f"  --mtp auto: {a['tokens_per_s']:.1f} tok/s, {a['tokens_per_s'] / best:.2f}x the "
            f"faster of on and off over all prompts; medians per prompt: {a['speedup']:.2f}x "
            f"plain, {a['vs_best']:.2f}x the faster; drafted in {a['drafted_prompts']}/"
            f"{r['prompts']} prompts"
            + (
                f"; decided drafting {'on' if a['drafting'] else 'off'}, "
                + mtp_auto.describe(a["figures"])
                if a["figures"]
                else ""
            )
        )
    if llama_url:
        ref = rows[0]["llama_server"]
        click.echo(
            f"llama-server draft-mtp on the same prompts: {ref['draft_n_accepted']}/"
            f"{ref['draft_n']} accepted"
        )
