"""`macserve calibrate` and `generate`: what each accepts; the bodies are in cli/engine.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.engine:"
# engine/gate.py's (it imports mlx); tests/test_cli_help.py checks that they agree
DEFAULT_TARGET = 0.02


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
@runs(_BODY + "calibrate")
def calibrate(model, out, data, windows, seq_len, target, report, as_json):
    """Fit per-layer latent rotations and clip thresholds (all methods) for the INT2 cache."""


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--kv", type=click.Choice(["bf16", "int2"]), default="bf16", show_default=True)
@click.option("--rotation", type=click.Path(exists=True, dir_okay=False))
@click.option("--mtp", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
@click.option("--mtp-k", type=click.IntRange(0, 3), default=1, show_default=True)
@runs(_BODY + "generate")
def generate(model, prompt, max_tokens, temperature, kv, rotation, mtp, mtp_k):
    """Generate from a raw prompt with the engine (INT2 latent cache, MTP drafting)."""
