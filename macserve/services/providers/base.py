"""What every provider shares: URLs, `--help` flag checking, and `BaseProvider`.

See providers/__init__.py for the interface a provider implements.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

from ... import env
from ...errors import MacserveError
from ...fileio import atomic_write
from ..profiles import MODELLESS, ROUTER_KEYS, Profile, check_secret


def url_host(host: str) -> str:
    """The address a client uses to reach a server bound to `host`."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def base_url(profile: Profile) -> str:
    return f"http://{url_host(profile.host)}:{profile.port}"


# ---- flag checking against the installed server's --help -------------------------------------

_OPT_LINE = re.compile(r"^( {0,4})(-\S.*)$")


def flags_from_help(text: str) -> dict[str, bool]:
    """{flag: takes_value} from a llama.cpp- or argparse-style help text.

    Option lines start (at most 4 spaces in) with '-': "-c,    --ctx-size N   description" or
    "  --model MODEL   description". Description continuation lines are indented further, so
    a '- row: ...' bullet inside a description is not mistaken for a flag.
    """
    return {flag: takes for flag, (_, takes) in flag_table(text).items()}


def flag_table(text: str) -> dict[str, tuple[str, bool]]:
    """{flag: (its canonical name, takes_value)}: the aliases on one help line (`-c, --ctx-size N`)
    share the canonical name (the last one listed), so `-c` and `--ctx-size` are one flag."""
    table: dict[str, tuple[str, bool]] = {}
    for line in text.splitlines():
        m = _OPT_LINE.match(line)
        if not m:
            continue
        # llama.cpp pads after "-c," to align columns: squeeze that before cutting at the
        # two-space gap that separates the option spec from its description.
        spec = re.sub(r",\s+", ", ", m.group(2).strip())
        spec = re.split(r"\s{2,}", spec, maxsplit=1)[0]
        parts = [p.strip() for p in spec.split(", ")]
        takes = any(" " in p or "=" in p for p in parts)
        names = [p.split(" ", 1)[0].split("=", 1)[0] for p in parts]
        names = [n for n in names if re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_.-]*", n)]
        for n in names:
            table[n] = (names[-1], takes)
    return table


def is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not re.fullmatch(r"-\d.*", arg)


def normalize_flag(flag: str) -> str:
    # llama.cpp (and click) accept --ctx_size for --ctx-size
    return flag.replace("_", "-") if flag.startswith("--") else flag


def flag_groups(
    args: list[str], table: dict[str, tuple[str, bool]]
) -> list[tuple[str | None, list[str]]]:
    """EXTRA_ARGS as (canonical flag or None for a stray value, [flag, value?]) groups. A flag
    the table does not know takes the next word when that word is not a flag."""
    out: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not is_flag(a):
            out.append((None, [a]))
            i += 1
            continue
        flag, eq, _ = a.partition("=")
        norm = normalize_flag(flag)
        canon, takes = table.get(norm, (norm, None))
        if takes is None:
            takes = i + 1 < len(args) and not is_flag(args[i + 1])
        if takes and not eq and i + 1 < len(args):
            out.append((canon, [a, args[i + 1]]))
            i += 2
        else:
            out.append((canon, [a]))
            i += 1
    return out


def flag_value(args: tuple[str, ...] | list[str], *names: str) -> str | None:
    """The value of the last of `names` in `args` (`-c 512`, `--ctx-size=512`), or None."""
    value = None
    for i, a in enumerate(args):
        flag, eq, v = a.partition("=")
        if normalize_flag(flag) in names:
            value = v if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def edit_flags(
    args: list[str],
    add: list[str],
    drop: list[str],
    table: dict[str, tuple[str, bool]],
) -> list[str]:
    """`EXTRA_ARGS+=` / `EXTRA_ARGS-=`: each flag in `add` replaces the same flag (any alias) in
    place, or is appended; each flag in `drop` is removed with its value."""
    groups = flag_groups(args, table)
    # flags to drop are named without values: each is looked up alone
    gone = {table.get(normalize_flag(f), (normalize_flag(f), None))[0] for f in drop if is_flag(f)}
    groups = [(c, g) for c, g in groups if c is None or c not in gone]
    for canon, new in flag_groups(add, table):
        at = [i for i, (c, _) in enumerate(groups) if canon is not None and c == canon]
        if at:
            groups[at[0]] = (canon, new)
            groups = [g for i, g in enumerate(groups) if i not in at[1:]]
        else:
            groups.append((canon, new))
    return [a for _, g in groups for a in g]


def help_text(cmd: list[str], key_path: str) -> str:
    """`cmd --help` output, cached on disk per binary path + mtime + size (help runs are slow:
    mlx_lm imports mlx). A rebuilt or upgraded binary gets a new key, so the cache never lies."""
    try:
        st = os.stat(key_path)
    except OSError:
        raise MacserveError(f"{key_path} not found") from None
    ident = f"{os.path.realpath(key_path)}\0{st.st_mtime_ns}\0{st.st_size}\0{cmd}"
    cache = env.home() / "cache" / f"help-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.txt"
    try:
        return cache.read_text()
    except OSError:
        pass
    try:
        r = subprocess.run(
            cmd + ["--help"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MacserveError(f"could not run {shlex.join(cmd)} --help: {e}") from None
    text = r.stdout + "\n" + r.stderr
    if r.returncode != 0 or not flags_from_help(text):
        raise MacserveError(f"{shlex.join(cmd)} --help failed (exit {r.returncode})")
    atomic_write(cache, text)
    return text


def help_flags(cmd: list[str], key_path: str) -> dict[str, bool]:
    return flags_from_help(help_text(cmd, key_path))


def removed_flags(text: str) -> dict[str, str]:
    """Flags llama.cpp still lists but rejects at start ("the argument has been removed. use
    --spec-draft-n-max ..."): {flag: that message}. Listing them is how it points to the new name."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _OPT_LINE.match(line)
        if not m:
            continue
        parts = re.split(r"\s{2,}", re.sub(r",\s+", ", ", m.group(2).strip()), maxsplit=1)
        desc = parts[1] if len(parts) > 1 else ""
        if "has been removed" not in desc:
            continue
        for cont in lines[i + 1 :]:
            c = cont.strip()
            if not cont.startswith(" " * 8) or not c or c.startswith("(env:"):
                break
            desc += " " + c
        for p in parts[0].split(", "):
            out[p.split(" ", 1)[0]] = " ".join(desc.split())
    return out


def check_flags(
    args: list[str],
    flags: dict[str, bool],
    what: str,
    reserved: dict[str, str] | None = None,
    removed: dict[str, str] | None = None,
) -> None:
    """Refuse unknown or removed flags, a value-taking flag at the end, and flags macserve sets
    itself."""
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("-") or re.fullmatch(r"-\d.*", a) or a == "-":
            continue  # a value, or a negative number
        flag, eq, _ = a.partition("=")
        norm = flag.replace("_", "-") if flag.startswith("--") else flag
        if norm not in flags:
            raise MacserveError(f"{what} does not accept {flag} (checked against its --help)")
        if removed and norm in removed:
            raise MacserveError(f"{what}: {flag}: {removed[norm]}")
        if reserved and norm in reserved:
            raise MacserveError(
                f"{flag} is set by macserve from the profile; use the {reserved[norm]} key"
            )
        if flags[norm] and not eq:
            if i >= len(args):
                raise MacserveError(f"{flag} expects a value")
            i += 1


def cli_parse(command: str, args: list[str]) -> None:
    """`macserve COMMAND`'s own click parser on `args` (types, ranges, choices, unknown
    options), run as `macserve parse-args COMMAND ...` in a subprocess: services never import
    the CLI. One-line MacserveError with click's reason."""
    here = str(Path(__file__).resolve().parents[3])  # this checkout (or site-packages)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "macserve", "parse-args", command, "--", *args],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=path),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MacserveError(f"could not check the macserve {command} options: {e}") from None
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"exit {r.returncode}"
        raise MacserveError(why)


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
    upstream_model: str | None = None

    def command(self) -> list[str]:  # the server executable (+ fixed args), for argv and --help
        raise NotImplementedError

    def binary_path(self) -> str:  # the file whose mtime keys the help cache
        return self.command()[0]

    def model_args(self, profile: Profile) -> list[str]:
        raise NotImplementedError

    def argv(self, profile: Profile) -> list[str]:
        return (
            self.command()
            + self.model_args(profile)
            + ["--host", profile.host, "--port", str(profile.port)]
            + self.typed_args(profile)
            + list(profile.extra_args)
        )

    def typed_args(self, profile: Profile) -> list[str]:
        """CTX and KV as this server's flags."""
        out = (self.context_args(profile.ctx) or []) if profile.ctx else []
        return out + (self.kv_args(profile.kv) if profile.kv else [])

    def taken(self, profile: Profile) -> dict[str, str]:
        """{flag: profile key}: the flags macserve sets from the profile, which EXTRA_ARGS may
        not repeat."""
        return {
            **self.reserved,
            **self.secret_flags,
            **dict.fromkeys(self.ctx_flags, "CTX"),
            **dict.fromkeys(self.kv_flags, "KV"),
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
        if profile.ctx and not self.formats:
            raise MacserveError(f"CTX is for a server of a model, not for {self.label}")
        if profile.provider in MODELLESS:
            for key in ROUTER_KEYS:
                if profile.values.get(key):
                    raise MacserveError(
                        f"{key} is for profiles that serve a model behind the router, "
                        f"not for {self.label}"
                    )

    def check_args(self, profile: Profile) -> None:
        self.validate(profile)
        text = help_text(self.command(), self.binary_path())
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
        if not (self.ctx_flags or self.kv_flags) or not profile.extra_args:
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
        set_ = ", ".join(f"{k}={new.values[k]}" for k in ("CTX", "KV") if k in new.values)
        return new, (
            f"moved {', '.join(moved)} out of EXTRA_ARGS into "
            f"{set_ or 'the profile (the default, so no key)'}: CTX and KV are profile keys now"
        )

    def one_cache_type(self, profile: Profile) -> bool:
        """Whether the cache flags in EXTRA_ARGS name one cache type that KV can say (llama.cpp
        types its K and V caches apart: a mix stays in EXTRA_ARGS)."""
        return True

    def _lifted_key(self, flag: str, value: str, kv_too: bool) -> tuple[str, str | None] | None:
        """(CTX or KV, its value) for one EXTRA_ARGS flag, or None to keep the flag there."""
        if flag in self.ctx_flags and value.isdigit():
            return "CTX", value if int(value) > 0 else None  # 0: the model's limit, no CTX
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
