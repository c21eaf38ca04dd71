"""What every provider shares: its URLs, its server's error line, and `BaseProvider`, the
defaults of every fact and method of the `Provider` interface (providers/__init__.py). How
EXTRA_ARGS is read against a server's flags is flags.py.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ...errors import MacserveError
from ..profiles import ROUTER_KEYS, Profile
from ..values import check_secret
from .flags import (
    check_flags,
    flag_groups,
    flag_table,
    flags_from_help,
    help_text,
    is_flag,
    normalize_flag,
    removed_flags,
)


def url_host(host: str) -> str:
    """The address a client uses to reach a server bound to `host`."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def base_url(profile: Profile) -> str:
    return f"http://{url_host(profile.host)}:{profile.port}"


# click's and macserve's one-line errors ("Error: ...", "error: ..."), and the last line of a
# Python traceback ("ValueError: ...").
_ERROR_LINE = re.compile(r"^(?:[Ee]rror|ERROR): (.+)$")
_EXC_LINE = re.compile(r"^((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit): .+)$")


def python_error(lines: list[str]) -> str | None:
    """The last error line a Python server (macserve serve, mlx_lm.server) printed."""
    for line in reversed(lines):
        s = line.strip()
        m = _ERROR_LINE.match(s) or _EXC_LINE.match(s)
        if m:
            return m.group(1)
    return None


@dataclass(frozen=True)
class Limits:
    """A profile's memory share as its server's limits come from it (services/share.py builds
    it; providers render it: `argv(profile, limits)`). Here, not in share.py, so providers never
    import the share (which imports them)."""

    share_bytes: int | None  # the whole share; None: unknown (why_unknown says why)
    ctx: int | None  # context tokens of one sequence (CTX, or the model's limit)
    parallel: int  # sequences served at once
    kv_bytes: int | None  # one whole-context sequence's cache
    prompt_cache_bytes: int  # the in-memory prompt cache's bound
    reserve_bytes: int  # prefill scratch + allocator slack
    prefill_step: int = 2048  # prompt tokens per prefill chunk whose scratch fits the reserve
    baseline_bytes: int = 0  # the process itself (runtime, buffers): outside MLX's allocator
    why_unknown: str | None = None
    window: int | None = None  # KV=auto: the bf16 recent window the share fitted (tokens)

    @property
    def known(self) -> bool:
        return self.share_bytes is not None

    def unknown_error(self, label: str) -> MacserveError:
        return MacserveError(
            f"{label} needs its memory share, which is unknown: {self.why_unknown}"
        )


class BaseProvider:
    """Shared behaviour: --host/--port, GET health probe, --help flag check, and a refusal of
    the multi-Mac keys for providers that do not run across hosts."""

    name = "base"
    label = "the server"  # for messages: "llama-server does not accept --foo"
    health_path = "/health"
    multi_host = False  # takes HOSTS (and BACKEND, SHARDING, SPLIT)
    # flag -> profile key: flags that macserve derives from the profile and EXTRA_ARGS may not repeat
    reserved: dict[str, str] = {"--host": "HOST", "--port": "PORT"}
    # The variable the server reads its API key from (None: it has no API key support).
    api_key_env: str | None = None
    # Flags that carry a secret: found in EXTRA_ARGS, they are moved to the secrets file.
    secret_flags: dict[str, str] = {}
    # What it serves: model formats `new` may give it ("gguf", "mlx"); () for a server of no model.
    formats: tuple[str, ...] = ()
    # Context: its flags, the first one rendered from CTX (the others are its aliases, lifted out
    # of an old profile's EXTRA_ARGS). () : no context flag.
    ctx_flags: tuple[str, ...] = ()
    # Cache types by the server's own names (the KV key), the default first, each with sizing's
    # key for it (None: inspect does not model that cache); and the flags that set one.
    cache_types: dict[str, str | None] = {}
    kv_flags: tuple[str, ...] = ()
    # The router: whether the server answers Anthropic's Messages API (/v1/messages), and the
    # `model` to send it in place of the client's (None: the client's, which it ignores).
    anthropic_api = True
    # The router: whether it answers OpenAI's Responses API (/v1/responses); without it the
    # router translates such requests to chat completions.
    responses_api = True
    upstream_model: str | None = None
    # It is a router: it sends requests on to the other profiles (`macserve chat` finds the key
    # of the one on a port).
    routes = False
    # It takes PROMPT_CACHE_DISK: its server keeps a prompt cache on disk.
    prompt_cache_disk = False
    # What the share says of a server of no model (where its memory goes instead).
    footprint_note = ""
    # The server process's own bytes (runtime, buffers) counted in its share until the first
    # start on this machine measures it (services/baseline.py).
    assumed_baseline = 0
    # Its server allocates every sequence's cache when it starts (llama-server: -c cells), so
    # a baseline measured at idle holds the cache too, which the share counts apart.
    holds_cache_at_start = False
    # Its loader casts the model to float32 when MLX computes on the CPU (sizing/host.py): its
    # weights and caches held in the model's dtype count twice there. Others keep their dtype.
    float32_on_cpu = False
    # flag -> profile key: what `limit_args` renders from the share (EXTRA_ARGS may not set it)
    limit_flags: dict[str, str] = {}
    # the flags that set the sequences served at once: PARALLEL (lifted out of EXTRA_ARGS)
    par_flags: tuple[str, ...] = ()
    # A planned stop: True when its server has no drain of its own, so `macserve run` stays its
    # parent and drains it (services/graceful.py) through the hooks below; False: `macserve run`
    # execs the server, which drains itself (the engine) or under a shim (mlx_drain.py).
    drains = False

    @property
    def serves_model(self) -> bool:
        """Whether a profile of it names a MODEL (llama.cpp-rpc and the router serve none)."""
        return bool(self.formats)

    # ---- the drain hooks (used when `drains`) -----------------------------------------------

    def prepare(self, profile: Profile) -> None:
        """Before its server starts (llama.cpp: the slot folder)."""

    def busy(self, profile: Profile) -> int | None:
        """Generations in flight (None: it cannot tell)."""
        return None

    def before_stop(self, profile: Profile, argv: list[str], log: Callable[[str], None]) -> None:
        """Once drained, before its server is signalled: keep what it can (llama.cpp's slots)."""

    def after_start(self, profile: Profile, argv: list[str], log: Callable[[str], None]) -> None:
        """Once its server is ready after a start: put back what `before_stop` kept."""

    def macserve_on_hosts(self, profile: Profile) -> str | None:
        """Why every host of a multi-host profile needs macserve installed (pre-flight checks
        it); None: the hosts run no macserve code."""
        return None

    def shipped_kv(self, folder: Path) -> tuple[str, str] | None:
        """(KV, a note) when a model folder ships what a cache type needs and `new` picks it
        for the folder without a --kv; None: the provider's default."""
        return None

    def command(self) -> list[str]:  # the server executable (+ fixed args), for argv and --help
        raise NotImplementedError

    def binary_path(self) -> str:  # the file whose mtime keys the help cache
        return self.command()[0]

    def model_args(self, profile: Profile) -> list[str]:
        raise NotImplementedError

    def argv(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        """The server command. `limits` (the profile's share, services/share.py) adds the
        server's own memory limits; None: the command without them (the flags a check reads)."""
        return (
            self.command()
            + self.model_args(profile)
            + ["--host", profile.host, "--port", str(profile.port)]
            + self.typed_args(profile, limits)
            + list(profile.extra_args)
        )

    def typed_args(self, profile: Profile, limits: Limits | None = None) -> list[str]:
        """CTX and KV as this server's flags, then the share's limits."""
        out = (self.context_args(profile.ctx) or []) if profile.ctx else []
        out += self.kv_args(profile.kv) if profile.kv else []
        return out + (self.limit_args(limits) if limits is not None else [])

    def limit_args(self, limits: Limits) -> list[str]:
        """The share as this server's own limits ([]: it has none)."""
        return []

    def limit_env(self, limits: Limits) -> dict[str, str]:
        """The share as variables of the server's environment (an in-process shim reads them)."""
        return {}

    def taken(self, profile: Profile) -> dict[str, str]:
        """{flag: profile key}: the flags macserve sets from the profile, which EXTRA_ARGS may
        not repeat."""
        return {
            **self.reserved,
            **self.secret_flags,
            **dict.fromkeys(self.ctx_flags, "CTX"),
            **dict.fromkeys(self.kv_flags, "KV"),
            **dict.fromkeys(self.par_flags, "PARALLEL"),
            **self.limit_flags,
        }

    def env(self, profile: Profile) -> dict[str, str]:
        return {}

    def secret_env(self, secrets: dict[str, str]) -> dict[str, str]:
        """The secrets as the server's environment (`macserve run` adds them at exec)."""
        out = {}
        if secrets.get("API_KEY") and self.api_key_env:
            out[self.api_key_env] = secrets["API_KEY"]
        if secrets.get("HF_TOKEN"):
            out["HF_TOKEN"] = secrets["HF_TOKEN"]  # huggingface_hub's and llama.cpp's variable
        return out

    def check_secrets(self, secrets: dict[str, str]) -> None:
        for key, value in secrets.items():
            check_secret(key, value)  # also a secrets file written before the checks existed
        if secrets.get("API_KEY") and not self.api_key_env:
            raise MacserveError(
                f"{self.label} has no API key support, so API_KEY would not be enforced: "
                "bind it to HOST=127.0.0.1 (the default) or use PROVIDER=macserve"
            )

    def move_secrets(self, profile: Profile) -> tuple[Profile, dict[str, str]]:
        """(the profile without secret flags in EXTRA_ARGS, {secret key: value} found there)."""
        args, found, i = list(profile.extra_args), {}, 0
        kept = []
        while i < len(args):
            flag, eq, value = args[i].partition("=")
            key = self.secret_flags.get(normalize_flag(flag))
            if key and eq:
                found[key] = value
                i += 1
            elif key and i + 1 < len(args):
                found[key] = args[i + 1]
                i += 2
            else:
                kept.append(args[i])
                i += 1
        if not found:
            return profile, {}
        return profile.updated({"EXTRA_ARGS": shlex.join(kept)}), found

    def flags(self) -> dict[str, tuple[str, bool]]:
        """{flag: (canonical name, takes a value)} from the installed server's --help."""
        return flag_table(help_text(self.command(), self.binary_path()))

    def health_url(self, profile: Profile) -> str:
        return base_url(profile) + self.health_path

    def ready(self, profile: Profile, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.health_url(profile), timeout=timeout).status_code == 200
        except (httpx.HTTPError, httpx.InvalidURL, OSError):  # a bad HOST is "not ready"
            return False

    def failed(self, profile: Profile) -> str | None:
        return None

    def error_line(self, lines: list[str]) -> str | None:
        """The server's own reason for failing, from its log lines (None if none is recognized)."""
        return python_error(lines)

    def validate(self, profile: Profile) -> None:
        """The provider's own rules for the profile's keys, without I/O (one-line errors)."""
        if profile.multi_host and not self.multi_host:
            raise MacserveError(f"{self.name} does not run across hosts: remove HOSTS")
        if profile.kv and profile.kv not in self.cache_types:
            raise MacserveError(
                f"KV {profile.kv}: {self.label} caches "
                + (" | ".join(self.cache_types) if self.cache_types else "no model (remove KV)")
            )
        for key in ("CTX", "PARALLEL", "MEMORY"):
            if profile.values.get(key) and not self.formats:
                raise MacserveError(f"{key} is for a server of a model, not for {self.label}")
        if profile.prompt_cache_disk and not self.prompt_cache_disk:
            raise MacserveError("PROMPT_CACHE_DISK applies to PROVIDER=macserve only")
        if not self.serves_model:
            for key in ROUTER_KEYS:
                if profile.values.get(key):
                    raise MacserveError(
                        f"{key} is for profiles that serve a model behind the router, "
                        f"not for {self.label}"
                    )

    def check_args(self, profile: Profile, limits: Limits | None = None) -> None:
        self.validate(profile)
        text = help_text(self.command(), self.binary_path())
        check_flags(
            (self.limit_args(limits) if limits is not None else []),
            flags_from_help(text),
            self.label,
        )  # the limits' own flags: a server too old to take them is refused here
        check_flags(
            list(profile.extra_args),
            flags_from_help(text),
            self.label,
            self.taken(profile),
            removed_flags(text),
        )

    def refuse_taken_flags(self, profile: Profile) -> None:
        """For servers checked by their own click parser (which knows nothing of the profile):
        EXTRA_ARGS may not set what macserve sets from the profile's keys."""
        taken = self.taken(profile)
        for a in profile.extra_args:
            flag = normalize_flag(a.partition("=")[0])
            if is_flag(a) and flag in taken:
                raise MacserveError(
                    f"{flag} is set by macserve from the profile; use the {taken[flag]} key"
                )

    # ---- context and cache type: the CTX and KV keys --------------------------------------------

    def context_args(self, n_ctx: int) -> list[str] | None:
        """The flags that set CTX; None: the server has no context limit (CTX is then only what
        doctor and the router count its cache up to)."""
        return [self.ctx_flags[0], str(n_ctx)] if self.ctx_flags else None

    def kv_args(self, kind: str) -> list[str]:
        """The flags that make the server cache `kind` (a name in `cache_types`)."""
        return []

    def default_kv(self) -> str | None:
        return next(iter(self.cache_types), None)

    def cache_key(self, profile: Profile) -> str | None:
        """sizing's key for the cache this profile runs (None: inspect does not model it)."""
        return self.cache_types.get(profile.kv or self.default_kv() or "")

    def lift(self, profile: Profile) -> tuple[Profile, str | None]:
        """A profile written before CTX and KV were keys, with those flags still in EXTRA_ARGS:
        (the profile with them moved into CTX and KV, a one-line note), or (profile, None).
        A flag in EXTRA_ARGS wins over the key, as it did on the command line (it came last)."""
        if not (self.ctx_flags or self.kv_flags or self.par_flags) or not profile.extra_args:
            return profile, None
        values, kept, moved = {}, [], []
        kv_too = self.one_cache_type(profile)
        for canon, group in flag_groups(list(profile.extra_args), {}):
            value = group[1] if len(group) > 1 else group[0].partition("=")[2]
            key = self._lifted_key(canon, value, kv_too) if canon else None
            if key is None:
                kept += group
                continue
            k, v = key
            if v is not None:
                values[k] = v
            moved.append(shlex.join(group))
        if not moved:
            return profile, None
        values["EXTRA_ARGS"] = shlex.join(kept)
        new = profile.updated(values)
        # the keys this lift set (not those the profile had already: `new` writes CTX first)
        keys = ("CTX", "KV", "PARALLEL")
        set_ = ", ".join(f"{k}={values[k]}" for k in keys if k in values)
        return new, (
            f"moved {', '.join(moved)} out of EXTRA_ARGS into "
            f"{set_ or 'the profile (the default, so no key)'}: CTX, KV and PARALLEL are "
            "profile keys now"
        )

    def one_cache_type(self, profile: Profile) -> bool:
        """Whether the cache flags in EXTRA_ARGS name one cache type that KV can say (llama.cpp
        types its K and V caches apart: a mix stays in EXTRA_ARGS)."""
        return True

    def _lifted_key(self, flag: str, value: str, kv_too: bool) -> tuple[str, str | None] | None:
        """(CTX or KV, its value) for one EXTRA_ARGS flag, or None to keep the flag there."""
        if flag in self.ctx_flags and value.isdigit():
            return "CTX", value if int(value) > 0 else None  # 0: the model's limit, no CTX
        if flag in self.par_flags and value.isdigit() and int(value) > 0:
            return "PARALLEL", value if int(value) > 1 else None  # 1: the default
        if kv_too and flag in self.kv_flags:
            kind = self.kv_name(value)
            if kind is not None:
                return "KV", kind
        return None

    def kv_name(self, value: str) -> str | None:
        """The KV name for a value of one of `kv_flags` (None: not one KV can say)."""
        return value if value in self.cache_types else None

    def draft_args(self, mtp_layers: int) -> list[str]:
        return []
