"""macserve's own MLX engine: `python -m macserve serve MODEL --host H --port P ...`.

Run with the same interpreter as macserve, so a service uses this very install. Its /health
is 503 while the model loads and 200 once a request would be served, and the server exits
(non-zero) when the model cannot load, so the generic GET probe and the supervisor's crash
detection are all readiness needs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import MacserveError
from ..profiles import Profile
from . import BaseProvider, local_model_path


class Engine(BaseProvider):
    name = "macserve"
    label = "macserve serve"
    reserved = {"--host": "HOST", "--port": "PORT", "--split": "SPLIT"}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "macserve", "serve"]

    def binary_path(self) -> str:
        # The flags live in cli/serve.py: editing it re-probes --help, nothing else needs to.
        return str(Path(__file__).resolve().parent.parent / "cli" / "serve.py")

    def model_args(self, profile: Profile) -> list[str]:
        return [profile.model]

    def argv(self, profile: Profile) -> list[str]:
        argv = super().argv(profile)
        if not profile.values.get("HOSTS"):
            return argv
        from .mlx_lm import launch_command

        if profile.values.get("SPLIT"):
            argv += ["--split", profile.values["SPLIT"]]
        # As the mlx provider: every rank runs `macserve serve`, pipelined by mlx-lm;
        # rank 0 (the first host) answers HTTP.
        return ([sys.executable, "-m", "macserve.providers.mlx_launch"] + launch_command(profile)
                + ["--python", argv[0], "--"] + argv[1:])

    def env(self, profile: Profile) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}  # log lines reach the service log as they happen

    def check_args(self, profile: Profile) -> None:
        # The engine serves local folders only; refusing here beats a crash loop.
        path = local_model_path(profile.model)
        if path is None or not (path / "config.json").is_file():
            raise MacserveError(f"{profile.model}: macserve serve needs a local model folder with a config.json")
        super().check_args(profile)
        if profile.values.get("HOSTS"):
            if (profile.values.get("SHARDING") or "pipeline") != "pipeline":
                raise MacserveError("the macserve engine shards by pipeline only (SHARDING=pipeline)")
            from .. import preflight
            from .mlx_lm import check_hosts

            check_hosts(profile)
            preflight.check(profile)

    def context_args(self, n_ctx: int) -> list[str]:
        return ["--ctx", str(n_ctx)]

    def draft_args(self, mtp_layers: int) -> list[str]:
        return ["--mtp-k", "1"] if mtp_layers > 0 else []


PROVIDER = Engine()
