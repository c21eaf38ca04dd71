"""Profiles: one human-editable `KEY=VALUE` file per served model, and the store that keeps them.

A profile lives in `$MACSERVE_HOME/profiles/NAME.env` (default `~/.config/macserve`). Values use
shell quoting (`EXTRA_ARGS='-c 8192 --threads 8'`), so the file can be read by a person, by
`shlex`, and by `source` in a shell. Comments and blank lines are kept when macserve rewrites a
file: `set` changes the value in place instead of regenerating the file.

Keys:
  PROVIDER    llama.cpp | mlx | macserve | llama.cpp-rpc (required; the last is an RPC worker)
  MODEL       path, HF repo id, or repo:QUANT         (required, except for llama.cpp-rpc)
  PORT        1..65535                                (required)
  HOST        bind address, default 127.0.0.1
  EXTRA_ARGS  provider flags, split with shlex (never through a shell)
  HOSTS       serve across several Macs. mlx: IPs/hosts `a,b,...` (first = this head host,
              rank 0) or a path to an mlx.launch hostfile (JSON). llama.cpp: the RPC workers,
              `host[:port],...` (port default 50052), this head not included
  BACKEND     ring | jaccl (mlx.launch backends; mlx default ring) | rpc (llama.cpp, its default)
  SHARDING    pipeline | tensor: how mlx-lm splits the model over HOSTS (default pipeline)
  SPLIT       pipeline layers per HOSTS entry, `n1,n2,...` (mlx; default: mlx-lm's even split).
              `macserve inspect --memory A,B` prints the split in proportion to each host's budget
  PARALLEL    reserved; validated as a positive integer, not used yet.

Writes are atomic (temp file in the same directory, fsync, os.replace, fsync of the directory),
and every read-modify-write holds an exclusive flock (`profiles/.NAME.lock` per profile,
`profiles/.lock` to create one), so two `macserve set` runs cannot interleave, and a crash
mid-write leaves the old file intact.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MacserveError

# Provider names a profile may name. The registry in macserve.providers maps each to a module;
# the list lives here so profiles never import providers (data flows one way).
PROVIDER_NAMES = ("llama.cpp", "mlx", "macserve", "llama.cpp-rpc")
# llama.cpp-rpc is an RPC worker (rpc-server) for another Mac's llama-server: it serves no model.
MODELLESS = ("llama.cpp-rpc",)

KEYS = ("PROVIDER", "MODEL", "HOST", "PORT", "EXTRA_ARGS", "HOSTS", "BACKEND", "SHARDING",
        "SPLIT", "PARALLEL")
REQUIRED = ("PROVIDER", "MODEL", "PORT")
DEFAULTS = {"HOST": "127.0.0.1", "EXTRA_ARGS": ""}
BACKENDS = ("", "rpc", "ring", "jaccl")  # multi-Mac transports: rpc for llama.cpp, the rest mlx
SHARDINGS = ("", "pipeline", "tensor")

# Names become file names, launchd labels (dev.macserve.NAME) and supervisor program names,
# so keep them to characters all three accept.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def macserve_home() -> Path:
    return Path(os.environ.get("MACSERVE_HOME") or Path.home() / ".config" / "macserve")


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or "") or name.endswith(".env"):
        raise MacserveError(
            f"bad profile name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)"
        )
    return name


@dataclass
class Profile:
    name: str
    values: dict[str, str] = field(default_factory=dict)
    # Original file lines, kept so a rewrite preserves the user's comments and order.
    lines: list[str] = field(default_factory=list, repr=False)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key) or DEFAULTS.get(key) or default

    @property
    def provider(self) -> str:
        return self.values["PROVIDER"]

    @property
    def model(self) -> str:
        return self.values.get("MODEL", "")

    @property
    def host(self) -> str:
        return self.get("HOST") or "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.values["PORT"])

    @property
    def extra_args(self) -> list[str]:
        return shlex.split(self.values.get("EXTRA_ARGS", ""))

    def updated(self, changes: dict[str, str]) -> "Profile":
        """A copy with `changes` applied; an empty value removes an optional key."""
        values = dict(self.values)
        for k, v in changes.items():
            if v == "" and k not in REQUIRED:
                values.pop(k, None)
            else:
                values[k] = v
        return Profile(self.name, values, list(self.lines))

    def validate(self) -> "Profile":
        validate_values(self.values)
        return self

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


def _quote(value: str) -> str:
    # Plain words stay unquoted so hand-written files and ours look alike.
    return value if re.fullmatch(r"[A-Za-z0-9_./:@%+,-]+", value) else shlex.quote(value)


def parse(text: str, name: str) -> Profile:
    """Parse profile text; raises MacserveError naming the file line on anything odd."""
    values: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _KEY_LINE.match(line)
        if not m:
            raise MacserveError(f"profile {name}: line {i}: expected KEY=VALUE, got {s!r}")
        key, raw = m.group(1), m.group(2)
        try:
            parts = shlex.split(raw, comments=True)
        except ValueError as e:
            raise MacserveError(f"profile {name}: line {i}: {key}: {e}") from None
        if len(parts) > 1:
            raise MacserveError(
                f"profile {name}: line {i}: {key} has several words; quote the value"
            )
        values[key] = parts[0] if parts else ""
    p = Profile(name, values, lines)
    try:
        validate_values(values)
    except MacserveError as e:
        raise MacserveError(f"profile {name}: {e}") from None
    return p


def validate_values(values: dict[str, str]) -> None:
    """One-line errors for the first problem found."""
    for key in values:
        if key not in KEYS:
            raise MacserveError(f"unknown key {key} (known: {', '.join(KEYS)})")
    for key in REQUIRED:
        if key == "MODEL" and values.get("PROVIDER") in MODELLESS:
            continue
        if not values.get(key):
            raise MacserveError(f"{key} is required")
    if values["PROVIDER"] not in PROVIDER_NAMES:
        raise MacserveError(
            f"unknown provider {values['PROVIDER']!r} (known: {', '.join(PROVIDER_NAMES)})"
        )
    _check_port("PORT", values["PORT"])
    host = values.get("HOST", "")
    if host and not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]+", host):
        raise MacserveError(f"bad HOST {host!r}")
    try:
        shlex.split(values.get("EXTRA_ARGS", ""))
    except ValueError as e:
        raise MacserveError(f"EXTRA_ARGS does not parse: {e}") from None
    hosts = values.get("HOSTS", "")
    for h in [] if is_hostfile(hosts) else filter(None, (x.strip() for x in hosts.split(","))):
        hostpart, _, port = h.partition(":")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", hostpart):
            raise MacserveError(f"bad HOSTS entry {h!r}: expected host[:port],...")
        if port or h.endswith(":"):
            _check_port("HOSTS", port)
    if values.get("BACKEND", "") not in BACKENDS:
        raise MacserveError(f"unknown BACKEND {values['BACKEND']!r} (known: {', '.join(BACKENDS[1:])})")
    if values.get("SHARDING", "") not in SHARDINGS:
        raise MacserveError(f"unknown SHARDING {values['SHARDING']!r} (known: pipeline, tensor)")
    if values.get("SPLIT") and not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)+", values["SPLIT"]):
        raise MacserveError(f"bad SPLIT {values['SPLIT']!r}: expected layer counts n1,n2,... "
                            "(one per HOSTS entry, each >= 1)")
    if values.get("PARALLEL"):
        if not values["PARALLEL"].isdigit() or int(values["PARALLEL"]) < 1:
            raise MacserveError(f"bad PARALLEL {values['PARALLEL']!r}: expected a positive integer")


def is_hostfile(hosts: str) -> bool:
    """HOSTS names a hostfile (a path) rather than listing hosts: host names never hold '/'."""
    return "/" in hosts or hosts.startswith("~")


def _check_port(key: str, v: str) -> None:
    if not v.isdigit() or not 1 <= int(v) <= 65535:
        raise MacserveError(f"bad {key} {v!r}: expected 1..65535")


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory so readers see the old or new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # fsync the directory so the rename itself survives a power cut.
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


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
        p = self.path(name)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise MacserveError(f"no profile {name!r} (looked in {self.dir})") from None
        return parse(text, name)

    def save(self, profile: Profile) -> Path:
        profile.validate()
        text = profile.to_text()
        parse(text, profile.name)  # what we write must read back
        path = self.path(profile.name)
        atomic_write(path, text)
        return path

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(name).unlink()

    def names(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob("*.env") if _NAME_RE.match(p.stem))
