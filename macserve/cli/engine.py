"""The engine's own commands, `calibrate` and `generate` (docs/engine.md), and what they share
with the `bench` commands (cli/bench.py, cli/bench_engine.py): a progress bar, an MLA model
loaded, and text from the demo model's corpus.

Where no --data is given, the text comes from the demo model's corpus (dev/tiny/data.py): its
training plays to calibrate on, its held-out plays to measure on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..cache_kinds import KIND_NAMES
from ..errors import MacserveError
from .lazy import lazy

caches = lazy("macserve.engine.caches")
calibration = lazy("macserve.engine.calibration")
chat = lazy("macserve.chat")
engine_model = lazy("macserve.engine.model")
gate = lazy("macserve.engine.gate")
int2_format = lazy("macserve.int2_format")
gen = lazy("macserve.engine.generate")
mla_attention = lazy("macserve.engine.mla_attention")
mtp_auto = lazy("macserve.engine.mtp_auto")
np = lazy("numpy")
tiny_data = lazy("macserve.dev.tiny.data")

# engine/gate.py's (it imports mlx); tests/test_cli_help.py checks that they agree
DEFAULT_TARGET = 0.02


def progress_bar(label):
    bar = {}

    def update(done, total):
        if "bar" not in bar:
            bar["bar"] = click.progressbar(length=total, label=label, file=sys.stderr)
            bar["bar"].__enter__()
        bar["bar"].update(done - bar.get("done", 0))
        bar["done"] = done
        if done == total:
            bar["bar"].__exit__(None, None, None)

    return update


def load_mla(model_dir):
    """The model at `model_dir` (an engine Bundle), refused unless its attention is MLA."""
    return engine_model.load(model_dir).require_mla()


def text_windows(tok, data, n, seq_len, held_out):
    if data is not None:
        text = Path(data).read_text(encoding="utf-8", errors="replace")
    elif held_out:
        text = tiny_data.held_out_text()
    else:
        text = tiny_data.training_text(max(2, n))
    try:
        return calibration.calibration_windows(tok, text, n, seq_len)
    except ValueError as e:
        raise MacserveError(str(e)) from None


def held_out_prompts(tok, n, prompt_tokens):
    """Prompts cut from the demo model's held-out plays (never trained on)."""
    _, held = tiny_data.split(tiny_data.load_plays())
    text = "".join(p.text for p in held)
    ids = tok.encode(text, add_special_tokens=False)
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // max(1, n))
    return [ids[s : s + prompt_tokens] for s in range(0, stride * n, stride)][:n]


def held_out_chats(tok, data, n, prompt_tokens):
    """Chat prompts: consecutive blocks of the text (--data, else the demo model's held-out
    plays: its speeches) as alternating user and assistant messages in the model's chat
    template, ending where the assistant's turn opens; the last `prompt_tokens` tokens of each
    (the first turn cut short), from `n` places spread over the text."""
    if data is not None:
        text = Path(data).read_text(encoding="utf-8", errors="replace")
    else:
        _, held = tiny_data.split(tiny_data.load_plays())
        text = "\n\n".join(p.text for p in held)
    blocks = tiny_data.speeches(text)
    stride = len(blocks) // max(1, n)
    out = []
    for i in range(0, stride * n, stride or 1):
        msgs, ids = [], []
        for j, b in enumerate(blocks[i:]):
            msgs.append({"role": "assistant" if j % 2 else "user", "content": b})
            if j % 2 == 0:  # a user turn last: the assistant answers it
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                if len(ids) >= prompt_tokens:
                    break
        if len(ids) < prompt_tokens:
            raise MacserveError(f"the text is too short for {n} prompts of {prompt_tokens} tokens")
        out.append(list(ids[-prompt_tokens:]))
    return out


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out", type=click.Path(dir_okay=False), required=True, help="safetensors file to write"
)
@click.option(
    "--data",
    type=click.Path(exists=True, dir_okay=False),
    help="calibration text (default: the demo model's training plays)",
)
@click.option("--windows", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option(
    "--target",
    type=float,
    default=DEFAULT_TARGET,
    show_default=True,
    help="the gate's functional-error target per layer (docs/int2-latent-cache.md)",
)
@click.option("--report", is_flag=True, help="print per layer the gate's measurements")
@click.option("--json", "as_json", is_flag=True, help="print the gate's report as JSON")
def calibrate(model, out, data, windows, seq_len, target, report, as_json):
    """Fit per-layer latent rotations and clip thresholds (all methods) for the INT2 cache."""
    b = load_mla(model)
    ws = text_windows(b.tokenizer, data, windows, seq_len, held_out=False)
    stats = calibration.collect(b.model, ws, progress=progress_bar("calibrating"))
    cal = calibration.fit(
        stats, int2_format.INT2, meta={"model": str(model), "data": data or "tiny training plays"}
    )
    rope = mla_attention.mla_attentions(b.model)[0].qk_rope_head_dim
    gate.attach(cal, gate.gate(stats, rope, target), target)
    cal.save(out)
    rep = cal.meta["gate"]
    if as_json:
        click.echo(json.dumps(dict(rep, out=str(out), calibration_tokens=stats[0].tokens)))
        return
    if report:
        for line in gate_report_lines(rep):
            click.echo(line)
    else:
        for i, st in enumerate(stats):
            ev = np.linalg.eigvalsh(st.sigma_c)
            click.echo(f"layer {i}: latent eigenvalues {ev[-1]:.3g} .. {max(ev[0], 0):.3g}")
    plan = ", ".join(f"{n} {f}" for f, n in rep["plan"].items())
    click.echo(f"gate (target {target:g}): {len(stats)} MLA layers: {plan}")
    click.echo(f"wrote {out} ({stats[0].tokens:,} tokens, methods {', '.join(cal.rotations)})")


def gate_report_lines(rep: dict) -> list[str]:
    """Per layer: spectrum shares, the error of every format x rotation, the choice."""
    lines = [f"functional error = {rep['definition']}; target {rep['target']:g}"]
    for row in rep["layers"]:
        sp = row["spectrum"]
        lines.append(
            f"layer {row['layer']}: spectrum top1 {sp['top1']:.3f} top10 {sp['top10']:.3f} "
            f"top64 {sp['top64']:.3f} -> {row['choice']} {row['rotation']}, "
            f"{row['bytes_per_token']} B/token"
        )
        rots = list(dict.fromkeys(m for errs in row["errors"].values() for m in errs))
        lines.append("  " + f"{'format':<10}" + "".join(f"{m:>17}" for m in rots))
        for f, errs in row["errors"].items():
            cells = "".join(f"{errs[m]:>17.4f}" if m in errs else f"{'':>17}" for m in rots)
            lines.append("  " + f"{f:<10}" + cells)
    lines.append(f"bytes per token, all MLA layers: {rep['bytes_per_token']:,}")
    return lines


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option(
    "--kv",
    type=click.Choice(KIND_NAMES),
    default="bf16",
    show_default=True,
    help="bf16, int2 (the INT2 latent cache) or auto (no share to size here: every row bf16).",
)
@click.option("--rotation", type=click.Path(exists=True, dir_okay=False))
@click.option("--mtp", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
@click.option("--mtp-k", type=click.IntRange(0, 3), default=1, show_default=True)
def generate(model, prompt, max_tokens, temperature, kv, rotation, mtp, mtp_k):
    """Generate from a raw prompt with the engine (INT2 latent cache, MTP drafting)."""
    options = caches.EngineOptions(caches.CacheSpec.for_model(model, kv, rotation), mtp_k, mtp)
    bundle = engine_model.load(model)
    note = mtp_auto.load_note(bundle, options)
    if note is not None:
        click.echo(note, err=True)
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False)
    last = None
    for step in gen.stream(bundle, ids, max_tokens, temperature=temperature, options=options):
        click.echo(step.text, nl=False)
        last = step
    click.echo()
    if last is not None:
        s = last.stats
        extra = (
            f", drafts accepted {s['accepted_tokens']}/{s['draft_tokens']}"
            if s["draft_tokens"]
            else ""
        )
        click.echo(
            f"{s['completion_tokens']} tokens, {s['generation_tps']:.1f} tok/s{extra}, "
            + chat.mtp_text(s["mtp"]),
            err=True,
        )
