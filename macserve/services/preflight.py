"""Pre-flight for a multi-host `mlx` profile (HOSTS): before mlx.launch starts the group, check
every host it would reach over ssh.

    result = run(profile)          # one HostCheck per rank, in HOSTS order (rank 0 first)
    check(profile)                 # MacserveError with one line per problem, joined by "; "

For each entry other than the literal 127.0.0.1 (mlx.launch runs those locally), one remote
command over `ssh -o BatchMode=yes -o ConnectTimeout=5 HOST` prints JSON: Python, mlx and
mlx-lm versions, whether MODEL exists there, total memory. It runs the interpreter mlx.launch
will run on that host (`--python`: this process's own sys.executable), so the versions are
the ones the rank will import. Then:
- reachable (ssh exit 255: not reachable);
- Python, mlx, mlx-lm major.minor equal to this (head) host's;
- MODEL present at the same path (skipped for a repo id: each rank downloads its share);
- weights for its share within its GPU budget (sizing.budget.machine_budget of its RAM): the
  share is mlx-lm's own split, which `sharded_load` makes even (rank 0 runs the last layers,
  low ranks get the extra layer), with the bytes per layer from sizing.hosts.weights_split; under
  SHARDING=tensor every rank holds the same 1/N share. Weights only: the KV cache needs room on
  top. Skipped with a note when the weights are unknown (MODEL not on this host).

`MACSERVE_SSH` replaces the ssh program (tests point it at a stand-in that runs the remote
command locally).
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata

from .. import env
from ..errors import MacserveError
from ..sizing.budget import machine_budget
from ..sizing.hosts import Weights, runtime_ranges, weights_split
from ..sizing.report import inspect_source
from .profiles import Profile, local_model_path

LOCAL = "127.0.0.1"
SSH_TIMEOUT = 60.0

# Runs on each host as `PYTHON -c REMOTE MODEL`; prints one JSON object.
REMOTE = r"""
import json, os, platform, subprocess, sys
from importlib import metadata
def v(p):
    try:
        return metadata.version(p)
    except Exception:
        return None
try:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
except (ValueError, OSError, AttributeError):
    try:
        mem = int(subprocess.check_output(["sysctl", "-n", "hw.memsize"]))
    except Exception:
        mem = None
m = os.path.expanduser(sys.argv[1])
print(json.dumps({"python": platform.python_version(), "mlx": v("mlx"), "mlx_lm": v("mlx-lm"),
                  "macserve": v("macserve"), "model": os.path.exists(m), "memory_bytes": mem}))
""".strip()


def ssh_program() -> str:
    return env.ssh()


def remote(argv: list[str], timeout: float = SSH_TIMEOUT) -> subprocess.CompletedProcess:
    """The one place a host is contacted: run `argv` (an ssh command line), capture output."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 255, "", f"no answer in {timeout:g} s")
    except FileNotFoundError:
        raise MacserveError(f"{argv[0]} not found (pre-flight needs ssh)") from None


def ssh_argv(host: str, python: str, model: str) -> list[str]:
    # ssh joins the words after the host into one shell command line: quote them.
    cmd = " ".join(shlex.quote(x) for x in (python, "-c", REMOTE, model))
    return [ssh_program(), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, cmd]


def hosts_of(profile: Profile) -> list[str]:
    """The ssh names of the ranks, rank 0 first (a hostfile's `ssh` fields, or the list)."""
    if profile.hostfile is None:
        return [h.host for h in profile.hosts]
    try:
        data = json.loads(profile.hostfile.read_text())
        entries = data["hosts"] if isinstance(data, dict) else data
        return [str(e["ssh"]) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MacserveError(
            f"HOSTS hostfile {profile.values['HOSTS']}: cannot read its hosts ({e})"
        ) from None


def needs_preflight(profile: Profile) -> bool:
    return profile.multi_host and any(h != LOCAL for h in hosts_of(profile))


def head_versions() -> dict:
    def v(p):
        try:
            return metadata.version(p)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "mlx": v("mlx"), "mlx_lm": v("mlx-lm")}


@dataclass
class HostCheck:
    rank: int
    host: str
    local: bool = False
    facts: dict | None = None
    layers: tuple | None = None  # (start, end) of its pipeline share, end exclusive
    need_bytes: int | None = None
    budget_bytes: int | None = None
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Result:
    hosts: list
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def error(self) -> str | None:
        bad = [f"host {h.host}: {p}" for h in self.hosts for p in h.problems]
        return "pre-flight: " + "; ".join(bad) if bad else None


def _mm(v: str | None) -> tuple | None:
    return tuple(v.split(".")[:2]) if v else None


def _weights(profile: Profile) -> tuple[Weights | None, str | None]:
    path = local_model_path(profile.model)
    if path is None or not path.exists():
        return None, "the model is not on this host, its weights are unknown"
    config = path / "config.json" if path.is_dir() else path
    try:
        st = config.stat()
    except OSError:
        st = None
    return _weights_of(str(path), st and (st.st_mtime_ns, st.st_size))


@lru_cache(maxsize=8)
def _weights_of(path: str, stamp) -> tuple[Weights | None, str | None]:
    """Read once per model file version: SPLIT's check and the pre-flight of one `set` both
    need it (`stamp` is the config's mtime and size, so an edited model is read again)."""
    try:
        return weights_split(inspect_source(path)), None
    except MacserveError as e:
        return None, f"weights unknown ({e})"


def model_layers(profile: Profile) -> int | None:
    """The trunk's layer count when MODEL is on this host, else None."""
    w, _ = _weights(profile)
    return None if w is None else len(w.layers)


def shares(profile: Profile, n: int) -> tuple[list | None, str | None]:
    """Per rank (layers, weight bytes) of the split mlx-lm will run, or (None, why not)."""
    w, why = _weights(profile)
    if w is None:
        return None, f"memory not checked: {why}"
    layers = len(w.layers)
    if profile.sharding == "tensor":
        need = w.outer + sum(s / n + k for s, k in w.layers)
        return [((0, layers), round(need))] * n, None
    if layers < n:
        return None, f"memory not checked: {n} ranks for {layers} layers"
    if profile.split:
        split = list(profile.split)
        if len(split) != n or sum(split) != layers:
            return None, f"memory not checked: SPLIT {profile.values['SPLIT']} does not fit"
    else:  # mlx-lm's even split: the low ranks get the extra layers
        base, extra = divmod(layers, n)
        split = [base + (1 if r < extra else 0) for r in range(n)]
    return [
        ((a, z), round(w.outer + sum(s + k for s, k in w.layers[a:z])))
        for a, z in runtime_ranges(split)
    ], None


def _gb(b) -> str:
    return f"{b / 2**30:,.1f} GB"


def _judge(
    c: HostCheck,
    proc: subprocess.CompletedProcess,
    head: dict,
    model: str,
    model_is_path: bool,
    macserve: str | None = None,
) -> None:
    err = (proc.stderr or "").strip().splitlines()
    last = err[-1].strip() if err else ""
    if proc.returncode == 255:
        c.problems.append(
            "not reachable over ssh"
            + (f" ({last})" if last else "")
            + "; needs passwordless ssh from this host"
        )
        return
    if proc.returncode != 0:
        c.problems.append(
            f"the remote check failed (exit {proc.returncode}" + (f": {last}" if last else "") + ")"
        )
        return
    try:
        f = json.loads(proc.stdout.strip().splitlines()[-1])
        assert isinstance(f, dict)
    except (ValueError, IndexError, AssertionError):
        c.problems.append(f"unexpected output from the remote check: {proc.stdout.strip()[:80]!r}")
        return
    c.facts = f
    for key, label in (("python", "Python"), ("mlx", "mlx"), ("mlx_lm", "mlx-lm")):
        there, here = f.get(key), head.get(key)
        if there is None:
            c.problems.append(f"{label} not installed there ({label} {here} here)")
        elif _mm(there) != _mm(here):
            c.problems.append(f"{label} {there} there, {here} here (major.minor must match)")
    if macserve and not f.get("macserve"):
        c.problems.append(f"macserve not installed there ({macserve}: pip install macserve there)")
    if model_is_path and not f.get("model"):
        c.problems.append(
            f"model {model} not found there (copy it to the same path, e.g. "
            f"rsync -a {model}/ {c.host}:{model}/)"
        )


def run(profile: Profile, macserve: str | None = None) -> Result:
    """The checks of every host. `macserve`: why each host needs macserve installed (the
    provider's `macserve_on_hosts`, which this module cannot ask: providers call it); None:
    not checked."""
    hosts = hosts_of(profile)
    head = head_versions()
    model_is_path = local_model_path(profile.model) is not None
    model = str(local_model_path(profile.model)) if model_is_path else profile.model
    checks = [HostCheck(r, h, local=h == LOCAL) for r, h in enumerate(hosts)]
    remote_checks = [c for c in checks if not c.local]
    with ThreadPoolExecutor(max_workers=min(8, len(remote_checks) or 1)) as ex:
        procs = list(
            ex.map(lambda c: remote(ssh_argv(c.host, sys.executable, model)), remote_checks)
        )
    for c, p in zip(remote_checks, procs):
        _judge(c, p, head, model, model_is_path, macserve)
    notes = []
    if not model_is_path:
        notes.append(
            f"MODEL {profile.model} is not a path: not checked on the hosts "
            "(each rank downloads its share)"
        )
    per, why = shares(profile, len(hosts))
    if per is None:
        notes.append(why or "memory not checked")
    else:
        notes.append("memory: weights of each host's share only; the KV cache needs room on top")
        for c, (rng, need) in zip(checks, per):
            c.layers, c.need_bytes = rng, need
            if c.local or not c.facts:
                continue
            mem = c.facts.get("memory_bytes")
            if not mem:
                c.problems.append("memory not reported: share not checked")
                continue
            c.budget_bytes = machine_budget(int(mem)).budget_bytes
            if need > c.budget_bytes:
                a, z = rng
                c.problems.append(
                    f"needs {_gb(need)} for its share (layers {a}-{z - 1}) but "
                    f"has a {_gb(c.budget_bytes)} GPU budget ({_gb(mem)} RAM)"
                )
    return Result(checks, notes)


def check(profile: Profile, macserve: str | None = None) -> None:
    """Raise one line naming each host and what is wrong; nothing when all hosts are fit."""
    if not needs_preflight(profile):
        return
    err = run(profile, macserve).error()
    if err:
        raise MacserveError(err)
