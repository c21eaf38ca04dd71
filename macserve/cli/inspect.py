"""`macserve inspect`: how much context fits, per engine and cache type; for a profile's name,
its memory ledger (share and its parts, resident now and peak, budget, free memory). Parse and
print only."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .fmt import context as _ctx
from .fmt import number as _num
from .fmt import size as _gib
from .fmt import tokens_k as _k
from .lazy import lazy
from .views import ledger_lines, machine_line

advice = lazy("macserve.sizing.advice")
budget = lazy("macserve.sizing.budget")
health = lazy("macserve.services.health")
hosts_plan = lazy("macserve.sizing.hosts")
report = lazy("macserve.sizing.report")
service_views = lazy("macserve.services.views")


@click.command()
@click.argument("source")
@click.option("--quant", help="GGUF quant to pick from a repo or folder (or write REPO:QUANT).")
@click.option(
    "--memory",
    help="Plan for a Mac with this much RAM, e.g. 256GB; a comma list "
    "(256GB,256GB,192GB) plans one host per entry.",
)
@click.option(
    "--hosts", type=int, help="Plan a split over N equal hosts (each --memory, or this machine's)."
)
@click.option(
    "--weights",
    help="Weights' size when inspect cannot know it (a bare config): "
    "380GB, or 4bit to count the config's parameters under MLX 4-bit quantization.",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 4096),
    default=1,
    show_default=True,
    help="Sequences served at once (llama-server -np).",
)
@click.option("--ctx", type=click.IntRange(1), help="Check this context length per sequence.")
@click.option(
    "--modelled",
    is_flag=True,
    help="Do not build the model in mlx-lm to measure its caches: every row from inspect's "
    "own model of the engines (faster on a first run; no mlx import).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(source, quant, memory, hosts, weights, parallel, ctx, modelled, as_json):
    """Size a model's KV cache and the context that fits. Reads config.json, the file
    listing and GGUF headers only, never weights.

    SOURCE: a Hugging Face repo id (org/name, org/name:QUANT), a model folder, a
    config.json, or a .gguf file; or a profile's name: its memory ledger (the share it is
    counted at and its parts, what its server holds now and at its peak, the budget, free
    memory now).

    The mlx/bf16 row is measured: mlx-lm builds the model from its config with weights it
    never evaluates, and the caches it allocates are read (kept under $MACSERVE_HOME/cache).
    The other rows are modelled from the engines' code; the last column says which.
    """
    if _is_profile(source):
        _profile_ledger(source, memory, as_json)
        return
    if hosts is not None or (memory and "," in memory):
        machines = hosts_plan.parse_hosts(memory, hosts)
        rep = report.inspect_source(source, quant, measure=not modelled)
        mh = hosts_plan.plan_hosts(rep, machines, weights, parallel, ctx)
        if as_json:
            hosts_plan.apply_weights(rep, weights)
            r = report.report_of(rep, max(machines, key=lambda m: m or 0), parallel, ctx)
            r["multi_host"] = mh
            click.echo(json.dumps(r, indent=2))
        else:
            _print_hosts(rep, mh)
        return
    rep = report.inspect_source(source, quant, measure=not modelled)
    hosts_plan.apply_weights(rep, weights)
    mem = budget.parse_size(memory) if memory else None
    r = report.report_of(rep, mem, parallel, ctx)
    r["verdict"] = advice.weights_verdict(rep, r, mem, parallel)
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        _print(r)
        for line in r["verdict"]:
            click.echo(line)
    warning = advice.over_budget_warning(r)
    if warning:
        click.secho(warning, fg="red", bold=True, err=True)


def _is_profile(source: str) -> bool:
    """A profile's name, not a path on disk (a folder named like a profile stays a source)."""
    return "/" not in source and not Path(source).exists() and source in health.store().names()


def _profile_ledger(name: str, memory: str | None, as_json: bool) -> None:
    r = service_views.row(name)
    m = service_views.machine(budget.parse_size(memory) if memory else None)
    keys = ("share_bytes", "share", "resident_bytes", "peak_bytes", "resident")
    if as_json:
        click.echo(json.dumps({"profile": name, **{k: r[k] for k in keys}, **m}, indent=2))
        return
    click.echo(f"{name}  ({r['provider']}, {r['state']}): {r['model']}")
    for line in ledger_lines(r):
        click.echo(line)
    click.echo(machine_line(m))
    if r.get("error"):
        click.echo(f"note: {r['error']}")


def _print(r):
    layers = ", ".join(f"{v} {k}" for k, v in r["layers"].items()) or "layers not classified"
    idx = r["indexers"]
    if idx:
        layers += f" (DSA indexers: {idx['owned']} owned, {idx['shared']} shared)"
    click.echo(f"{r['source']}  ({r['model_type']}, {r['format']}): {layers}")
    w = "unknown" if r["weights_bytes"] is None else _gib(r["weights_bytes"])
    seqs = f"{r['parallel']} sequence" + ("s" if r["parallel"] > 1 else "")
    click.echo(f"weights {w}; budget {_gib(r['budget_bytes'])} ({r['budget_source']}); {seqs}")
    cols = ["8192", "32768", "131072"]
    if r["ctx"] and str(r["ctx"]) not in cols:
        cols.append(str(r["ctx"]))
    head = f"{'cache':16} {'KV B/token':>11} {'state/seq':>10} {'max ctx':>10}"
    head += "".join(f" {'@' + _k(int(c)):>9}" for c in cols) + f" {'@max':>9}  from"
    click.echo(head)
    for k, per in r["kv_bytes_per_token"].items():
        if per is None:
            click.echo(f"{k:16} {'n/a':>11}  ({r['unsupported'][k]})")
            continue
        origin = r["row_source"][k]
        mc = r["max_context"][k]
        at = r["memory_at_context"][k]
        row = f"{k:16} {_num(per):>11} {_gib(r['state_bytes_per_sequence'][k]):>10} {mc:>10,}"
        limit = r["model_max_context"] or float("inf")
        row += "".join(
            f" {_gib(at[c]) if int(c) <= limit or c == str(r['ctx']) else '>limit':>9}"
            for c in cols
        )
        row += f" {_gib(at[str(mc)]):>9}  {origin}"
        if k == "macserve/int2" and r["int2_plan"]:
            row += ", " + ("uncalibrated" if r["int2_plan"].startswith("uncal") else "calibrated")
        click.echo(row)
    click.echo(
        f"(@N: weights + caches of {seqs} of N tokens; max ctx is capped at the "
        f"model's limit, {_num(r['model_max_context']) if r['model_max_context'] else 'unknown: the config does not say'})"
    )
    engines = " and ".join(sorted(set(r["measured_with"].values())))
    click.echo(
        f"(from: measured = the caches {engines} allocates for this config; modelled = "
        "inspect's reading of the engine's code, docs/inspect.md)"
        if engines
        else "(from: modelled = inspect's reading of the engines' code, docs/inspect.md)"
    )
    mtp = r["mtp"]
    if mtp["layers"]:
        extra = ", ".join(
            f"{k} +{_num(v)}" for k, v in mtp["kv_bytes_per_token"].items() if v is not None
        )
        click.echo(
            f"MTP: {mtp['layers']} layer(s), not counted above; drafting with them adds "
            f"B/token: {extra or 'n/a'}"
        )
    if r["int2_plan"]:
        click.echo(f"macserve/int2: {r['int2_plan']}")
    if eh := r.get("engine_host"):
        rows = ", ".join(f"{k} {_num(v)}" for k, v in eh["kv_bytes_per_token"].items())
        click.echo(
            f"macserve serve here: {eh['label']}: weights {_gib(eh['weights_bytes'])}, KV "
            f"B/token {rows} (the rows above are {r.get('rows_dtype', 'bf16')}, what a Mac's "
            "GPU holds; a profile's share counts these: docs/memory.md)"
        )
    for n in r["notes"]:
        click.echo(f"note: {n}")
    if r["ctx"] and r["model_max_context"] and r["ctx"] > r["model_max_context"]:
        click.echo(
            f"note: --ctx {r['ctx']:,} is beyond the model's trained limit "
            f"({r['model_max_context']:,})"
        )


def _print_hosts(rep, mh):
    shape = rep.shape
    layers = ", ".join(f"{v} {k}" for k, v in shape.counts().items())
    click.echo(f"{rep.source.name}  ({shape.model_type}, {rep.source.kind}): {layers}")
    mems = ", ".join("this Mac" if m is None else _gib(m) for m in mh["memory_bytes"])
    seqs = f"{mh['parallel']} sequence" + ("s" if mh["parallel"] > 1 else "")
    click.echo(
        f"weights {_gib(mh['weights_bytes'])} ({mh['weights_how']}); "
        f"{mh['hosts']} host(s): {mems}; {seqs}"
    )
    one, key = mh["one_host"], mh["main_cache"]
    c1 = one["max_context"].get(key) if key else None
    if one["enough"]:
        click.echo(
            f"fits on one Mac: no split needed (budget {_gib(one['budget_bytes'])}, "
            f"max ctx {_ctx(c1)} with {key}, >= {mh['target_context']:,})"
        )
    elif c1:
        click.echo(
            f"one Mac (budget {_gib(one['budget_bytes'])}): max ctx {c1:,} with {key}, "
            f"under {mh['target_context']:,}: a split gives more context"
        )
    else:
        click.echo(
            f"one Mac (budget {_gib(one['budget_bytes'])}): the weights alone do not "
            "fit: split needed"
        )
    for s in mh["splits"]:
        keys = list(s["group_context"])
        title = (
            "pipeline: contiguous layers in proportion to each host's budget"
            if s["mode"] == "pipeline"
            else "tensor: every host holds 1/N of each layer"
        )
        click.echo("")
        if not s["possible"]:
            click.echo(f"{title}: not possible, {s['reason']}")
            continue
        click.echo(f"{title}; max ctx per cache type:")
        head = (
            f"{'host':5} {'budget':>9} {'layers':>11} {'weights':>9} {key + ' B/tok':>15}"
            + "".join(f" {k:>{len(k)}}" for k in keys)
        )
        click.echo(head)
        for i, h in enumerate(s["hosts"], 1):
            a, z = h["layers"]
            per = h["kv_bytes_per_token"].get(key)
            click.echo(
                f"{i:<5} {_gib(h['budget_bytes']):>9} {f'{a}-{z - 1} ({z - a})':>11} "
                f"{_gib(h['weights_bytes']):>9} {_num(per) if per is not None else 'n/a':>15}"
                + "".join(f" {_ctx(h['max_context'][k]):>{len(k)}}" for k in keys)
            )
        click.echo(
            f"{'group':5} {'':>9} {'':>11} {'':>9} {'':>15}"
            + "".join(f" {_ctx(s['group_context'][k]):>{len(k)}}" for k in keys)
        )
        if s["group_context"].get(key) == 0:
            click.echo(
                "(none: a host's weights share alone is over its budget; this split "
                "does not fit these hosts)"
            )
        for n in s["notes"]:
            click.echo(f"note: {n}")
