"""`macserve serve MODEL`: the MLX engine behind an OpenAI-compatible API. Parse and call only.
Each command's arguments, options and help: cli/commands/serve.py."""

from pathlib import Path

import click

from .. import env
from ..engine.caches import CacheSpec, EngineOptions
from ..engine.model import read_config
from ..server.app import Settings, run
from ..sizing.budget import machine_budget, parse_size


def serve(
    model,
    host,
    port,
    api_key,
    ctx,
    kv,
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
    max_batch,
    prompt_cache_bytes,
    prompt_cache_dir,
    prompt_cache_disk,
    split,
):
    try:
        layers = tuple(int(x) for x in split.split(",")) if split else None
    except ValueError:
        raise click.BadParameter("layer counts N1,N2,...", param_hint="--split") from None
    cache_bytes = 0 if prompt_cache_bytes.strip() == "0" else parse_size(prompt_cache_bytes)
    disk_bytes = 0 if prompt_cache_disk.strip() == "0" else parse_size(prompt_cache_disk)
    disk_dir = Path(prompt_cache_dir) if prompt_cache_dir else env.home() / "prompt-cache"
    read_config(model)  # a missing folder or config.json is the first thing to say
    options = EngineOptions(CacheSpec.for_model(model, kv, rotation), mtp_k, mtp)
    run(
        Settings(
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
            memory_budget=None if max_batch else machine_budget().budget_bytes,
            prompt_cache_bytes=cache_bytes,
            prompt_cache_dir=disk_dir.expanduser().resolve(),
            prompt_cache_disk=disk_bytes,
        )
    )


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())
