"""The engine's commands: `calibrate`, `generate`, `bench kv|mtp|dsa|engine|serve`
(docs/engine.md, docs/server.md).

Where no --data is given, the text comes from the demo model's corpus (dev/tiny/data.py): its
training plays to calibrate on, its held-out plays to measure on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from .. import env
from ..dev.tiny import data as tiny_data
from ..engine import generate as gen
from ..engine.bench import dsa as dsa_bench
from ..engine.bench import engine as engine_bench
from ..engine.bench import kv as kv_bench
from ..engine.bench import mtp as mtp_bench
from ..engine.bench import serve as serve_bench
from ..engine.caches import CacheSpec, EngineOptions, shipped_rotation
from ..engine.calibration import calibration_windows, collect, fit
from ..engine.model import Bundle, load
from ..errors import MacserveError
from ..int2_format import INT2


def _progress(label):
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


def _load_mla(model_dir) -> Bundle:
    return load(model_dir).require_mla()


def _windows(tok, data, n, seq_len, held_out):
    if data is not None:
        text = Path(data).read_text(encoding="utf-8", errors="replace")
    elif held_out:
        text = tiny_data.held_out_text()
    else:
        text = tiny_data.training_text(max(2, n))
    try:
        return calibration_windows(tok, text, n, seq_len)
    except ValueError as e:
        raise MacserveError(str(e)) from None


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
def calibrate(model, out, data, windows, seq_len):
    """Fit per-layer latent rotations and clip thresholds (all methods) for the INT2 cache."""
    b = _load_mla(model)
    ws = _windows(b.tokenizer, data, windows, seq_len, held_out=False)
    stats = collect(b.model, ws, progress=_progress("calibrating"))
    cal = fit(stats, INT2, meta={"model": str(model), "data": data or "tiny training plays"})
    cal.save(out)
    for i, st in enumerate(stats):
        ev = np.linalg.eigvalsh(st.sigma_c)
        click.echo(f"layer {i}: latent eigenvalues {ev[-1]:.3g} .. {max(ev[0], 0):.3g}")
    click.echo(f"wrote {out} ({stats[0].tokens:,} tokens, methods {', '.join(cal.rotations)})")


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
@click.option("--json", "as_json", is_flag=True)
def bench_kv(model, rotation, data, windows, seq_len, gen_tokens, contexts, as_json):
    """Quality and decode speed of every latent-cache variant vs the bf16 latent cache."""
    b = _load_mla(model)
    m, tok = b.model, b.tokenizer
    rotation = rotation or shipped_rotation(model)
    if rotation is not None:
        cal = b.calibration(rotation)
    else:  # no calibration given or shipped: fit one now on the training plays
        cal = fit(
            collect(
                m,
                _windows(tok, None, 8, seq_len, held_out=False),
                progress=_progress("calibrating"),
            ),
            INT2,
        )
    ws = _windows(tok, data, windows, seq_len + 1, held_out=data is None)
    try:
        ctxs = [int(c) for c in contexts.split(",")]
    except ValueError:
        raise MacserveError(f"--contexts: comma-separated integers, not {contexts!r}") from None
    table = kv_bench.rows(
        m, cal, ws, contexts=ctxs, gen_tokens=gen_tokens, progress=_progress("evaluating")
    )
    if as_json:
        click.echo(json.dumps(table, indent=1))
        return
    longest = max(ctxs)
    click.echo(
        f"{'variant':<36} {'B/tok/layer':>11} {'dPPL%':>7} {'KL':>8} {'top1':>6} "
        f"{'greedy':>6} {'speed@' + str(longest // 1024) + 'K':>9}"
    )
    for r in table:
        mark = " *" if r["default"] else ""
        click.echo(
            f"{r['variant'] + mark:<36} {r['bytes_per_token_per_layer']:>11.1f} "
            f"{r['delta_ppl_pct']:>7.2f} {r['kl']:>8.4f} {r['top1_agreement']:>6.3f} "
            f"{r['greedy_agreement']:>6.3f} {r['decode_speed_ratio']:>8.2f}x"
        )
    bf = table[0]["decode_tokens_per_s"]
    click.echo(
        "bf16 latent decode tok/s: "
        + ", ".join(f"{c}: {bf[c]:.1f}" for c in ctxs)
        + "; * = default"
    )


def _held_out_prompts(tok, n, prompt_tokens):
    """Prompts cut from the demo model's held-out plays (never trained on)."""
    _, held = tiny_data.split(tiny_data.load_plays())
    text = "".join(p.text for p in held)
    ids = tok.encode(text, add_special_tokens=False)
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // max(1, n))
    return [ids[s : s + prompt_tokens] for s in range(0, stride * n, stride)][:n]


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
@click.option("--kv", type=click.Choice(["bf16", "int2"]), default="bf16", show_default=True)
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
    bundle = load(model)
    spec = CacheSpec.for_model(model, kv, rotation)
    mtp = bundle.mtp()
    ps = _held_out_prompts(bundle.tokenizer, prompts, prompt_tokens)
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
            f"tok/s, MTP {r['tokens_per_s_mtp']:.1f} tok/s, speedup {r['speedup']:.2f}x, "
            f"greedy identical {r['greedy_identical_prompts']}/{r['prompts']}"
        )
    if llama_url:
        ref = rows[0]["llama_server"]
        click.echo(
            f"llama-server draft-mtp on the same prompts: {ref['draft_n_accepted']}/"
            f"{ref['draft_n']} accepted"
        )


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--kv", type=click.Choice(["bf16", "int2"]), default="bf16", show_default=True)
@click.option("--rotation", type=click.Path(exists=True, dir_okay=False))
@click.option("--mtp-k", type=click.IntRange(0, 3), default=0, show_default=True)
def generate(model, prompt, max_tokens, temperature, kv, rotation, mtp_k):
    """Generate from a raw prompt with the engine (INT2 latent cache, MTP drafting)."""
    options = EngineOptions(CacheSpec.for_model(model, kv, rotation), mtp_k)
    bundle = load(model)
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
            f"{s['completion_tokens']} tokens, {s['generation_tps']:.1f} tok/s{extra}", err=True
        )


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
    if acceptance is None:
        acceptance = _demo_acceptance()
    setup = (
        engine_bench.setup_synthetic(synthetic, layers)
        if synthetic
        else engine_bench.setup_folder(model)
    )
    res = engine_bench.run(
        setup,
        contexts,
        acceptance,
        chunk_tokens,
        progress=lambda m: click.echo(f"... {m}", err=True),
        bf16_chunk_tokens=bf16_chunk_tokens,
        mac={"bandwidth": mac_bandwidth * 1e9, "flops": mac_tflops * 1e12},
    )
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    _print_engine(res)


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
    click.echo("* not run: mlx-lm's scores alone would exceed this machine's free memory")
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
    click.echo(
        "decode tok/s (this CPU): "
        + ", ".join(
            f"{int(n):,}: int2 {v['int2']:.2f} / bf16-latent {v['bf16_latent']:.2f} / "
            f"mlx-lm {v['bf16']:.2f} (int2 vs bf16-latent {v['int2_vs_bf16_latent']:.2f}x, "
            f"vs mlx-lm {v['int2_vs_mlx_lm']:.2f}x)"
            for n, v in r["decode_tok_s"].items()
        )
    )
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


def _demo_acceptance() -> float:
    """MTP k=1 acceptance on the demo model's held-out text (greedy, 8 prompts)."""
    bundle = load(env.DEMO_MODEL)
    ps = _held_out_prompts(bundle.tokenizer, 8, 64)
    row = mtp_bench.run(bundle.model, bundle.mtp(), ps, 1, 64, lambda: bundle.caches())
    return row["acceptance_per_position"][0]


def _user_messages(n: int, chars: int = 80) -> list[str]:
    """Chat messages from the demo model's held-out plays: consecutive speeches joined and cut
    to `chars` characters (the demo tokenizer spends about a token per character, so a
    10-turn chat with answers of up to 32 tokens reaches a ~700-token history)."""
    out, cur = [], ""
    for sp in tiny_data.speeches(tiny_data.held_out_text()):
        cur = f"{cur}\n{sp}" if cur else sp
        if len(cur) >= chars:
            out.append(cur[:chars])
            cur = ""
            if len(out) == n:
                break
    return out


@click.command("serve")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--turns", type=click.IntRange(2), default=10, show_default=True)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="each: a chat, one client, then the concurrent clients, on every server in turn; "
    "medians are reported",
)
@click.option("--answer-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--clients", type=click.IntRange(2), default=8, show_default=True)
@click.option("--requests", type=click.IntRange(1), default=3, show_default=True, help="per client")
@click.option(
    "--load-tokens",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="max_tokens of each load request",
)
@click.option("--logs", type=click.Path(file_okay=False), help="keep the servers' logs here")
@click.option("--json", "as_json", is_flag=True)
def bench_serve(model, turns, rounds, answer_tokens, clients, requests, load_tokens, logs, as_json):
    """macserve serve (bf16, then --kv int2 --mtp-k 1) against mlx_lm.server on MODEL, over
    HTTP: time to first token in a growing chat, and tokens/s and latency under concurrent
    clients; ratios against mlx_lm.server."""
    plan = serve_bench.Plan(
        Path(model).resolve(),
        (),
        turns=turns,
        rounds=rounds,
        answer_tokens=answer_tokens,
        clients=clients,
        requests=requests,
        load_tokens=load_tokens,
        log_dir=Path(logs).resolve() if logs else None,
    )
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
    lines = _user_messages(serve_bench.needed_lines(plan))
    plan = serve_bench.Plan(**{**plan.__dict__, "lines": tuple(lines)})
    res = serve_bench.run(plan, progress=lambda m: click.echo(f"... {m}", err=True))
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    for name, r in res["servers"].items():
        c, one, many = r["chat"], r["load_1_client"], r[f"load_{clients}_clients"]
        click.echo(
            f"{name}: chat TTFT per turn {', '.join(f'{t * 1000:.0f}' for t in c['ttft_per_turn_s'])} ms; "
            f"last turn ({c['last_turn_prompt_tokens']} prompt tokens) {c['last_turn_ttft_s'] * 1000:.0f} ms "
            f"vs {c['same_history_cold_ttft_s'] * 1000:.0f} ms cold ({c['warm_over_cold']:.2f}x); "
            f"1 client {one['tokens_per_s']:.1f} tok/s, {clients} clients {many['tokens_per_s']:.1f} "
            f"tok/s ({r['concurrency_speedup']:.2f}x), p50 {many['latency_p50_s']:.2f} s, "
            f"p95 {many['latency_p95_s']:.2f} s, refused {many['refused']}"
        )
    for name, q in res["vs_mlx_lm_server"].items():
        click.echo(
            f"{name} / mlx_lm.server: last-turn TTFT {q['follow_up_ttft']:.2f}x "
            f"(every follow-up turn {q['follow_up_ttft_mean']:.2f}x), "
            f"{clients}-client tokens/s {q[f'tokens_per_s_{clients}_clients']:.2f}x, "
            f"latency p50 {q['latency_p50']:.2f}x, p95 {q['latency_p95']:.2f}x (>1: macserve better)"
        )
