"""`macserve serve MODEL`: the MLX engine behind an OpenAI-compatible API. Parse and call only."""

from pathlib import Path

import click

from .. import env
from ..cache_kinds import KIND_NAMES
from ..int2_format import INT2
from .lazy import lazy

budget = lazy("macserve.sizing.budget")
caches = lazy("macserve.engine.caches")
model_files = lazy("macserve.engine.model")
server = lazy("macserve.server.app")
server_settings = lazy("macserve.server.settings")


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
    type=click.Choice(KIND_NAMES),
    default="bf16",
    show_default=True,
    help="KV cache: bf16; int2, the rotated INT2 MLA latent cache; or auto, that cache with "
    "every row bf16 as far as --memory holds --max-batch sequences at --ctx, older rows in "
    "the calibration's formats past that (without --memory: sized to the machine's budget "
    "the same way; with --max-batch and no --memory: all bf16).",
)
@click.option(
    "--kv-window",
    type=click.IntRange(1),
    help="--kv auto: the bf16 recent window in tokens, given rather than fitted (a profile's "
    "memory share fits it and `macserve run` passes it, so the server runs the window inspect "
    "and ls say); >= --ctx: every row bf16, else at least int2's "
    f"{INT2.recent}. --memory still refuses a batch that does not fit.",
)
@click.option(
    "--rotation",
    type=click.Path(exists=True, dir_okay=False),
    help="Fitted rotations for --kv int2 / auto.",
)
@click.option(
    "--mtp",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Draft with the model's MTP layer: auto measures tokens/s with and without drafting "
    "on the requests served (pairs of spans, kept beside the prompt cache) and drafts while "
    "that pays (on at >= 1.05x plain, off below 0.95x).",
)
@click.option(
    "--mtp-k",
    type=click.IntRange(0, 3),
    default=1,
    show_default=True,
    help="Tokens drafted per round when drafting (0: never draft).",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(1),
    default=4096,
    show_default=True,
    help="Completion tokens for a request that sets no max_tokens (at most the rest of --ctx).",
)
@click.option(
    "--max-queue",
    type=click.IntRange(0),
    default=64,
    show_default=True,
    help="Requests that may wait for the engine; more get 429 with Retry-After.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600,
    show_default=True,
    help="Seconds a request may take from arrival: still queued -> 503, generating -> cut "
    'with finish_reason "length".',
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30,
    show_default=True,
    help="Seconds a client has to send a request's headers, and then its body.",
)
@click.option(
    "--allowed-origins",
    default="",
    help="CORS: comma-separated origins whose web pages may call the API ('*': any) "
    "[default: none, no CORS headers].",
)
@click.option(
    "--allowed-hosts",
    default="",
    help="Bound to loopback, the Host names accepted besides localhost / 127.0.0.1 / [::1] "
    "(comma-separated).",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0),
    default=10,
    show_default=True,
    help="On SIGTERM, seconds running requests get to finish (queued ones get 503 at once).",
)
@click.option(
    "--memory",
    help="Every byte this server may hold (24GB, or bytes): the process, the weights, --max-batch "
    "whole-context KV caches, the prompt cache and a 10% reserve for prefill scratch and "
    "MLX's buffer cache are sized inside it, MLX's own limits set from it; a --max-batch "
    "that does not fit refuses to start [default: none, sized against the whole machine].",
)
@click.option(
    "--max-batch",
    type=click.IntRange(1, 256),
    help="Requests decoded together (continuous batching); more wait in the queue "
    "[default: as many whole-context KV caches as fit in --memory (or the machine's memory "
    "budget) beside the weights and the prompt cache, measured at load, at most 64].",
)
@click.option(
    "--prompt-cache-bytes",
    help="Memory for the caches of recent requests, reused by requests that share a prefix "
    "(least recently used dropped first); 0 turns the prompt cache off. With --memory an "
    "upper bound, shrunk to what the share leaves [default: 4GB; with --memory one "
    "whole-context sequence's KV].",
)
@click.option(
    "--prompt-cache-dir",
    type=click.Path(file_okay=False),
    help="Where the prompt cache's disk tier keeps prefixes across restarts "
    "[default: $MACSERVE_HOME/prompt-cache].",
)
@click.option(
    "--prompt-cache-disk",
    default="20GB",
    show_default=True,
    help="Disk for the prompt cache's disk tier (least recently used deleted first; 2 GB of "
    "the filesystem are always left free); 0 turns it off.",
)
@click.option(
    "--split",
    help="Under mlx.launch: layers per rank, N1,N2,... (rank 0 runs the "
    "last layers) [default: mlx-lm's even split].",
)
def serve(
    model,
    host,
    port,
    api_key,
    ctx,
    kv,
    kv_window,
    rotation,
    mtp,
    mtp_k,
    default_max_tokens,
    max_queue,
    request_timeout,
    read_timeout,
    allowed_origins,
    allowed_hosts,
    shutdown_grace,
    memory,
    max_batch,
    prompt_cache_bytes,
    prompt_cache_dir,
    prompt_cache_disk,
    split,
):
    """Serve MODEL (an MLX / safetensors folder) on /v1/chat/completions, /v1/completions,
    /v1/messages (Anthropic) and /v1/models. Its /health is 503 until the model has
    loaded, then 200."""
    try:
        layers = tuple(int(x) for x in split.split(",")) if split else None
    except ValueError:
        raise click.BadParameter("layer counts N1,N2,...", param_hint="--split") from None
    if kv_window is not None and kv != "auto":
        raise click.BadParameter(f"a window is --kv auto's, not {kv}'s", param_hint="--kv-window")
    cache_bytes = None if prompt_cache_bytes is None else _size(prompt_cache_bytes)
    share = None if memory is None else _size(memory)
    disk_bytes = 0 if prompt_cache_disk.strip() == "0" else budget.parse_size(prompt_cache_disk)
    disk_dir = Path(prompt_cache_dir) if prompt_cache_dir else env.home() / "prompt-cache"
    model_files.read_config(model)  # a missing folder or config.json is the first thing to say
    options = caches.EngineOptions(caches.CacheSpec.for_model(model, kv, rotation), mtp_k, mtp)
    server.run(
        server_settings.Settings(
            model,
            host=host,
            port=port,
            api_key=api_key,
            ctx=ctx,
            options=options,
            split=layers,
            default_max_tokens=default_max_tokens,
            max_queue=max_queue,
            request_timeout=request_timeout,
            read_timeout=read_timeout,
            allowed_origins=_names(allowed_origins),
            allowed_hosts=_names(allowed_hosts),
            shutdown_grace=shutdown_grace,
            max_batch=max_batch,
            memory_budget=None if max_batch or share else budget.machine_budget().budget_bytes,
            memory_share=share,
            kv_window=kv_window,
            prompt_cache_bytes=cache_bytes,
            prompt_cache_dir=disk_dir.expanduser().resolve(),
            prompt_cache_disk=disk_bytes,
        )
    )


def _size(text: str) -> int:
    """A size (24GB), or a whole number of bytes (what a provider passes)."""
    return int(text) if text.strip().isdigit() else budget.parse_size(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())
