"""Service logs: rotation for launchd (which never truncates), tail, and follow."""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from pathlib import Path

from ... import env
from ...errors import MacserveError

MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 3
CHECK_SECONDS = 60.0  # how often a running launchd service's log size is checked


def _positive(name: str, text: str | None, default, kind):
    if text is None:
        return default
    try:
        v = kind(text)
    except ValueError:
        v = 0
    if not v > 0:
        raise MacserveError(f"{name}={text}: expected a positive number")
    return v


def max_bytes() -> int:
    """Rotate above this: MACSERVE_LOG_MAX_BYTES, else 10 MiB."""
    return _positive("MACSERVE_LOG_MAX_BYTES", env.log_max_bytes(), MAX_BYTES, int)


def check_seconds() -> float:
    return _positive("MACSERVE_LOG_CHECK_SECONDS", env.log_check_seconds(), CHECK_SECONDS, float)


def rotate(path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> bool:
    """Copy-truncate `path` when it exceeds max_bytes: launchd keeps the file open with O_APPEND,
    so renaming would leave it writing into the old inode; truncating in place is safe."""
    path = Path(path)
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for i in range(backups - 1, 0, -1):
        src = path.with_name(f"{path.name}.{i}")
        if src.exists():
            os.replace(src, path.with_name(f"{path.name}.{i + 1}"))
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with open(path, "r+b") as f:
        f.truncate(0)
    return True


def size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except FileNotFoundError:
        return 0


def tail(path: Path, n: int = 20, since: int = 0, until: int | None = None) -> list[str]:
    """Last n lines of `path` between byte offsets `since` and `until` (if the file was rotated
    and is now shorter than `since`, from its start)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell() if until is None else min(until, f.tell())
            f.seek(since if since <= end else 0)
            # Read at most the last 256 KiB: enough for n lines of any sane server log.
            start = max(f.tell(), end - 256 * 1024)
            f.seek(start)
            data = f.read(end - start)
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return list(deque(lines, maxlen=n)) if n > 0 else []


def follow(path: Path, n: int, out, poll: float = 0.5, stop=lambda: False) -> None:
    """`tail -f`: print the last n lines, then new ones as they arrive (copes with truncation)."""
    pos = size(path)  # first, so a line written while the tail prints is not lost
    for line in tail(path, n, until=pos):
        out(line)
    buf = b""
    while not stop():
        cur = size(path)
        if cur < pos:  # rotated/truncated
            pos, buf = 0, b""
        if cur > pos:
            with open(path, "rb") as f:
                f.seek(pos)
                buf += f.read(cur - pos)
            pos = cur
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                out(raw.decode("utf-8", "replace"))
        else:
            time.sleep(poll)
