"""`macserve router` as a service (`PROVIDER=router`): one endpoint in front of every other
profile, starting each on its first request and stopping it when idle (router/).

It serves no model (no MODEL key); EXTRA_ARGS holds the router's own options (`--ttl`,
`--memory`, `--keep-alive`, `--start-timeout`), checked by its click parser like the engine's.
Its API key (the profile's API_KEY secret) reaches it as MACSERVE_API_KEY. It drives the other
services through the same backend as the CLI that installed it, so the backend's settings
travel in its unit's environment.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ... import env
from ...errors import MacserveError
from ..profiles import Profile
from .base import BaseProvider, Limits
from .flags import cli_parse, is_flag, normalize_flag

DEFAULT_PORT = 8000
# `macserve router` options that install a service: meaningless inside one.
INSTALL_FLAGS = ("--install", "--name", "--no-start", "--timeout")


class Router(BaseProvider):
    name = "router"
    label = "macserve router"
    api_key_env = env.API_KEY  # `router --api-key` reads MACSERVE_API_KEY
    secret_flags = {"--api-key": "API_KEY"}
    routes = True
    footprint_note = "the router: it holds no model"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "macserve", "router"]

    def binary_path(self) -> str:
        return str(Path(__file__).resolve().parents[2] / "cli" / "router.py")

    def model_args(self, profile: Profile) -> list[str]:
        return []

    def env(self, profile: Profile) -> dict[str, str]:
        # The services it starts must land where `macserve` put the others (launchd or
        # supervisord, the same launchctl, LaunchAgents folder and domain).
        return {"PYTHONUNBUFFERED": "1", **env.service_settings()}

    def check_args(self, profile: Profile, limits: Limits | None = None) -> None:
        self.validate(profile)
        self.refuse_taken_flags(profile)
        for a in profile.extra_args:
            flag = normalize_flag(a.partition("=")[0])
            if is_flag(a) and flag in INSTALL_FLAGS:
                raise MacserveError(
                    f"{flag} installs a router; a router profile's EXTRA_ARGS takes "
                    "--ttl, --memory, --keep-alive, --start-timeout"
                )
        cli_parse("router", BaseProvider.argv(self, profile)[len(self.command()) :])


PROVIDER = Router()
