"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path):
    """A temp path in `path`'s directory for a writer that wants a file name (a library that
    writes the file itself, e.g. mx.save_safetensors); once the block ends it is fsynced and
    renamed to `path`, and the directory fsynced, as `atomic_write` does. An error leaves
    nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory (fsync, chmod, os.replace), then fsync the
    directory so the rename itself survives a power cut. The temp file is made 0600 by
    mkstemp, so a secret is never readable by others even before the chmod."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
