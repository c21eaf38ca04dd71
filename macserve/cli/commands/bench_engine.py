"""`macserve bench engine`: what it accepts; the body is in cli/bench_engine.py."""

from __future__ import annotations

import click

from ..lazy import runs

_BODY = "macserve.cli.bench_engine:"


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
@runs(_BODY + "bench_engine")
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
