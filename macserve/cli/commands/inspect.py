"""`macserve inspect`: what it accepts; the body is in cli/inspect.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.inspect:"


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
@runs(_BODY + "inspect")
def inspect(source, quant, memory, hosts, weights, parallel, ctx, modelled, as_json):
    """Size a model's KV cache and the context that fits. Reads config.json, the file
    listing and GGUF headers only, never weights.

    SOURCE: a Hugging Face repo id (org/name, org/name:QUANT), a model folder, a
    config.json, or a .gguf file.

    The mlx/bf16 row is measured: mlx-lm builds the model from its config with weights it
    never evaluates, and the caches it allocates are read (kept under $MACSERVE_HOME/cache).
    The other rows are modelled from the engines' code; the last column says which.
    """
