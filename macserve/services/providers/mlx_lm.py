"""mlx-lm's `mlx_lm.server`: MLX / safetensors models on Apple silicon.

Its flags are `python -m mlx_lm server`'s, with the same interpreter as macserve (the `python
-m mlx_lm.server` form is deprecated); one host runs it under `mlx_drain.py`, which gives a
planned stop's generations up to DRAIN (mlx-lm's server has no drain of its own). Its `/health` answers 200 while the model is still loading
in a background thread, so readiness is a real one-token completion. It has no context-size
flag: the KV cache grows with each request, so the shim refuses a prompt longer than CTX
(mlx_limits.py), and the memory share's limits are its flags and, in the shim, MLX's own.

Several hosts (profile HOSTS): the same server runs under `mlx.launch` (MLX's own distributed
launcher, `--backend ring|jaccl`), one rank per host; mlx-lm shards the model itself
(`--pipeline` for SHARDING=pipeline, its tensor parallelism otherwise) and only rank 0 answers
HTTP, on HOST:PORT of the first host, so health, readiness and chat are unchanged. When a rank
dies mlx.launch stops the others and exits; `mlx_launch.py` (which runs it) turns that into a
non-zero exit, so the supervisor restarts the whole group. Each rank runs the server under
`mlx_drain.py` too: on a planned stop rank 0 drains as one host does, the others keep stepping
its generations and end with it, and `mlx_launch.py` exits 0. SPLIT (uneven layers per host)
runs the same server under `macserve.engine.pipeline`, which passes the split to mlx-lm.
The ring backend listens on PORT+1.. (one port per rank), not on its default 32323, so two
services on one machine do not collide.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import re
import shutil
import sys
from pathlib import Path

import httpx

from ... import env
from ...errors import MacserveError
from ...sizing import sources
from .. import preflight
from ..profiles import Profile, local_model_path
from ..values import drain_secs
from .base import BaseProvider, Limits, base_url
from .mlx_limits import CTX_ENV, MEMORY_BASELINE_ENV, MEMORY_RESERVE_ENV, MEMORY_SHARE_ENV

# mlx-lm's server with an uneven pipeline split (engine/pipeline.py); named, not imported:
# it runs in the service's own process.
SPLIT_SHIM = "macserve.engine.pipeline"
LAUNCH_SHIM = "macserve.services.providers.mlx_launch"
DRAIN_SHIM = "macserve.services.providers.mlx_drain"
_HF_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class MlxLm(BaseProvider):
    name = "mlx"
    label = "mlx_lm.server"
    reserved = {"--host": "HOST", "--port": "PORT", "--model": "MODEL", "--pipeline": "SHARDING"}
    multi_host = True
    # Python + MLX + mlx-lm, until measured (baseline.py; the demo model on Linux: 99 MiB)
    assumed_baseline = 160 * 2**20
    formats = ("mlx",)
    # No context flag: its cache grows per request (the shim refuses a prompt past CTX).
    # Its cache is the model's own dtype, or quantized by --kv-bits (inspect models neither
    # quantized kind).
    cache_types = {"bf16": "mlx/bf16", "q8": None, "q4": None}
    kv_flags = ("--kv-bits",)
    par_flags = ("--decode-concurrency",)
    # From the share (mlx_lm.server's defaults: 32 sequences decoded and 8 prompts prefilled
    # at once, 10 prompt-cache entries with no byte cap). Its --prompt-cache-bytes bounds the
    # prompt cache AND the batch's caches together (server.py: trim_to(total - active)), but
    # only as a request joins a batch: the entry count bounds it in between.
    limit_flags = {
        "--prompt-concurrency": "PARALLEL",
        "--prompt-cache-size": "MEMORY",
        "--prompt-cache-bytes": "MEMORY",
        "--prefill-step-size": "MEMORY",
    }
    # mlx_lm.server has no /v1/messages, and it loads whatever `model` a request names (from the
    # hub, if it is not the one it serves): its own name for --model is "default_model".
    anthropic_api = False
    responses_api = False  # nor /v1/responses: the router asks it in chat completions
    upstream_model = "default_model"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlx_lm", "server"]

    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        argv = super().argv(profile, limits)
        # [python, -m, mlx_lm, server, ...] -> the same server under the drain shim, which gives
        # a planned stop's generations in flight up to DRAIN (mlx_drain.py); on several hosts
        # every rank runs it (rank 0 drains, the others follow it)
        drain = ["-m", DRAIN_SHIM, profile.name, f"{drain_secs(profile.drain):g}"]
        if not profile.multi_host:
            return [argv[0], *drain, *argv[4:]]
        if profile.sharding == "pipeline":
            argv.append("--pipeline")
        # SPLIT: the drain shim runs mlx-lm's server through our uneven-split shim
        split = ["-m", SPLIT_SHIM, _split_text(profile)] if profile.split else []
        # mlx.launch runs `--python` + the arguments after `--` on each host.
        return (
            [sys.executable, "-m", LAUNCH_SHIM]
            + launch_command(profile)
            + ["--python", argv[0], "--"]
            + drain
            + split
            + argv[4:]
        )

    def limit_args(self, limits: Limits) -> list[str]:
        out = ["--decode-concurrency", str(limits.parallel), "--prompt-concurrency", "1"]
        if not limits.known or not limits.kv_bytes:
            return out + ["--prompt-cache-size", "1"]
        entries = max(1, limits.prompt_cache_bytes // limits.kv_bytes)
        held = limits.prompt_cache_bytes + limits.kv_bytes * limits.parallel
        return out + [
            "--prompt-cache-size",
            str(entries),
            "--prompt-cache-bytes",
            str(held),
            "--prefill-step-size",
            str(limits.prefill_step),
        ]

    def limit_env(self, limits: Limits) -> dict[str, str]:
        # the drain shim sets MLX's own limits from it and refuses prompts longer than CTX
        # (mlx_lm.server has no context flag): mlx_limits.py
        out = {CTX_ENV: str(limits.ctx)} if limits.ctx else {}
        if limits.known:
            out[MEMORY_SHARE_ENV] = str(limits.share_bytes)
            out[MEMORY_RESERVE_ENV] = str(limits.reserve_bytes)
            out[MEMORY_BASELINE_ENV] = str(limits.baseline_bytes)
        return out

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

    def validate(self, profile: Profile) -> None:
        super().validate(profile)
        validate_hosts(profile)

    def macserve_on_hosts(self, profile: Profile) -> str | None:
        # argv: mlx.launch runs the drain shim (and SPLIT's shim) on every rank
        return "every rank runs mlx-lm's server under macserve's drain shim" + (
            " and its SPLIT shim" if profile.split else ""
        )

    def check_args(self, profile: Profile, limits: Limits | None = None) -> None:
        check_model_folder(profile.model)
        super().check_args(profile, limits)
        if profile.multi_host:
            check_hosts(profile)
            preflight.check(
                profile, self.macserve_on_hosts(profile)
            )  # ssh, versions, model, memory on the non-local hosts

    def ready(self, profile: Profile, timeout: float = 5.0) -> bool:
        try:
            r = httpx.post(
                base_url(profile) + "/v1/completions",
                json={"prompt": "a", "max_tokens": 1},
                timeout=timeout,
            )
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

    def kv_args(self, kind: str) -> list[str]:
        return [] if kind == "bf16" else ["--kv-bits", kind.removeprefix("q")]

    def kv_name(self, value: str) -> str | None:
        return f"q{value}" if f"q{value}" in self.cache_types else None


def check_model_folder(model: str) -> None:
    """MODEL is an MLX model folder (with config.json) or a Hugging Face repo id; offline, the
    repo must be in the Hugging Face cache. mlx_lm.server would otherwise exit at start."""
    local = local_model_path(model)
    if local is not None:
        if not (local / "config.json").is_file():
            raise MacserveError(f"MODEL {model}: not a model folder with a config.json")
        return
    if not _HF_REPO.fullmatch(model):
        raise MacserveError(f"MODEL {model!r} is neither a model folder nor a repo id (org/name)")
    if env.hf_offline() and sources.cached_source(model) is None:
        raise MacserveError(
            f"MODEL {model}: HF_HUB_OFFLINE is set and it is not in the Hugging Face cache "
            f"(macserve pull {model} while online)"
        )


def _split_text(profile: Profile) -> str:
    return ",".join(map(str, profile.split))


def launcher() -> str:
    """mlx.launch of the interpreter running macserve (not a pyenv shim): beside it, else where
    the mlx it imports installed it (a venv made with --system-site-packages has mlx's scripts
    in the base interpreter's bin, which a service's PATH does not hold), else the one on PATH."""
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if os.access(here, os.X_OK) else _installed_with_mlx()
    found = found or shutil.which("mlx.launch")
    if not found:
        raise MacserveError("mlx.launch not found (it comes with mlx: pip install mlx)")
    return found


def _installed_with_mlx() -> str | None:
    """The mlx.launch script the installed mlx package recorded (its RECORD's path), if any."""
    try:
        dist = importlib.metadata.distribution("mlx")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "mlx.launch":
            path = Path(str(dist.locate_file(f))).resolve()
            if os.access(path, os.X_OK):
                return str(path)
    return None


def launch_command(profile: Profile) -> list[str]:
    where = (
        ["--hostfile", str(profile.hostfile)]
        if profile.hostfile is not None
        else ["--hosts", ",".join(str(h) for h in profile.hosts)]
    )
    return [
        launcher(),
        "--backend",
        profile.backend or "ring",
        *where,
        "--starting-port",
        str(profile.port + 1),
    ]


def validate_hosts(profile: Profile) -> None:
    """mlx.launch's rules for HOSTS, BACKEND, SHARDING and SPLIT, without I/O. The macserve
    engine provider shares them."""
    if not profile.multi_host:
        return
    backend = profile.backend or "ring"
    if backend not in ("ring", "jaccl"):
        raise MacserveError(f"BACKEND={backend} does not apply to mlx; use ring or jaccl")
    if profile.split:
        if profile.sharding != "pipeline":
            raise MacserveError("SPLIT applies to SHARDING=pipeline only")
        if profile.hosts and len(profile.split) != len(profile.hosts):
            raise MacserveError(
                f"SPLIT has {len(profile.split)} entries for {len(profile.hosts)} hosts"
            )
    for h in profile.hosts:
        if h.port is not None:
            raise MacserveError(f"HOSTS entry {str(h)!r}: mlx takes no port (ranks use PORT+1..)")
        if backend == "ring":
            try:
                ipaddress.ip_address(h.host)
            except ValueError:
                raise MacserveError(
                    f"HOSTS entry {h.host!r}: the ring backend needs IP addresses (or a hostfile)"
                ) from None


def check_hosts(profile: Profile) -> None:
    """One-line errors for HOSTS/BACKEND/SPLIT that mlx.launch would refuse after the restart:
    the rules above, then what needs the disk (the hostfile, the model's layer count)."""
    validate_hosts(profile)
    if profile.hostfile is not None and not profile.hostfile.is_file():
        raise MacserveError(f"HOSTS hostfile {profile.values['HOSTS']} not found")
    if profile.split:
        n = len(preflight.hosts_of(profile))
        if len(profile.split) != n:
            raise MacserveError(f"SPLIT has {len(profile.split)} entries for {n} hosts")
        layers = preflight.model_layers(profile)
        if layers is not None and sum(profile.split) != layers:
            raise MacserveError(
                f"SPLIT {_split_text(profile)} sums to {sum(profile.split)}; "
                f"the model has {layers} layers"
            )
    launcher()


PROVIDER = MlxLm()
