"""What `macserve serve` was asked for: the model, the socket, limits and the engine's
options, resolved once by the CLI (cli/serve.py) and read by app.py and serving.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine.caches import EngineOptions


@dataclass(frozen=True)
class Settings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    ctx: int | None = None  # None: the model's max_position_embeddings
    options: EngineOptions = field(default_factory=EngineOptions)  # cache + MTP, resolved
    split: tuple[int, ...] | None = None  # under mlx.launch: pipeline layers per rank (None: even)
    default_max_tokens: int = 4096  # a request without max_tokens: min(this, the rest of ctx)
    max_queue: int = 64  # waiting requests beyond this get 503 + Retry-After
    request_timeout: float = 600.0  # seconds from arrival: queued -> 503, generating -> "length"
    read_timeout: float = 30.0  # seconds to send a request's headers, and then its body
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback's own
    shutdown_grace: float = 10.0  # on SIGTERM, seconds running requests get to finish
    max_batch: int | None = None  # sequences decoded together; None: sized at load (capacity.py)
    memory_budget: int | None = None  # bytes weights + caches may use (sizes max_batch)
    prompt_cache_bytes: int | None = 4 * 2**30  # the prompt cache's bound; 0: off; None: the
    # default (4 GB, or with memory_share one whole-context sequence's KV)
    memory_share: int | None = None  # `--memory`: every byte the process may hold (capacity.py)
    kv_window: int | None = None  # `--kv-window`: --kv auto's window, given (a profile's share)
    prompt_cache_dir: Path | None = None  # the disk tier's folder; None: no disk tier
    prompt_cache_disk: int = 0  # the disk tier's bound in bytes; 0: off

    @property
    def model_id(self) -> str:
        return Path(self.model).expanduser().resolve().name
