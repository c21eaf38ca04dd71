"""macserve's own MLX engine: `python -m macserve serve MODEL --host H --port P ...`.

Run with the same interpreter as macserve, so a service uses this very install. Its /health
is 503 while the model loads and 200 once a request would be served, and the server exits
(non-zero) when the model cannot load, so the generic GET probe and the supervisor's crash
detection are all readiness needs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ...int2_format import SHIPPED_ROTATION
from .. import preflight
from ..profiles import Profile, local_model_path
from ..values import drain_secs
from .base import BaseProvider, Limits
from .flags import cli_parse
from .mlx_lm import LAUNCH_SHIM, check_hosts, launch_command, validate_hosts

DEFAULT_PROMPT_CACHE_DISK = "20GB"  # serve's own default


def prompt_cache_dir(profile: Profile) -> Path:
    return env.home() / "state" / profile.name / "prompt-cache"


class Engine(BaseProvider):
    name = "macserve"
    label = "macserve serve"
    reserved = {
        "--host": "HOST",
        "--port": "PORT",
        "--split": "SPLIT",
        "--prompt-cache-disk": "PROMPT_CACHE_DISK",
        "--shutdown-grace": "DRAIN",
    }
    multi_host = True
    # Python + MLX + the HTTP server, until measured (the demo model on Linux: 110 MiB idle)
    assumed_baseline = 160 * 2**20
    # engine/model.py's load: float32 on MLX's CPU (its gather_mm), the model's own on a GPU
    float32_on_cpu = True
    formats = ("mlx",)
    ctx_flags = ("--ctx",)
    # serve --kv: bf16 (mlx-lm's own cache, the default), int2 (the INT2 latent cache) or auto
    # (that cache, bf16 as far as the share holds; counted from int2's row: services/share.py)
    cache_types = {"bf16": "mlx/bf16", "int2": "macserve/int2", "auto": "macserve/int2"}
    kv_flags = ("--kv",)
    par_flags = ("--max-batch",)
    # The share, which `serve --memory` sizes and enforces everything within (its batch, its
    # prompt cache, MLX's own limits): without it serve would size its batch to the machine.
    # KV=auto: the window the share fitted (`serve --kv-window`), so the server runs the
    # window inspect and ls say rather than fit its own on other figures (server/capacity.py).
    limit_flags = {"--memory": "MEMORY", "--prompt-cache-bytes": "MEMORY", "--kv-window": "MEMORY"}
    api_key_env = env.API_KEY  # `serve --api-key` reads MACSERVE_API_KEY
    secret_flags = {"--api-key": "API_KEY"}
    prompt_cache_disk = True

    def command(self) -> list[str]:
        return [sys.executable, "-m", "macserve", "serve"]

    def binary_path(self) -> str:
        # The flags live in cli/serve.py: editing it re-probes --help, nothing else needs to.
        return str(Path(__file__).resolve().parents[2] / "cli" / "serve.py")

    def model_args(self, profile: Profile) -> list[str]:
        # The prompt cache's disk tier in the profile's own state folder: a planned stop
        # (`set`, `restart`, the router's) flushes it on SIGTERM and the next start reads it.
        # Before EXTRA_ARGS, so a --prompt-cache-dir there wins.
        return [
            profile.model,
            "--prompt-cache-dir",
            str(prompt_cache_dir(profile)),
            "--prompt-cache-disk",
            profile.prompt_cache_disk or DEFAULT_PROMPT_CACHE_DISK,
            # the profile's DRAIN: what a generation in flight gets on SIGTERM; the
            # supervisor's SIGKILL comes STOP_MARGIN later (the disk tier's flush fits in it)
            "--shutdown-grace",
            f"{drain_secs(profile.drain):g}",
        ]

    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        argv = super().argv(profile, limits)
        if not profile.multi_host:
            return argv
        if profile.split:
            argv += ["--split", ",".join(map(str, profile.split))]
        # As the mlx provider: every rank runs `macserve serve`, pipelined by mlx-lm;
        # rank 0 (the first host) answers HTTP.
        return (
            [sys.executable, "-m", LAUNCH_SHIM]
            + launch_command(profile)
            + ["--python", argv[0], "--"]
            + argv[1:]
        )

    def typed_args(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        if limits is None or not profile.multi_host:
            return super().typed_args(profile, limits)
        # Several hosts: the share is the whole model's, not one rank's (each holds its layers),
        # so no --memory; the batch and prompt cache are still the share's, never the machine's
        return super().typed_args(profile) + self.limit_args(limits)[2:]

    def limit_args(self, limits: Limits) -> list[str]:
        if limits.share_bytes is None:
            raise limits.unknown_error(self.label)
        return [
            "--memory",
            f"{limits.share_bytes}B",
            "--max-batch",
            str(limits.parallel),
            "--prompt-cache-bytes",
            f"{limits.prompt_cache_bytes}B" if limits.prompt_cache_bytes else "0",
        ] + (["--kv-window", str(limits.window)] if limits.window is not None else [])

    def env(self, profile: Profile) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}  # log lines reach the service log as they happen

    def validate(self, profile: Profile) -> None:
        super().validate(profile)
        if profile.multi_host and profile.sharding != "pipeline":
            raise MacserveError("the macserve engine shards by pipeline only (SHARDING=pipeline)")
        validate_hosts(profile)

    def check_args(self, profile: Profile, limits: Limits | None = None) -> None:
        self.validate(profile)
        # The engine serves local folders only; refusing here beats a crash loop.
        path = local_model_path(profile.model)
        if path is None or not (path / "config.json").is_file():
            raise MacserveError(
                f"{profile.model}: macserve serve needs a local model folder with a config.json"
            )
        self.refuse_taken_flags(profile)
        # with the share's --memory: a share that is unknown is refused here (serve would
        # otherwise size its batch to the whole machine)
        self.parse(BaseProvider.argv(self, profile, limits)[len(self.command()) :])
        if profile.multi_host:
            check_hosts(profile)
            preflight.check(profile, self.macserve_on_hosts(profile))

    def parse(self, args: list[str]) -> None:
        """`serve`'s own click parser on `args` (macserve parse-args serve ...)."""
        cli_parse("serve", args)

    def kv_args(self, kind: str) -> list[str]:
        return ["--kv", kind]

    def shipped_kv(self, folder: Path) -> tuple[str, str] | None:
        if not (folder / SHIPPED_ROTATION).is_file():
            return None
        return "auto", (
            f"the folder ships its calibration ({SHIPPED_ROTATION}): KV=auto, the latent cache "
            "in bf16 as far as the memory share holds CTX x PARALLEL, older rows INT2 past that "
            "(INT2 holds a sequence in 3.2x less at 4K, 4.7x at 32K: docs/memory.md; --kv int2 "
            "for INT2 always, --kv bf16 for the plain cache)"
        )

    def macserve_on_hosts(self, profile: Profile) -> str | None:
        return "every rank runs macserve's engine"

    def draft_args(self, mtp_layers: int) -> list[str]:
        return ["--mtp-k", "1"] if mtp_layers > 0 else []


PROVIDER = Engine()
