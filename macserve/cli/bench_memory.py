"""`bench memory`: each provider's server driven to its worst realistic case against the share
its profile gives it (services/worst_case.py), and the bytes MLX's allocator holds per
sequence for INT2, the bf16 latent and mlx-lm's cache at DeepSeek-V3's width
(engine/bench/held.py); docs/memory.md's tables come from it."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import click

from ..errors import MacserveError
from . import fmt
from .lazy import lazy

worst_case = lazy("macserve.services.worst_case")
profiles = lazy("macserve.services.profiles")
held_bench = lazy("macserve.engine.bench.held")
bench_setup = lazy("macserve.engine.bench.setup")
serve_http = lazy("macserve.engine.bench.serve_http")
gguf_export = lazy("macserve.dev.gguf_export")
sizing_budget = lazy("macserve.sizing.budget")

PROVIDERS = ("macserve", "mlx", "llama.cpp")  # profile PROVIDER values


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise click.BadParameter("comma-separated token counts", param_hint=what) from None


def _port() -> int:
    import socket  # noqa: PLC0415 - a free port, only when a server is started

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profile(provider: str, model: Path, ctx: int, parallel: int):
    name = "bench-memory-" + provider.replace(".", "")
    values = {
        "PROVIDER": provider,
        "MODEL": str(model),
        "PORT": str(_port()),
        "CTX": str(ctx),
        "PARALLEL": str(parallel),
    }
    return profiles.Profile(name, values)


def _models(model: Path, gguf: str | None, work: Path, which: tuple[str, ...], progress) -> dict:
    """The model each provider serves: the folder; a float32 copy of it for mlx_lm.server on
    MLX's CPU backend (no bf16 GatherMM for MoE layers there); the GGUF given or the folder's
    GGUF twin."""
    out = {"macserve": model}
    if "mlx" in which:
        if bench_setup.engine_dtype() is not None:
            progress("mlx_lm.server on MLX's CPU: a float32 copy of the model")
            out["mlx"] = serve_http.float32_copy(model, work / (model.name + "-f32"))
        else:
            out["mlx"] = model
    if "llama.cpp" in which:
        if gguf:
            out["llama.cpp"] = Path(gguf).resolve()
        else:
            progress("llama-server: the model's GGUF twin (macserve dev export-gguf)")
            out["llama.cpp"] = gguf_export.export_gguf(model, work / (model.name + ".gguf"))
    return out


def run_servers(model, gguf, ctx, parallel, load, which, measure_baseline, progress) -> list:
    with tempfile.TemporaryDirectory(prefix="macserve-bench-memory-") as d:
        work = Path(d)
        models = _models(model, gguf, work, which, progress)
        out = []
        for prov in which:
            p = _profile(prov, models[prov], ctx, parallel)
            if measure_baseline:
                progress(f"{prov}: its baseline, measured as the first start does")
                worst_case.measure_baseline(p, work / f"{p.name}-baseline.log")
            r = worst_case.drive(p, load, work / f"{p.name}.log", progress)
            out.append(r.as_dict())
        return out


@contextlib.contextmanager
def _home(keep: bool):
    """A fresh MACSERVE_HOME for the bench's profiles (the user's profiles, baselines and
    prompt caches are not touched), unless --in-home."""
    if keep:
        yield
        return
    old = os.environ.get("MACSERVE_HOME")
    with tempfile.TemporaryDirectory(prefix="macserve-home-") as d:
        os.environ["MACSERVE_HOME"] = d
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("MACSERVE_HOME", None)
            else:
                os.environ["MACSERVE_HOME"] = old


@click.command("memory")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--gguf",
    type=click.Path(exists=True, dir_okay=False),
    help="llama-server's model (default: MODEL's GGUF twin)",
)
@click.option(
    "--ctx", type=click.IntRange(64), default=1024, show_default=True, help="CTX of every profile"
)
@click.option(
    "--parallel",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="PARALLEL of every profile",
)
@click.option(
    "--clients",
    type=click.IntRange(1),
    help="at once in each batch phase [default: 4 x PARALLEL: those past PARALLEL must queue]",
)
@click.option("--answer-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option(
    "--cache-prompts",
    type=click.IntRange(0),
    default=6,
    show_default=True,
    help="distinct prompts near CTX sent in turn to fill the prompt caches",
)
@click.option(
    "--provider",
    "which",
    type=click.Choice(PROVIDERS),
    multiple=True,
    help="only these (repeatable) [default: all three]",
)
@click.option(
    "--assumed-baseline",
    is_flag=True,
    help="count each server's assumed baseline, as a first start does (default: measure it "
    "with one start first, as the first start on a machine stores it)",
)
@click.option(
    "--held-contexts",
    default="1024,4096,32768,131072",
    show_default=True,
    help="contexts of the held-bytes table ('' skips it)",
)
@click.option(
    "--budget",
    default="64GB",
    show_default=True,
    help="cache budget of the per-budget table (a size)",
)
@click.option(
    "--servers/--no-servers",
    default=True,
    help="the servers' part (--no-servers: the held-bytes table only)",
)
@click.option(
    "--in-home",
    is_flag=True,
    help="use $MACSERVE_HOME (its stored baselines) instead of a fresh one",
)
@click.option("--json", "as_json", is_flag=True)
def bench_memory(
    model,
    gguf,
    ctx,
    parallel,
    clients,
    answer_tokens,
    cache_prompts,
    which,
    assumed_baseline,
    held_contexts,
    budget,
    servers,
    in_home,
    as_json,
):
    """Each provider's server at its worst case against its memory share (peak / share), and
    INT2's held bytes per sequence against bf16 at DeepSeek-V3's width."""
    held_ctx = _ints(held_contexts, "--held-contexts")
    budget_bytes = sizing_budget.parse_size(budget)
    if answer_tokens >= ctx:
        raise MacserveError(f"--answer-tokens {answer_tokens} leaves no prompt in --ctx {ctx}")
    load = worst_case.Load(
        clients=clients or 4 * parallel,
        prompt_tokens=ctx - answer_tokens - 16,  # 16: the prompt's seed, rounding
        answer_tokens=answer_tokens,
        cache_prompts=cache_prompts,
    )

    def progress(m):
        click.echo(f"... {m}", err=True)

    res: dict = {"ctx": ctx, "parallel": parallel, "load": load.__dict__}
    if servers:
        with _home(in_home):
            res["servers"] = run_servers(
                Path(model).resolve(),
                gguf,
                ctx,
                parallel,
                load,
                which or PROVIDERS,
                not assumed_baseline,
                progress,
            )
    if held_ctx:
        table = held_bench.held(held_ctx, progress=progress)
        res["held"] = table
        res["per_budget"] = held_bench.per_budget(table, budget_bytes)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    if servers:
        _print_servers(res)
    if held_ctx:
        _print_held(res["held"], res["per_budget"])


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.1f}"


def _print_servers(res: dict) -> None:
    ld = res["load"]
    click.echo(
        f"CTX {res['ctx']}, PARALLEL {res['parallel']}: {ld['clients']} clients at once "
        f"(prompts ~{ld['prompt_tokens']} tokens, answers <= {ld['answer_tokens']}), then "
        f"{ld['cache_prompts']} distinct prompts in turn, then the clients again"
    )
    click.echo(
        f"{'provider':<11}{'share MB':>10}{'baseline MB':>13}{'idle MB':>9}{'peak MB':>9}"
        f"{'VmHWM MB':>10}{'peak/share':>12}  answered/refused  baseline"
    )
    for r in res["servers"]:
        ratio = r["peak_over_share"]
        click.echo(
            f"{r['provider']:<11}{_mb(r['share_bytes']):>10}{_mb(r['baseline_bytes']):>13}"
            f"{_mb(r['idle_bytes']):>9}{_mb(r['peak_bytes']):>9}{_mb(r['hwm_bytes']):>10}"
            f"{'n/a' if ratio is None else f'{ratio:.2f}x':>12}  "
            f"{r['answered']:>8}/{r['refused']:<8} {r['baseline_source']}"
        )
        s = r["share"]
        click.echo(
            f"{'':<11}share = weights {_mb(s['weights_bytes'])} + KV {_mb(s['kv_bytes'])} x "
            f"{s['parallel']} + prompt cache {_mb(s['prompt_cache_bytes'])} + baseline "
            f"{_mb(s['baseline_bytes'])} + reserve {_mb(s['reserve_bytes'])} MB"
        )
        secs = ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items())
        click.echo(f"{'':<11}seconds: {secs}; {r['answer_tokens']:,} tokens answered")
        for f in r["failed"][:3]:
            click.echo(f"{'':<11}failed: {f}")


def _print_held(table: dict, pb: dict) -> None:
    layers = table["layers_counted"]
    click.echo(
        f"\nheld by MLX's allocator, one sequence ({table['model']}, per layer measured; "
        f"per sequence x {layers} layers)"
    )
    click.echo(
        f"{'context':>8}  {'INT2 B/tok/layer':>16}{'bf16-latent':>12}{'mlx-lm':>9}"
        f"{'INT2 /seq':>11}{'bf16-lat /seq':>14}{'mlx-lm /seq':>12}"
        f"{'bf16-lat/INT2':>14}{'mlx-lm/INT2':>12}"
    )
    for n, row in table["contexts"].items():
        i, bl, m = row["int2"], row["bf16_latent"], row["bf16"]
        click.echo(
            f"{fmt.tokens_k(int(n)):>8}  {i['per_token_per_layer']:>16,.1f}"
            f"{bl['per_token_per_layer']:>12,.1f}{m['per_token_per_layer']:>9,.1f}"
            f"{fmt.size(i['per_sequence']):>11}{fmt.size(bl['per_sequence']):>14}"
            f"{fmt.size(m['per_sequence']):>12}{bl['over_int2']:>13.2f}x{m['over_int2']:>11.2f}x"
        )
    click.echo(
        f"\nin a cache budget of {fmt.size(pb['budget_bytes'])} ({layers} layers): whole "
        "sequences of each context, and the tokens of context they hold"
    )
    click.echo(
        f"{'context':>8}  {'INT2 seqs':>10}{'tokens':>11}{'bf16-lat seqs':>15}{'tokens':>11}"
        f"{'mlx-lm seqs':>13}{'tokens':>11}{'INT2/mlx-lm':>13}"
    )
    for n, row in pb["contexts"].items():
        cells = "".join(
            f"{row[w]['sequences']:>{width},}{row[w]['tokens']:>11,}"
            for w, width in (("int2", 10), ("bf16_latent", 15), ("bf16", 13))
        )
        more = row["int2"]["sequences"] / max(1, row["bf16"]["sequences"])
        click.echo(f"{fmt.tokens_k(int(n)):>8}  {cells}{more:>12.2f}x")
