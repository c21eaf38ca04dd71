"""`macserve dev ...`: developer commands (train the demo model, export its GGUF twin, check
inspect against the engines).
Each command's arguments, options and help: cli/commands/dev.py."""

import json
import tempfile
from pathlib import Path

import click

from ..dev import llama_truth
from ..dev.gguf_export import export_gguf
from ..dev.hard_mla import build as build_hard_mla
from ..dev.mlx_configs import configs_from_mlx_tests
from ..dev.skeleton_tensors import write_header
from ..dev.tiny.train import TrainSettings, train
from ..engine.caches import CacheSpec
from ..engine.model import load as load_model
from ..errors import MacserveError
from ..server import disk_measure
from ..services.supervisors import launchd_files, package_root
from ..sizing.mlx_measure import engine_name
from ..sizing.report import llama_bytes_at, mlx_check


def train_tiny(out, minutes, batch, seq_len, lr, seed):
    s = TrainSettings(minutes=minutes, batch=batch, seq_len=seq_len, lr=lr, seed=seed)
    info = train(out, s, log=lambda m: click.echo(m, err=True))
    click.echo(f"trained {info['steps']} steps in {info['wall_seconds'] / 60:.1f} min -> {out}")


def hard_mla_cmd(out):
    click.echo(f"wrote {build_hard_mla(out)}")


def export_gguf_cmd(model_dir, out, dtype):
    click.echo(export_gguf(model_dir, out, dtype))


def mlx_check_cmd(configs, from_mlx_tests):
    todo = [(p.name, json.loads(p.read_text())) for p in configs]
    if from_mlx_tests:
        todo += sorted(configs_from_mlx_tests(from_mlx_tests).items())
    if not todo:
        raise click.UsageError("give config files or --from-mlx-tests")
    agree = measured = 0
    click.echo(f"{'config':44} {'module':22} {'measured B/tok, B/seq':>26} {'modelled':>26}")
    for name, cfg in todo:
        c = mlx_check(cfg)
        agree += c.agree
        measured += c.measured is not None
        verdict = "agree" if c.agree else (c.why or "DIFFER")
        click.echo(
            f"{name[:44]:44} {str(c.module)[:22]:22} {_pair(c.measured):>26} "
            f"{_pair(c.modelled):>26}  {verdict[:160]}"
        )
    click.echo(f"{agree} of {len(todo)} agree ({measured} measured in {engine_name()})")


def _pair(p):
    return "-" if p is None else f"{p[0]:,}, {p[1]:,}"


def llama_truth_cmd(configs, ctx, server, gguf):
    if not server:
        raise click.UsageError("no llama-server: set MACSERVE_LLAMA_SERVER or pass --server")
    agree = 0
    click.echo(
        f"{'config':44} {'arch':12} {'llama.cpp MiB':>14} {'inspect MiB':>12} {'B/token (llama.cpp ~ inspect)':>32}"
    )
    for p in configs:
        cfg = json.loads(p.read_text())
        try:
            with tempfile.TemporaryDirectory() as d:
                got = llama_truth.measure(cfg, server, ctx, Path(d))
                if gguf:  # the skeleton's header alone: what inspect reads of a GGUF
                    write_header(cfg, Path(d) / "header.gguf")
                    from_gguf = llama_bytes_at(Path(d) / "header.gguf", ctx)[0]
        except MacserveError as e:
            click.echo(f"{p.stem[:44]:44} not measured: {str(e).splitlines()[0][:150]}")
            continue
        try:
            want, per = llama_bytes_at(cfg, ctx)
        except MacserveError as e:
            want, per = None, f"inspect: {e}"[:60]
        mine = "n/a" if want is None else f"{want / 2**20:.2f}"
        ok = want is not None and abs(got.mib - want / 2**20) <= got.tolerance_mib
        if gguf:
            ok = (
                ok
                and from_gguf is not None
                and abs(got.mib - from_gguf / 2**20) <= got.tolerance_mib
            )
        agree += ok
        grown = sum(l.mib for l in got.lines if l.cells == _pad256(ctx)) * 2**20 / _pad256(ctx)
        click.echo(
            f"{p.stem[:44]:44} {got.arch:12} {got.mib:>14.2f} {mine:>12} "
            f"{f'{grown:,.0f} ~ {float(per):,.0f}' if want is not None else per:>32}  "
            f"{'agree' if ok else 'DIFFER'}"
        )
        if gguf:
            said = "n/a" if from_gguf is None else f"{from_gguf / 2**20:.2f} MiB"
            click.echo(f"    inspect of the skeleton's GGUF header: {said}")
        for line in got.lines:
            parts = ", ".join(f"{a} ({t}) {m:.2f}" for a, t, m in line.parts)
            click.echo(
                f"    {line.module}: {line.mib:.2f} MiB, {line.cells} cells, {line.layers} layers; {parts}"
            )
    click.echo(
        f"{agree} of {len(configs)} agree at -c {ctx} (each logged figure rounded to 0.01 MiB)"
    )


def _pad256(n):
    return -(-n // 256) * 256


def launchd_plists_cmd(check, repo):
    repo = repo or package_root()
    if repo is None:
        raise click.UsageError("macserve runs from site-packages: give --repo CHECKOUT")
    if check:
        bad = launchd_files.stale(repo)
        for n in bad:
            click.echo(f"launchd/{n} is out of date: run macserve dev launchd-plists")
        raise SystemExit(1 if bad else 0)
    changed = launchd_files.write(repo)
    click.echo(f"launchd/: {', '.join(changed) if changed else 'up to date'}")


def disk_blocks_cmd(model_dir, kv, tokens, turn, sizes):
    try:
        ns = [int(x) for x in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"{sizes!r}: block sizes separated by commas") from None
    bundle = load_model(Path(model_dir))
    rows = disk_measure.measure(bundle, CacheSpec.for_model(model_dir, kv), tokens, turn, ns)
    base = rows[0]
    click.echo(
        f"{'N':>6} {'files':>5} {'MB':>6} {'write s':>8} {'x':>5} {'turn MB':>8} "
        f"{'turn s':>7} {'x':>5} {'read s':>7} {'x':>5}"
    )
    for r in rows:
        click.echo(
            f"{r.block or '-':>6} {r.files:>5} {r.bytes / 2**20:>6.2f} {r.write_s:>8.3f} "
            f"{r.write_s / base.write_s:>5.2f} {r.followup_bytes / 2**20:>8.2f} "
            f"{r.followup_write_s:>7.3f} {r.followup_write_s / base.followup_write_s:>5.2f} "
            f"{r.load_s:>7.3f} {r.load_s / base.load_s:>5.2f}"
        )
