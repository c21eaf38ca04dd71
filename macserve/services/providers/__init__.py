"""Providers: how a profile becomes a running model server.

A provider is a module in this package that defines `PROVIDER`, an object with the `Provider`
interface below (`base.BaseProvider` supplies the common parts). Registration is explicit:
REGISTRY maps each profile PROVIDER value to its object.

    name: str                             the PROVIDER value in profiles ("llama.cpp", "mlx", ...)
    validate(profile) -> None             the provider's own rules for HOSTS, BACKEND, SHARDING,
                                          SPLIT, MODEL; no I/O; one-line MacserveError
    argv(profile) -> list[str]            the server command line; argv[0] is an absolute path.
                                          Never a shell string: EXTRA_ARGS is split with shlex.
    env(profile) -> dict[str, str]        variables to add to the service environment
    health_url(profile) -> str            the URL a person or monitor can poll
    ready(profile, timeout) -> bool       readiness probe: True when a request would be served
                                          now (llama.cpp: /health 200; mlx: a 1-token completion)
    failed(profile) -> str | None         a reason when the server is up but can never become
                                          ready (mlx: generation thread died); None otherwise
    check_args(profile) -> None           validate, then raise MacserveError (one line) if the
                                          server would refuse the profile (unknown flag, missing
                                          model file, unreachable host). Called before any
                                          restart so a bad edit never becomes a crash loop.
    context_args(n_ctx) -> list[str]|None flags that set the context size, None if the server
                                          has no such flag (macserve new reports that)
    draft_args(mtp_layers) -> list[str]   flags enabling MTP drafting, [] when unsupported
    anthropic_api: bool                   the router may send it /v1/messages
    upstream_model: str | None            the `model` the router sends it (None: the client's)

Adding a provider: a module defining a `BaseProvider` subclass and `PROVIDER = ...`, and one
line in REGISTRY below.
"""

from __future__ import annotations

from typing import Protocol

from ...errors import MacserveError
from ..profiles import PROVIDER_NAMES, Profile
from . import engine, llama_cpp, llama_rpc, mlx_lm, router
from .base import base_url, url_host

__all__ = ["Provider", "REGISTRY", "get", "for_profile", "base_url", "url_host"]


class Provider(Protocol):
    name: str

    def validate(self, profile: Profile) -> None: ...
    def argv(self, profile: Profile) -> list[str]: ...
    def env(self, profile: Profile) -> dict[str, str]: ...
    def health_url(self, profile: Profile) -> str: ...
    def ready(self, profile: Profile, timeout: float = 2.0) -> bool: ...
    def failed(self, profile: Profile) -> str | None: ...
    def check_args(self, profile: Profile) -> None: ...
    def context_args(self, n_ctx: int) -> list[str] | None: ...
    def draft_args(self, mtp_layers: int) -> list[str]: ...


REGISTRY: dict[str, Provider] = {
    "llama.cpp": llama_cpp.PROVIDER,
    "mlx": mlx_lm.PROVIDER,
    "macserve": engine.PROVIDER,
    "llama.cpp-rpc": llama_rpc.PROVIDER,
    "router": router.PROVIDER,
}
assert tuple(REGISTRY) == PROVIDER_NAMES  # the profile format lists the same names


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
