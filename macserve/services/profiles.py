"""Profiles: one human-editable `KEY=VALUE` file per served model, and the store that keeps them.

A profile lives in `$MACSERVE_HOME/profiles/NAME.env` (default `~/.config/macserve`). Values use
shell quoting (`EXTRA_ARGS='-c 8192 --threads 8'`), so the file can be read by a person, by
`shlex`, and by `source` in a shell. Comments and blank lines are kept when macserve rewrites a
file: `set` changes the value in place instead of regenerating the file.

Keys:
  PROVIDER    llama.cpp | mlx | macserve | llama.cpp-rpc | router (required; values.py lists
              them, services/providers says what each runs; llama.cpp-rpc is an RPC worker)
  MODEL       path, HF repo id, or repo:QUANT   (required, except for llama.cpp-rpc and router)
  PORT        1..65535                                (required)
  HOST        bind address, default 127.0.0.1
  CTX         context tokens the server is configured for (a positive integer); each provider
              renders it as its own flag (llama.cpp -c, the engine --ctx). mlx_lm.server has no
              such flag: there CTX is what doctor and the router count its cache up to
  KV          cache type, in the provider's own names (llama.cpp f16, q8_0, q4_0, ...; mlx
              bf16, q8, q4; macserve bf16, int2); checked and rendered by the provider
  EXTRA_ARGS  the provider flags macserve does not model, split with shlex (never a shell)
  HOSTS       serve across several Macs. mlx: IPs/hosts `a,b,...` (first = this head host,
              rank 0) or a path to an mlx.launch hostfile (JSON). llama.cpp: the RPC workers,
              `host[:port],...` (port default 50052), this head not included
  BACKEND     ring | jaccl (mlx.launch backends; mlx default ring) | rpc (llama.cpp, its default)
  SHARDING    pipeline | tensor: how mlx-lm splits the model over HOSTS (default pipeline)
  SPLIT       pipeline layers per HOSTS entry, `n1,n2,...` (mlx; default: mlx-lm's even split).
              `macserve inspect --memory A,B` prints the split in proportion to each host's budget
  PARALLEL    sequences the server serves at once (a positive integer, default 1): its
              memory share counts that many whole-context caches, and the provider sets its
              server's own concurrency from it (the engine --max-batch, llama-server -np,
              mlx_lm.server --decode-concurrency). With MEMORY and no PARALLEL: as many as fit
  MEMORY      the profile's memory share by hand (`24GB`, binary units): the most its server's
              process tree may hold (services/share.py). Default: weights + PARALLEL caches at
              CTX + its prompt cache + the process's baseline + a 10 % reserve. The provider
              passes it to the server (the engine --memory, llama-server --cache-ram, ...)
  TTL         for the router (`macserve router`): stop the service after this long without
              a request (`90`, `90s`, `10m`, `1h`; default: the router's --ttl), or `never`
              (always on: the router never stops it, not for idleness, not to make room)
  ALIASES     more model names the router sends to this profile, `a,b,...` (letters, digits,
              `.`, `_`, `-`, `:`, `/`)
  PROMPT_CACHE_DISK  macserve: its prompt cache's disk bound (`20GB` default, `0` off)
  DRAIN       how long a planned stop waits for generations in flight (`60`, `90s`, `5m`;
              default 60 s); the supervisor's SIGKILL comes only STOP_MARGIN after it

Secrets (`set NAME -- API_KEY=...`, `HF_TOKEN=...`) live in `profiles/NAME.secrets`, mode 0600,
the same KEY=VALUE format; never in the profile, a unit file, argv or a log.

A `Profile` is frozen and typed: every value is parsed and checked once, when it is built
(`profile.hosts`, `profile.split`, `profile.port`, ...); nothing downstream re-parses the text.
Checks that depend on the provider (which BACKEND, which HOSTS form) are the provider's own
(`services.providers`, `Provider.validate`).

Writes are atomic (fileio.atomic_write: temp file, fsync, os.replace, fsync of the directory),
and every read-modify-write holds an exclusive flock (`profiles/.NAME.lock` per profile,
`profiles/.lock` to create one), so two `macserve set` runs cannot interleave, and a crash
mid-write leaves the old file intact.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shlex
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..errors import MacserveError
from ..fileio import atomic_write
from ..sizing.budget import parse_size
from .values import (
    MAX_DRAIN,
    MODELLESS,
    PROVIDER_NAMES,
    SECRET_KEYS,
    check_secret,
    parse_duration,
)

KEYS = (
    "PROVIDER",
    "MODEL",
    "HOST",
    "PORT",
    "CTX",
    "KV",
    "EXTRA_ARGS",
    "HOSTS",
    "BACKEND",
    "SHARDING",
    "SPLIT",
    "PARALLEL",
    "MEMORY",
    "TTL",
    "ALIASES",
    "SYSTEM",
    "PROMPT_CACHE_DISK",
    "DRAIN",
)
# Read by the router only: changing them restarts nothing.
ROUTER_KEYS = ("TTL", "ALIASES")
REQUIRED = ("PROVIDER", "MODEL", "PORT")
# Kept out of the profile (which is 0644 and printed by `show`), in NAME.secrets beside it, mode
# 0600; `macserve run` puts them in the server's environment, never on its command line.
DEFAULT_HOST = "127.0.0.1"
BACKENDS = ("rpc", "ring", "jaccl")  # multi-Mac transports: rpc for llama.cpp, the rest mlx
SHARDINGS = ("pipeline", "tensor")

# Names become file names, launchd labels (dev.macserve.NAME) and supervisor program names,
# so keep them to characters all three accept.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
# Model names clients send (`gpt-4o`, `qwen3:32b`, `org/model`): what an alias may be.
_ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
NEVER = "never"
MAX_VALUE = 4096  # characters in one value: PATH_MAX on Linux (macOS: 1024)


def macserve_home() -> Path:
    return env.home()


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or "") or name.endswith(".env"):
        raise MacserveError(
            f"bad profile name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)"
        )
    return name


@dataclass(frozen=True)
class HostEntry:
    """One entry of a HOSTS list: `host` or `host:port` (the port only where a provider
    takes one: llama.cpp's RPC workers)."""

    host: str
    port: int | None = None

    def __str__(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Profile:
    """One profile, parsed and checked once at construction (a bad value raises here).

    `values` are the texts as written (for rewriting the file, comments and order kept);
    the other fields are the typed meaning of those texts.
    """

    name: str
    values: Mapping[str, str] = field(default_factory=dict)
    # Original file lines, kept so a rewrite preserves the user's comments and order.
    lines: tuple[str, ...] = field(default=(), repr=False, compare=False)
    provider: str = field(init=False)
    model: str = field(init=False)
    host: str = field(init=False)
    port: int = field(init=False)
    ctx: int | None = field(init=False)  # CTX: context tokens; None: the server's default
    kv: str | None = field(init=False)  # KV: a cache type the provider names; None: its default
    extra_args: tuple[str, ...] = field(init=False)
    hosts: tuple[HostEntry, ...] = field(init=False)  # () unless HOSTS lists hosts
    hostfile: Path | None = field(init=False)  # HOSTS names an mlx.launch hostfile
    backend: str | None = field(init=False)  # None: the provider's default
    sharding: str = field(init=False)  # pipeline (default) | tensor
    split: tuple[int, ...] = field(init=False)  # () : the engine's even split
    parallel: int | None = field(init=False)  # PARALLEL; None: 1, or derived from MEMORY
    memory: int | None = field(init=False)  # MEMORY in bytes; None: the share is computed
    ttl: float | None = field(
        init=False
    )  # seconds idle before the router stops it; None: its default
    always_on: bool = field(init=False)  # TTL=never: the router never stops it
    aliases: tuple[str, ...] = field(init=False)  # more names the router routes here
    system: bool = field(init=False)  # SYSTEM=1: a LaunchDaemon (boot, no login), on macOS
    prompt_cache_disk: str | None = field(init=False)  # as typed; None: the engine's default
    drain: float | None = field(init=False)  # DRAIN seconds; None: values.DEFAULT_DRAIN

    def __post_init__(self):
        v = {k: ("" if x is None else str(x)) for k, x in dict(self.values).items()}
        set_ = object.__setattr__
        set_(self, "values", types.MappingProxyType(v))
        set_(self, "lines", tuple(self.lines))
        for key, text in v.items():
            if key not in KEYS:
                raise MacserveError(f"unknown key {key} (known: {', '.join(KEYS)})")
            if len(text) > MAX_VALUE:
                # past PATH_MAX every file call on it fails (ENAMETOOLONG): refused here, once
                raise MacserveError(
                    f"{key} is {len(text):,} characters long: at most {MAX_VALUE:,}"
                )
            if not text.isprintable():
                raise MacserveError(f"{key}: control characters are not allowed in a value")
        for key in REQUIRED:
            if key == "MODEL" and v.get("PROVIDER") in MODELLESS:
                continue
            if not v.get(key):
                raise MacserveError(f"{key} is required")
        if v["PROVIDER"] not in PROVIDER_NAMES:
            raise MacserveError(
                f"unknown provider {v['PROVIDER']!r} (known: {', '.join(PROVIDER_NAMES)})"
            )
        set_(self, "provider", v["PROVIDER"])
        set_(self, "model", v.get("MODEL", ""))
        set_(self, "port", _port("PORT", v["PORT"]))
        host = v.get("HOST") or DEFAULT_HOST
        if not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]+", host):
            raise MacserveError(f"bad HOST {host!r}")
        set_(self, "host", host)
        ctx = v.get("CTX", "")
        if ctx and (not ctx.isdigit() or int(ctx) < 1):
            raise MacserveError(f"bad CTX {ctx!r}: expected context tokens, a positive integer")
        set_(self, "ctx", int(ctx) if ctx else None)
        kv = v.get("KV", "")
        if kv and not re.fullmatch(r"[A-Za-z0-9_]+", kv):
            raise MacserveError(f"bad KV {kv!r}: expected a cache type name (f16, q8_0, int2, ...)")
        set_(self, "kv", kv or None)
        try:
            set_(self, "extra_args", tuple(shlex.split(v.get("EXTRA_ARGS", ""))))
        except ValueError as e:
            raise MacserveError(f"EXTRA_ARGS does not parse: {e}") from None
        hosts_text = v.get("HOSTS", "")
        hostfile: Path | None = None
        hosts: tuple[HostEntry, ...] = ()
        if _is_hostfile(hosts_text):
            hostfile = Path(hosts_text).expanduser()
        elif hosts_text:
            hosts = tuple(_host_entry(h) for h in (x.strip() for x in hosts_text.split(",")) if h)
        set_(self, "hostfile", hostfile)
        set_(self, "hosts", hosts)
        backend = v.get("BACKEND") or None
        if backend is not None and backend not in BACKENDS:
            raise MacserveError(f"unknown BACKEND {backend!r} (known: {', '.join(BACKENDS)})")
        set_(self, "backend", backend)
        sharding = v.get("SHARDING") or "pipeline"
        if sharding not in SHARDINGS:
            raise MacserveError(f"unknown SHARDING {sharding!r} (known: pipeline, tensor)")
        set_(self, "sharding", sharding)
        split = v.get("SPLIT", "")
        if split and not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)+", split):
            raise MacserveError(
                f"bad SPLIT {split!r}: expected layer counts n1,n2,... "
                "(one per HOSTS entry, each >= 1)"
            )
        set_(self, "split", tuple(int(x) for x in split.split(",")) if split else ())
        par = v.get("PARALLEL", "")
        if par and (not par.isdigit() or int(par) < 1):
            raise MacserveError(f"bad PARALLEL {par!r}: expected a positive integer")
        set_(self, "parallel", int(par) if par else None)
        mem = v.get("MEMORY", "").strip()
        try:
            set_(self, "memory", parse_size(mem) if mem else None)
        except MacserveError as e:
            raise MacserveError(f"bad MEMORY: {e}") from None
        ttl = v.get("TTL", "").strip()
        set_(self, "always_on", ttl.lower() == NEVER)
        set_(self, "ttl", None if not ttl or self.always_on else parse_duration(ttl, "TTL"))
        aliases = tuple(a.strip() for a in v.get("ALIASES", "").split(",") if a.strip())
        for a in aliases:
            if not _ALIAS_RE.fullmatch(a):
                raise MacserveError(
                    f"bad ALIASES entry {a!r}: letters, digits, '.', '_', '-', ':', '/' "
                    "(comma-separated)"
                )
        if len(set(aliases)) != len(aliases) or self.name in aliases:
            raise MacserveError(f"ALIASES {v['ALIASES']!r} names a model twice")
        set_(self, "aliases", aliases)
        if v.get("SYSTEM", "0") not in ("0", "1"):
            raise MacserveError(f"bad SYSTEM {v['SYSTEM']!r}: expected 1 (a LaunchDaemon) or 0")
        set_(self, "system", v.get("SYSTEM") == "1")
        pcd = v.get("PROMPT_CACHE_DISK", "").strip()
        _ = pcd in ("", "0") or parse_size(pcd)  # a bad size: one line naming it
        set_(self, "prompt_cache_disk", pcd or None)
        drain = v.get("DRAIN", "").strip()
        drain_s = parse_duration(drain, "DRAIN") if drain else None
        if drain_s is not None and drain_s > MAX_DRAIN:
            raise MacserveError(f"DRAIN {drain}: at most {MAX_DRAIN:.0f}s (an hour)")
        set_(self, "drain", drain_s)

    @property
    def multi_host(self) -> bool:
        """HOSTS is set: the profile runs across several Macs."""
        return bool(self.hosts) or self.hostfile is not None

    def updated(self, changes: Mapping[str, str]) -> Profile:
        """A copy with `changes` applied (checked); an empty value removes an optional key."""
        values = dict(self.values)
        for k, v in changes.items():
            if v == "" and k not in REQUIRED:
                values.pop(k, None)
            else:
                values[k] = v
        return Profile(self.name, values, self.lines)

    def to_text(self) -> str:
        """Serialize, keeping comments and key order of the file this profile was read from."""
        out, seen = [], set()
        for line in self.lines:
            m = _KEY_LINE.match(line)
            if not m:
                out.append(line)
                continue
            key = m.group(1)
            if key in seen or key not in self.values:
                continue  # removed key (or a duplicate): drop the line
            seen.add(key)
            out.append(f"{key}={_quote(self.values[key])}")
        for key in KEYS:
            if key in self.values and key not in seen:
                out.append(f"{key}={_quote(self.values[key])}")
                seen.add(key)
        return "\n".join(out).rstrip("\n") + "\n"


def local_model_path(model: str) -> Path | None:
    """MODEL as a local path if it looks like one (absolute, ~, ./, or an existing file/dir)."""
    try:
        if model.startswith(("/", "~", "./", "../")) or Path(model).exists():
            return Path(model).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as e:  # too long, a symlink loop, a NUL
        raise MacserveError(f"MODEL {model[:80]!r}...: not a usable path: {e}") from None
    return None


def _is_hostfile(hosts: str) -> bool:
    """HOSTS names a hostfile (a path) rather than listing hosts: host names never hold '/'."""
    return "/" in hosts or hosts.startswith("~")


def _host_entry(h: str) -> HostEntry:
    host, colon, port = h.partition(":")
    if not _HOST_RE.fullmatch(host):
        raise MacserveError(f"bad HOSTS entry {h!r}: expected host[:port],...")
    return HostEntry(host, _port("HOSTS", port) if colon else None)


def _port(key: str, v: str) -> int:
    if not v.isdigit() or not 1 <= int(v) <= 65535:
        raise MacserveError(f"bad {key} {v!r}: expected 1..65535")
    return int(v)


def _quote(value: str) -> str:
    # Plain words stay unquoted so hand-written files and ours look alike.
    return value if re.fullmatch(r"[A-Za-z0-9_./:@%+,-]+", value) else shlex.quote(value)


def decode(data: bytes, what: str) -> str:
    """A profile's (or secrets file's) bytes as text, or one line saying why they are not: a
    file that is empty, binary or not UTF-8 is refused by name, so it never becomes a
    traceback in a command that only meant to list it beside the others."""
    if not data.strip():
        raise MacserveError(f"{what}: the file is empty")
    nul = data.find(b"\0")
    if nul >= 0:
        raise MacserveError(f"{what}: binary data, not a profile (a NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MacserveError(
            f"{what}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}; "
            "save it as UTF-8)"
        ) from None


def parse(text: str, name: str, label: str | None = None) -> Profile:
    """Parse profile text; raises MacserveError naming the file line on anything odd."""
    name_ = label or f"profile {name}"
    values: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _KEY_LINE.match(line)
        if not m:
            raise MacserveError(f"{name_}: line {i}: expected KEY=VALUE, got {s!r}")
        key, raw = m.group(1), m.group(2)
        try:
            parts = shlex.split(raw, comments=True)
        except ValueError as e:
            raise MacserveError(f"{name_}: line {i}: {key}: {e}") from None
        if len(parts) > 1:
            raise MacserveError(f"{name_}: line {i}: {key} has several words; quote the value")
        values[key] = parts[0] if parts else ""
    try:
        return Profile(name, values, tuple(lines))
    except MacserveError as e:
        raise MacserveError(f"{name_}: {e}") from None


class ProfileStore:
    def __init__(self, home: Path | None = None):
        self.home = Path(home) if home else macserve_home()
        self.dir = self.home / "profiles"

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.env"

    @contextlib.contextmanager
    def lock(self, name: str | None = None):
        """Exclusive lock for a read-modify-write; blocks until the other editor is done.

        Per profile (`set` holds it through restart and rollback, so a second `set` cannot
        take the half-applied profile as its "previous" one), or store-wide with no name
        (creating a profile: the existence check and the write are one step)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lockname = f".{check_name(name)}.lock" if name else ".lock"
        with open(self.dir / lockname, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def load(self, name: str) -> Profile:
        return parse(self.text(name), name, f"profile {name} ({self.path(name)})")

    def text(self, name: str) -> str:
        """The profile file as text, read as bytes first: one line for a file that is missing,
        unreadable, empty, binary or not UTF-8."""
        p = self.path(name)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise MacserveError(f"no profile {name!r} (looked in {self.dir})") from None
        except OSError as e:
            raise MacserveError(f"profile {name} ({p}): cannot be read: {e.strerror}") from None
        return decode(data, f"profile {name} ({p})")

    def save(self, profile: Profile) -> Path:
        text = profile.to_text()
        parse(text, profile.name)  # what we write must read back
        path = self.path(profile.name)
        atomic_write(path, text)
        return path

    def delete(self, name: str) -> None:
        for p in (self.path(name), self.secrets_path(name)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    # ---- secrets: API_KEY, HF_TOKEN in NAME.secrets (0600) ------------------------------------

    def secrets_path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.secrets"

    def load_secrets(self, name: str) -> dict[str, str]:
        p = self.secrets_path(name)
        try:
            st = p.stat()
        except FileNotFoundError:
            return {}
        if st.st_mode & 0o077:
            p.chmod(0o600)  # a copy or a hand edit widened it: a secret is for this user only
        out: dict[str, str] = {}
        try:
            data = p.read_bytes()
        except OSError as e:
            raise MacserveError(f"{p}: cannot be read: {e.strerror}") from None
        if not data.strip():
            return out
        for i, line in enumerate(decode(data, str(p)).splitlines(), 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            m = _KEY_LINE.match(line)
            try:
                parts = shlex.split(m.group(2)) if m else []
            except ValueError:
                m = None  # an unbalanced quote: reported below like any other bad line
            if not m or m.group(1) not in SECRET_KEYS or len(parts) > 1:
                raise MacserveError(
                    f"{p}: line {i}: expected one of {', '.join(SECRET_KEYS)}=VALUE"
                )
            if parts:
                out[m.group(1)] = parts[0]
        return out

    def save_secrets(self, name: str, secrets: Mapping[str, str]) -> None:
        """Write (mode 0600 from the first byte: mkstemp) or, with nothing left, delete."""
        values = {k: v for k, v in secrets.items() if v}
        for k, v in values.items():
            check_secret(k, v)
        p = self.secrets_path(name)
        if not values:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            return
        text = "".join(f"{k}={shlex.quote(values[k])}\n" for k in SECRET_KEYS if k in values)
        atomic_write(p, text, 0o600)

    def names(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob("*.env") if _NAME_RE.match(p.stem))
