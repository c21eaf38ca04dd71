"""mlx-lm's `mlx_lm.server`: MLX / safetensors models on Apple silicon.

Run as `python -m mlx_lm server` with the same interpreter as macserve (the `python -m
mlx_lm.server` form is deprecated). Its `/health` answers 200 while the model is still loading
in a background thread, so readiness is a real one-token completion. It has no context-size
flag: the KV cache grows with each request.
"""

from __future__ import annotations

import importlib.util
import sys

import httpx

from ..errors import MacserveError
from ..profiles import Profile
from . import BaseProvider, base_url


class MlxLm(BaseProvider):
    name = "mlx"
    label = "mlx_lm.server"
    reserved = {"--host": "HOST", "--port": "PORT", "--model": "MODEL"}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlx_lm", "server"]

    def binary_path(self) -> str:
        # The help cache is keyed on mlx_lm's server.py, so upgrading mlx-lm re-probes flags.
        spec = importlib.util.find_spec("mlx_lm.server")
        if spec is None or not spec.origin:
            raise MacserveError("mlx-lm is not installed (pip install mlx-lm)")
        return spec.origin

    def model_args(self, profile: Profile) -> list[str]:
        return ["--model", profile.model]

    def env(self, profile: Profile) -> dict[str, str]:
        # Python buffers stdout when it is a file; the service log should show progress live.
        return {"PYTHONUNBUFFERED": "1"}

    def ready(self, profile: Profile, timeout: float = 5.0) -> bool:
        try:
            r = httpx.post(base_url(profile) + "/v1/completions",
                           json={"prompt": "a", "max_tokens": 1}, timeout=timeout)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def failed(self, profile: Profile) -> str | None:
        # mlx-lm >= 0.30: /health is 200 while the generation thread lives (also while it is
        # still loading the model) and 503 once it has died; the HTTP server keeps running.
        try:
            r = httpx.get(self.health_url(profile), timeout=2.0)
        except httpx.HTTPError:
            return None
        if r.status_code == 503:
            return "mlx_lm.server is up but its generation thread died (see the log)"
        return None

    def context_args(self, n_ctx: int) -> None:
        return None  # mlx_lm.server has no context flag


PROVIDER = MlxLm()
