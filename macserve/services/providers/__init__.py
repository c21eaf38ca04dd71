"""Providers: how a profile becomes a running model server, and every fact about that server.

A provider is a module in this package that defines `PROVIDER`, an object with the `Provider`
interface below (`base.BaseProvider` supplies the common parts and every default).
Registration is explicit: REGISTRY maps each profile PROVIDER value to its object, typed as the
interface, so the type checker (tests/test_types.py) holds every provider to it. The interface
lists exactly what the rest of macserve uses; a provider's flag spellings, cache types, health
route and reserved flags are its own, nothing outside this package parses EXTRA_ARGS for them,
and nothing outside it compares a provider's name: it asks the provider (`serves_model`,
`routes`, `macserve_on_hosts`, ...).

Adding a provider: a module defining a `BaseProvider` subclass and `PROVIDER = ...`, one line in
REGISTRY below, and its name in values.PROVIDER_NAMES (values.MODELLESS too if it serves no
model): a profile is parsed before any provider loads, and the check below keeps the two agreed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ...errors import MacserveError
from ..profiles import Profile
from ..values import MODELLESS, PROVIDER_NAMES
from . import engine, llama_cpp, llama_rpc, mlx_lm, router
from .base import Limits, base_url, url_host

__all__ = ["Limits", "Provider", "REGISTRY", "get", "for_profile", "base_url", "url_host"]


class Provider(Protocol):
    # Its facts, read-only here (a provider declares them as class attributes: BaseProvider).

    @property  # the PROVIDER value in profiles ("llama.cpp", "mlx", ...)
    def name(self) -> str: ...
    @property  # the server, in messages ("llama-server does not accept --foo")
    def label(self) -> str: ...
    @property  # the model formats `new` may give it ("gguf", "mlx"); () serves no model
    def formats(self) -> tuple[str, ...]: ...
    @property  # a profile of it names a MODEL (False: llama.cpp-rpc, the router)
    def serves_model(self) -> bool: ...
    @property  # KV names -> sizing's cache key (None: inspect does not model it); default first
    def cache_types(self) -> dict[str, str | None]: ...
    @property  # the variable its server reads an API key from (None: no API key support)
    def api_key_env(self) -> str | None: ...
    @property  # for the router: whether it answers /v1/messages
    def anthropic_api(self) -> bool: ...
    @property  # for the router: whether it answers /v1/responses (else: translated)
    def responses_api(self) -> bool: ...
    @property  # for the router: the `model` to send it (None: the client's)
    def upstream_model(self) -> str | None: ...
    @property  # it is a router: it sends requests on to the other profiles
    def routes(self) -> bool: ...
    @property  # it takes PROMPT_CACHE_DISK
    def prompt_cache_disk(self) -> bool: ...
    @property  # the share's note for a server of no model
    def footprint_note(self) -> str: ...
    @property  # the process's own bytes, counted in its share until measured (baseline.py)
    def assumed_baseline(self) -> int: ...
    @property  # its server allocates every sequence's cache at start (a baseline holds it)
    def holds_cache_at_start(self) -> bool: ...
    @property  # it computes in float32 on MLX's CPU (sizing/host.py): macserve's engine
    def float32_on_cpu(self) -> bool: ...

    # the profile's keys: its own rules, no I/O, one-line MacserveError
    def validate(self, profile: Profile) -> None: ...
    # validate, then refuse (one line) what the server would refuse at start: unknown or
    # reserved flags, a missing model, an unreachable host. Called before any write or restart.
    # `limits`: the profile's share (services/share.py): the limit flags are checked too
    def check_args(self, profile: Profile, limits: Limits | None = None) -> None: ...
    # an old profile's context and cache flags moved out of EXTRA_ARGS into CTX and KV, with
    # a note (None: nothing moved)
    def lift(self, profile: Profile) -> tuple[Profile, str | None]: ...
    # secret flags moved out of EXTRA_ARGS: (the profile, {API_KEY or HF_TOKEN: value})
    def move_secrets(self, profile: Profile) -> tuple[Profile, dict[str, str]]: ...
    # refuse secrets the server would ignore (an API_KEY it cannot enforce)
    def check_secrets(self, secrets: dict[str, str]) -> None: ...
    # the server command; argv[0] absolute; EXTRA_ARGS split with shlex, never a shell
    # with `limits` (the profile's share: services/share.py), the server's own memory limits
    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]: ...
    # variables added to the service's environment; the secrets as variables
    def env(self, profile: Profile) -> dict[str, str]: ...
    # the share's limits as variables (mlx: the drain shim sets MLX's own limits from them)
    def limit_env(self, limits: Limits) -> dict[str, str]: ...
    def secret_env(self, secrets: dict[str, str]) -> dict[str, str]: ...
    # {flag: (canonical name, takes a value)} from its --help: what EXTRA_ARGS+=/-= edit by
    def flags(self) -> dict[str, tuple[str, bool]]: ...
    # the flags that set a context of n_ctx tokens; None: the server has no context limit
    def context_args(self, n_ctx: int) -> list[str] | None: ...
    # KV's default name, and sizing's cache key for the profile's KV (None: not modelled)
    def default_kv(self) -> str | None: ...
    def cache_key(self, profile: Profile) -> str | None: ...
    # flags enabling MTP drafting with the model's own layers ([]: it cannot)
    def draft_args(self, mtp_layers: int) -> list[str]: ...
    # its health route, for people and monitors
    def health_url(self, profile: Profile) -> str: ...
    # readiness: a request would be served now (llama.cpp /health 200; mlx a 1-token completion)
    def ready(self, profile: Profile, timeout: float = 2.0) -> bool: ...
    # why a server that is up can never become ready (mlx: its generation thread died)
    def failed(self, profile: Profile) -> str | None: ...
    # the server's own reason for failing, from its log lines
    def error_line(self, lines: list[str]) -> str | None: ...
    # why every host of a multi-host profile needs macserve installed (None: none does)
    def macserve_on_hosts(self, profile: Profile) -> str | None: ...
    # (KV, note) `new` picks for a folder that ships what that cache needs (None: the default)
    def shipped_kv(self, folder: Path) -> tuple[str, str] | None: ...

    # A planned stop. drains: its server has no drain of its own, so `macserve run` stays its
    # parent (services/graceful.py) and calls, in order: prepare before the start, after_start
    # once ready; on a stop busy until 0 (None: cannot tell) or DRAIN, then before_stop.
    @property
    def drains(self) -> bool: ...

    def prepare(self, profile: Profile) -> None: ...
    def busy(self, profile: Profile) -> int | None: ...
    def before_stop(
        self, profile: Profile, argv: list[str], log: Callable[[str], None]
    ) -> None: ...
    def after_start(
        self, profile: Profile, argv: list[str], log: Callable[[str], None]
    ) -> None: ...


REGISTRY: dict[str, Provider] = {
    "llama.cpp": llama_cpp.PROVIDER,
    "mlx": mlx_lm.PROVIDER,
    "macserve": engine.PROVIDER,
    "llama.cpp-rpc": llama_rpc.PROVIDER,
    "router": router.PROVIDER,
}
# A profile is parsed by these two (values.py, below both profiles and providers): they must
# say what the providers say.
assert tuple(REGISTRY) == PROVIDER_NAMES, "values.PROVIDER_NAMES lists the registry's names"
assert tuple(n for n, p in REGISTRY.items() if not p.serves_model) == MODELLESS, (
    "values.MODELLESS lists the registry's providers of no model"
)


def get(name: str) -> Provider:
    try:
        return REGISTRY[name]
    except KeyError:
        raise MacserveError(f"unknown provider {name!r} (known: {', '.join(REGISTRY)})") from None


def for_profile(profile: Profile) -> Provider:
    return get(profile.provider)


def serving(fmt: str) -> list[Provider]:
    """The providers that serve model files of `fmt` ("gguf", "mlx"), the default first."""
    return [p for p in REGISTRY.values() if fmt in p.formats]


def typed(profile: Profile) -> Profile:
    """The profile with CTX and KV lifted out of an old profile's EXTRA_ARGS, in memory (the
    file changes when it is next written): what checks, argv and footprints read."""
    return for_profile(profile).lift(profile)[0]
