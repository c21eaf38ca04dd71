"""What a running profile's server really holds: resident memory now and its peak since start,
to set beside the share it was admitted with (services/share.py).

Two readings, the larger taken, each named:

- the process tree (the server and its children: a `macserve run` wrapper, mlx-lm's drain
  shim, llama-server's workers): RSS now, and on Linux the peak, `VmHWM` of
  /proc/PID/status summed over the tree (each process's own high-water mark; the sum can
  exceed what was ever held at one instant, never fall short of it). macOS has no per-process
  peak that psutil reads: there the peak is unknown for a server that does not report its own;
- the server's own figures, where it reports them on /metrics: macserve's engine exports MLX's
  `macserve_memory_active_bytes` and `macserve_memory_peak_bytes`. On Linux MLX allocates with
  malloc, so the tree's RSS already counts those arrays (and the runtime beside them); on a Mac
  Metal's buffers need not show in RSS, so MLX's figure can be the larger.

Pure parsing (`parse_status`, `parse_metrics`, `combine`) is tested without a process.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from .health import base_url, store
from .supervisors import get_backend

ACTIVE, PEAK = "macserve_memory_active_bytes", "macserve_memory_peak_bytes"
TIMEOUT = 3.0
PROC = Path("/proc")


@dataclass(frozen=True)
class Resident:
    """A running server's memory: `now_bytes` and `peak_bytes` (None: not known), and what
    each came from."""

    pid: int | None
    now_bytes: int | None
    peak_bytes: int | None
    source: str  # e.g. "RSS of 3 processes; peak: VmHWM summed"
    rss_bytes: int | None = None  # the tree's RSS now
    hwm_bytes: int | None = None  # the tree's summed VmHWM (Linux)
    engine_now_bytes: int | None = None  # the server's own figure (/metrics), where it has one
    engine_peak_bytes: int | None = None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


NOT_RUNNING = Resident(None, None, None, "not running")


def parse_status(text: str) -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) in bytes from a /proc/PID/status text; None for a line it lacks (a
    kernel thread, a zombie)."""
    got: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                unit = parts[1].lower() if len(parts) > 1 else "kb"
                got[key] = int(parts[0]) * (1024 if unit == "kb" else 1)
    return got.get("VmRSS"), got.get("VmHWM")


def parse_metrics(text: str) -> tuple[int | None, int | None]:
    """(active, peak) from a server's Prometheus text: the engine's MLX figures; (None, None)
    when it exports neither (llama-server, an engine without them)."""
    vals: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in (ACTIVE, PEAK):
            try:
                vals[name] = int(float(rest.split()[0]))
            except (ValueError, IndexError):
                continue
    return vals.get(ACTIVE), vals.get(PEAK)


def _max(*xs: int | None) -> int | None:
    known = [x for x in xs if x is not None]
    return max(known) if known else None


def combine(
    pid: int,
    tree: tuple[int | None, int | None, int],
    engine: tuple[int | None, int | None],
    peak_known: bool,
) -> Resident:
    """One reading from the tree's (rss, hwm, processes) and the server's own (now, peak)."""
    rss, hwm, count = tree
    e_now, e_peak = engine
    now, peak = _max(rss, e_now), _max(hwm, e_peak)
    procs = f"{count} process" + ("es" if count != 1 else "")
    parts = [f"RSS of {procs}"]
    if peak_known:
        parts.append("peak: VmHWM summed")
    if e_now is not None or e_peak is not None:
        parts.append("and the server's /metrics (MLX), the larger")
    note = ""
    if not peak_known and e_peak is None:
        note = f"{platform.system()} gives no per-process peak: only the figure now is known"
    return Resident(
        pid, now, peak, "; ".join(parts), rss, hwm if peak_known else None, e_now, e_peak, note
    )


def tree(pid: int) -> tuple[int | None, int | None, int, bool]:
    """(RSS, summed VmHWM, processes, whether the peak is known) of `pid` and its children."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None, None, 0, False
    rss = hwm = 0
    peak_known = PROC.is_dir()
    count = 0
    for p in procs:
        try:
            r = p.memory_info().rss
        except psutil.Error:
            continue  # gone between the listing and the read
        count += 1
        rss += r
        if peak_known:
            try:
                _, h = parse_status((PROC / str(p.pid) / "status").read_text())
            except OSError:
                h = None
            hwm += h if h is not None else r
    return (rss if count else None), (hwm if count and peak_known else None), count, peak_known


def engine_figures(url: str, key: str | None = None) -> tuple[int | None, int | None]:
    """The server's own (active, peak) from its /metrics; (None, None) when it has none or
    does not answer within TIMEOUT."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=TIMEOUT)
    except httpx.HTTPError:
        return None, None
    return parse_metrics(r.text) if r.status_code == 200 else (None, None)


def resident(pid: int | None, url: str | None = None, key: str | None = None) -> Resident:
    """The server at `pid` (its supervisor's pid) and, when `url` is given, its /metrics."""
    if not pid:
        return NOT_RUNNING
    rss, hwm, count, peak_known = tree(pid)
    if not count:
        return NOT_RUNNING
    eng = engine_figures(url, key) if url else (None, None)
    return combine(pid, (rss, hwm, count), eng, peak_known)


def of_profile(name: str, backend=None) -> Resident:
    """A profile's server as its supervisor runs it now (NOT_RUNNING when it does not)."""
    st = (backend or get_backend()).status(name)
    if st.state not in ("running", "starting", "orphaned") or not st.pid:
        return NOT_RUNNING
    s = store()
    p = s.load(name)
    return resident(st.pid, base_url(p), s.load_secrets(name).get("API_KEY"))


# ---- the machine -------------------------------------------------------------------------------


def free_bytes() -> int:
    """Memory the system can give a new process now without swapping: psutil's `available`
    (Linux: MemAvailable; macOS: free + inactive pages, what `vm_stat` calls so)."""
    return int(psutil.virtual_memory().available)


def total_bytes() -> int:
    return int(psutil.virtual_memory().total)


def top_holders(n: int = 3, exclude: frozenset[int] = frozenset()) -> list[tuple[str, int, int]]:
    """The `n` processes holding the most resident memory now: (name, pid, rss), for a refusal
    that says where the memory went."""
    out = []
    for p in psutil.process_iter(["name", "memory_info"]):
        mi = p.info.get("memory_info")
        if mi is None or p.pid in exclude:
            continue
        out.append((p.info.get("name") or "?", p.pid, int(mi.rss)))
    out.sort(key=lambda t: -t[2])
    return out[:n]
