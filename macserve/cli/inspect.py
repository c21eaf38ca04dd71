"""`macserve inspect`: how much context fits, per engine and cache type."""

import json

import click

from . import main


def _gb(b):
    return "—" if b is None else f"{b / 2**30:,.1f} GB"


@main.command()
@click.argument("source")
@click.option("--quant", help="GGUF quant to pick from a repo (or write REPO:QUANT).")
@click.option("--memory", help="Plan for another Mac, e.g. 256GB.")
@click.option("--parallel", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--ctx", type=click.IntRange(1), help="Check this context length.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(source, quant, memory, parallel, ctx, as_json):
    """Size a model's KV cache and the context that fits (reads configs and headers only)."""
    from ..inspect_model import report
    from ..memory import parse_size

    r = report(source, quant, parse_size(memory) if memory else None, parallel, ctx)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    layers = ", ".join(f"{v} {k}" for k, v in r["layers"].items())
    click.echo(f"{r['source']}  ({r['model_type']}): {layers}")
    click.echo(f"weights {_gb(r['weights_bytes'])}; budget {_gb(r['budget_bytes'])} "
               f"({r['budget_source']}); {r['parallel']} sequence(s)")
    head = f"{'cache':16} {'KV B/token':>11} {'state/seq':>10} {'max ctx':>10}"
    cols = list(next(iter(r["memory_at_context"].values())).keys())
    click.echo(head + "".join(f" {'@' + str(int(c)//1024) + 'K':>9}" for c in cols))
    for k, per in r["kv_bytes_per_token"].items():
        if per is None:
            click.echo(f"{k:16} {'n/a':>11}  (this engine cannot cache this model)")
            continue
        st = r["state_bytes_per_sequence"][k]
        mc = r["max_context"][k]
        row = f"{k:16} {per:>11,} {_gb(st):>10} {mc:>10,}"
        row += "".join(f" {_gb(r['memory_at_context'][k][c]):>9}" for c in cols)
        click.echo(row)
    if r["model_max_context"]:
        click.echo(f"(max ctx is capped at the model's own limit, {r['model_max_context']:,})")
    if r["ctx"]:
        lim = r["budget_bytes"]
        for k, row in r["memory_at_context"].items():
            t = row[str(r["ctx"])]
            if t is not None and t > lim:
                click.secho(f"WARNING: {k} at --ctx {r['ctx']:,} needs {_gb(t)}, over the "
                            f"{_gb(lim)} {r['budget_source']} — it will swap or panic the kernel",
                            fg="red", err=True)
