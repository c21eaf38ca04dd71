"""What a process tree really holds: resident memory sampled while it works.

    with TreeSampler(pid) as s:
        ...drive the server...
    s.peak_bytes, s.hwm_bytes

A server's memory is the whole tree's (a `macserve run` parent, mlx.launch's ranks on one
host, a drain shim's children): every SAMPLE_SECS the RSS of the root and all its descendants
is summed, and the peak is the largest sum seen. A spike shorter than the interval can fall
between two samples, so on Linux the kernel's own high-water mark of each process (VmHWM in
/proc/PID/status, which no sampling misses) is kept too: the sum over the tree's processes of
their HWM bounds the tree's peak from above (their peaks need not coincide). Shared pages are
counted in every process that maps them (RSS, not PSS): the figure errs on the high side, the
side a share is checked from. On macOS there is no VmHWM; the sampled peak is the figure.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil

SAMPLE_SECS = 0.05


def tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants now ([] once it has exited)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # exited between the listing and the read: it holds nothing now
    return total


def tree_rss(pid: int) -> int:
    """The tree's resident bytes now."""
    return rss(tree(pid))


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak resident bytes of one process (Linux), None where it has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class TreeSampler:
    """Samples a process tree's RSS in a thread from `start()` (or `with`) to `stop()`."""

    def __init__(self, pid: int, every: float = SAMPLE_SECS):
        self.pid = pid
        self.every = every
        self.peak_bytes = 0
        self.last_bytes = 0
        self.samples = 0
        self._hwm: dict[int, int] = {}  # pid -> the largest VmHWM read of it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        procs = tree(self.pid)
        now = rss(procs)
        for p in procs:
            h = vm_hwm(p.pid)
            if h is not None:
                self._hwm[p.pid] = max(h, self._hwm.get(p.pid, 0))
        self.samples += 1
        self.last_bytes = now
        self.peak_bytes = max(self.peak_bytes, now)
        return now

    @property
    def hwm_bytes(self) -> int | None:
        """The sum of the VmHWM of every process seen in the tree (None: not on Linux)."""
        return sum(self._hwm.values()) if self._hwm else None

    def reset_peak(self) -> None:
        """Start a new peak from now (the HWM is the kernel's: it has no reset)."""
        self.peak_bytes = self.sample()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)

    def start(self) -> TreeSampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def __enter__(self) -> TreeSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_settled(pid: int, secs: float = 1.0, every: float = 0.1, timeout: float = 30.0) -> int:
    """The tree's RSS once it stops growing for `secs` (a server's idle baseline after it
    loaded: a lazy import or a warm-up allocates for a moment after /health answers)."""
    deadline = time.monotonic() + timeout
    last, since = tree_rss(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(every)
        now = tree_rss(pid)
        if now > last * 1.01:
            since = time.monotonic()
        last = max(last, now) if now > last else now
        if time.monotonic() - since >= secs:
            break
    return last
