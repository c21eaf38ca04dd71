"""`macserve serve MODEL`: the MLX engine behind an OpenAI-compatible API. Parse and call only."""

import click

from .. import env
from ..engine.caches import CacheSpec, EngineOptions
from ..engine.model import read_config
from ..server.app import Settings, run


@click.command()
@click.argument("model")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Bind address (loopback unless you mean to share it).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option(
    "--api-key",
    envvar=env.API_KEY,
    show_envvar=True,
    help="Require Authorization: Bearer KEY on /v1 (the env var keeps it out of ps).",
)
@click.option(
    "--ctx",
    type=click.IntRange(1),
    help="Prompt + completion tokens per request [default: the model's max_position_embeddings].",
)
@click.option(
    "--kv",
    type=click.Choice(["bf16", "int2"]),
    default="bf16",
    show_default=True,
    help="KV cache: bf16, or the rotated INT2 MLA latent cache.",
)
@click.option(
    "--rotation",
    type=click.Path(exists=True, dir_okay=False),
    help="Fitted rotations for --kv int2.",
)
@click.option(
    "--mtp-k",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="Tokens to draft per step with the model's MTP layer (0: off).",
)
@click.option(
    "--split",
    help="Under mlx.launch: layers per rank, N1,N2,... (rank 0 runs the "
    "last layers) [default: mlx-lm's even split].",
)
def serve(model, host, port, api_key, ctx, kv, rotation, mtp_k, split):
    """Serve MODEL (an MLX / safetensors folder) on /v1/chat/completions, /v1/completions
    and /v1/models; /health is 503 until the model has loaded, then 200."""
    try:
        layers = tuple(int(x) for x in split.split(",")) if split else None
    except ValueError:
        raise click.BadParameter("layer counts N1,N2,...", param_hint="--split") from None
    read_config(model)  # a missing folder or config.json is the first thing to say
    options = EngineOptions(CacheSpec.for_model(model, kv, rotation), mtp_k)
    run(
        Settings(
            model, host=host, port=port, api_key=api_key, ctx=ctx, options=options, split=layers
        )
    )
