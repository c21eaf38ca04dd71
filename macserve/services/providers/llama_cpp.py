"""llama.cpp's `llama-server`: GGUF models, OpenAI-compatible HTTP, `/health` 200 when loaded.

The binary is found in MACSERVE_LLAMA_SERVER, then PATH, then the Homebrew prefixes (a
LaunchAgent's PATH is minimal, and `brew install llama.cpp` puts it in /opt/homebrew/bin on
Apple silicon). MODEL is a local .gguf path (`-m`) or a Hugging Face `owner/repo[:QUANT]`
(`--hf-repo`, which llama-server downloads and caches itself).

Several Macs (profile `BACKEND=rpc`, `HOSTS=worker[:port],...`): llama.cpp's own RPC backend.
Each worker runs `rpc-server -H ADDR -p PORT` (default port 50052); this head runs
llama-server with `--rpc worker:port,...` and splits the layers over its own GPU and the
workers'. Before a start, every worker's port must accept a TCP connection and this
llama-server must list `--rpc` (built with -DGGML_RPC=ON), so a bad edit is refused in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable

from ... import env
from ...errors import MacserveError
from ..profiles import Profile, local_model_path
from . import llama_slots
from .base import BaseProvider, Limits
from .flags import flag_value, help_flags, help_text

HOMEBREW_DIRS = ("/opt/homebrew/bin", "/usr/local/bin")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
RPC_PORT = 50052  # rpc-server's default
RPC_CONNECT_TIMEOUT = 3.0
_LOG_ERROR = re.compile(r"^\s*[\d.]+ E (.+)$")
_K_FLAGS = ("-ctk", "--cache-type-k")
_V_FLAGS = ("-ctv", "--cache-type-v")


def _from_env(var: str, p: str | None) -> str | None:
    if not p:
        return None
    if os.access(p, os.X_OK):
        return os.path.abspath(p)
    raise MacserveError(f"{var}={p} is not an executable file")


def find_llama_server() -> str:
    p = _from_env("MACSERVE_LLAMA_SERVER", env.llama_server())
    if p:
        return p
    found = shutil.which("llama-server")
    if found:
        return os.path.abspath(found)
    dirs = (str(env.bin_dir()), *HOMEBREW_DIRS)
    for d in dirs:
        cand = os.path.join(d, "llama-server")
        if os.access(cand, os.X_OK):
            return os.path.realpath(cand)
    raise MacserveError(
        "llama-server not found: looked in MACSERVE_LLAMA_SERVER (unset), PATH, "
        + ", ".join(dirs)
        + "; install it (brew install llama.cpp) or build it from this checkout "
        "(bash scripts/build-llama-server.sh, which links it into " + str(env.bin_dir()) + ")"
    )


RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")  # its name since / before late 2025


def find_rpc_server() -> str:
    """The RPC worker binary: MACSERVE_RPC_SERVER, beside llama-server, then PATH."""
    p = _from_env("MACSERVE_RPC_SERVER", env.rpc_server())
    if p:
        return p
    try:
        here = os.path.dirname(find_llama_server())
    except MacserveError:
        here = None
    for name in RPC_SERVER_NAMES:
        if here and os.access(os.path.join(here, name), os.X_OK):
            return os.path.join(here, name)
        found = shutil.which(name)
        if found:
            return os.path.abspath(found)
    raise MacserveError("rpc-server not found (a llama.cpp build with -DGGML_RPC=ON has it)")


class LlamaCpp(BaseProvider):
    name = "llama.cpp"
    label = "llama-server"
    health_path = "/health"  # 503 while loading, 200 when ready: a true readiness probe
    multi_host = True  # HOSTS = RPC workers
    reserved = {
        "--host": "HOST",
        "--port": "PORT",
        "-m": "MODEL",
        "--model": "MODEL",
        "-hf": "MODEL",
        "-hfr": "MODEL",
        "--hf-repo": "MODEL",
        "--rpc": "HOSTS",
        # a second key source `show` would not name, read from a file macserve does not guard
        "--api-key-file": "API_KEY",
    }
    # its compute buffers and HTTP server, until measured (SmolLM2-135M on Linux: 37 MiB)
    assumed_baseline = 64 * 2**20
    formats = ("gguf",)
    # -c is the whole KV cache, shared by the -np slots
    ctx_flags = ("-c", "--ctx-size")
    # llama-server --help, --cache-type-k: the types it allows; inspect models three of them
    cache_types = {
        "f16": "llama.cpp/f16",
        "q8_0": "llama.cpp/q8_0",
        "q4_0": "llama.cpp/q4_0",
        "bf16": None,
        "f32": None,
        "q4_1": None,
        "iq4_nl": None,
        "q5_0": None,
        "q5_1": None,
    }
    kv_flags = _K_FLAGS + _V_FLAGS
    par_flags = ("-np", "--parallel")
    holds_cache_at_start = True  # its log: "KV buffer size = ..." before it listens
    # From the share: the host-memory prompt cache (default 8 GiB per process, counted nowhere)
    # and a KV cell pool shared across slots (-kvu lets one slot hold the others' CTX: the
    # memory is the same, measured: 90 MiB for -c 4096 -np 2 either way; the per-slot CTX not)
    limit_flags = {
        "-cram": "MEMORY",
        "--cache-ram": "MEMORY",
        "-kvu": "PARALLEL",
        "--kv-unified": "PARALLEL",
        "-no-kvu": "PARALLEL",
        "--no-kv-unified": "PARALLEL",
        "--kv-unified-per-slot": "CTX",
    }
    api_key_env = "LLAMA_API_KEY"  # llama-server --help: "--api-key KEY ... (env: LLAMA_API_KEY)"
    secret_flags = {"--api-key": "API_KEY", "--hf-token": "HF_TOKEN", "-hft": "HF_TOKEN"}

    def check_secrets(self, secrets: dict[str, str]) -> None:
        super().check_secrets(secrets)
        if "," in secrets.get("API_KEY", ""):
            # llama-server --help: "multiple keys can be provided as a comma-separated list"
            raise MacserveError(
                "API_KEY: llama-server splits a key at commas into several keys: use one "
                "without commas"
            )

    def command(self) -> list[str]:
        return [find_llama_server()]

    def model_args(self, profile: Profile) -> list[str]:
        local = local_model_path(profile.model)
        if local is not None:
            return ["-m", str(local)]
        if _HF_REPO.match(profile.model):
            return ["--hf-repo", profile.model]
        raise MacserveError(f"MODEL {profile.model!r} is neither a file nor owner/repo[:QUANT]")

    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        # --metrics: llama-server's Prometheus /metrics, which the router passes through
        argv = super().argv(profile, limits) + ["--metrics"]
        workers = rpc_workers(profile)
        if workers:
            argv += ["--rpc", ",".join(f"{h}:{p}" for h, p in workers)]
        if self.keeps_slots(profile):
            argv += ["--slot-save-path", str(llama_slots.slot_dir(profile))]
        return argv

    # ---- a planned stop (services/graceful.py; llama_slots.py says what the binary offers) ----

    drains = True  # `macserve run` stays its parent: llama-server has no drain of its own

    def keeps_slots(self, profile: Profile) -> bool:
        """Save and restore slots: the binary lists --slot-save-path, the slot endpoint is on,
        and EXTRA_ARGS names no save path of its own."""
        taken = {"--slot-save-path", "--no-slots"} & set(profile.extra_args)
        try:
            listed = "--slot-save-path" in help_flags(self.command(), self.binary_path())
        except MacserveError:
            return False
        return listed and not taken

    def prepare(self, profile: Profile) -> None:
        if self.keeps_slots(profile):
            llama_slots.slot_dir(profile).mkdir(parents=True, exist_ok=True)

    def busy(self, profile: Profile) -> int | None:
        return llama_slots.busy(profile)

    def before_stop(self, profile: Profile, argv: list[str], log: Callable[[str], None]) -> None:
        if "--slot-save-path" in argv and self.keeps_slots(profile):
            llama_slots.save(profile, argv, log)

    def after_start(self, profile: Profile, argv: list[str], log: Callable[[str], None]) -> None:
        if "--slot-save-path" in argv and self.keeps_slots(profile):
            llama_slots.restore(profile, argv, log)

    def validate(self, profile: Profile) -> None:
        super().validate(profile)
        if not profile.multi_host:
            return
        if (profile.backend or "rpc") != "rpc":
            raise MacserveError(f"BACKEND={profile.backend} does not apply to llama.cpp; use rpc")
        if profile.hostfile is not None:
            raise MacserveError("llama.cpp takes HOSTS as worker[:port],... (no hostfile)")

    def check_args(self, profile: Profile, limits: Limits | None = None) -> None:
        self.validate(profile)
        local = local_model_path(profile.model)
        if local is not None and not local.is_file():
            raise MacserveError(f"model file {local} not found")
        self.model_args(profile)
        super().check_args(profile, limits)
        workers = rpc_workers(profile)
        if workers:
            if "--rpc" not in help_flags(self.command(), self.binary_path()):
                raise MacserveError(
                    "this llama-server has no --rpc: it was built without "
                    "-DGGML_RPC=ON (scripts/build-llama-server.sh builds it with RPC)"
                )
            down = [f"{h}:{p}" for h, p in workers if not reachable(h, p)]
            if down:
                raise MacserveError(
                    f"rpc worker {', '.join(down)} not reachable: start "
                    f"`rpc-server -H 0.0.0.0 -p PORT` there first"
                )

    def typed_args(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        if limits is None:
            return super().typed_args(profile)
        # -c is the whole KV pool, split evenly over the -np slots: CTX x PARALLEL gives each
        # slot CTX (the share's ctx: CTX, or the model's limit when CTX is not set)
        ctx = limits.ctx or profile.ctx
        out = ["-c", str(ctx * limits.parallel)] if ctx else []
        out += self.kv_args(profile.kv) if profile.kv else []
        return out + self.limit_args(limits)

    def limit_args(self, limits: Limits) -> list[str]:
        # --cache-ram in MiB; 0 turns the prompt cache off (an unknown share: nothing uncounted)
        mib = -(-limits.prompt_cache_bytes // 2**20) if limits.known else 0
        return ["-np", str(limits.parallel), "--cache-ram", str(mib)]

    def kv_args(self, kind: str) -> list[str]:
        return ["-ctk", kind, "-ctv", kind]  # KV types both caches alike

    def one_cache_type(self, profile: Profile) -> bool:
        k = flag_value(profile.extra_args, *_K_FLAGS)
        return k is not None and k == flag_value(profile.extra_args, *_V_FLAGS)

    def taken(self, profile: Profile) -> dict[str, str]:
        taken = super().taken(profile)
        if profile.kv is None and not self.one_cache_type(profile):
            # K and V typed apart, by hand: EXTRA_ARGS keeps them (KV would type both alike)
            taken = {f: k for f, k in taken.items() if f not in self.kv_flags}
        return taken

    def error_line(self, lines: list[str]) -> str | None:
        # llama.cpp logs "0.00.038.759 E llama_adapter_lora_init: failed to open ...": the first
        # E line is the cause, the ones after it are the callers giving up.
        for line in lines:
            m = _LOG_ERROR.match(line)
            if m:
                return " ".join(m.group(1).split())
        return super().error_line(lines)

    def draft_args(self, mtp_layers: int) -> list[str]:
        # Only builds whose --help lists draft-mtp can use the model's own MTP heads.
        if mtp_layers <= 0:
            return []
        text = help_text(self.command(), self.binary_path())
        if re.search(r"--spec-type\s+\S*\bdraft-mtp\b", text):
            return ["--spec-type", "draft-mtp"]
        return []


def rpc_workers(profile: Profile) -> list[tuple[str, int]]:
    """(host, port) of each RPC worker; [] for a one-Mac profile."""
    PROVIDER.validate(profile)
    return [(h.host, h.port or RPC_PORT) for h in profile.hosts]


def reachable(host: str, port: int, timeout: float = RPC_CONNECT_TIMEOUT) -> bool:
    """rpc-server serves one client at a time, but its listen backlog accepts the connection
    while it is busy, so this answers for a worker the head is already using."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


PROVIDER = LlamaCpp()
