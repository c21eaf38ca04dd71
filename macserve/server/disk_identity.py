"""What a stored prompt cache is only valid for (disk_cache.py): the model's config and the
contents of its weight files, the calibration file's contents and method, and the cache's
format, kind, INT2 layout and dtype.

The weights count by their bytes, not their names and sizes: a fine-tune or any same-shape
checkpoint written over the old files (`macserve dev train-tiny`) keeps every name and size,
and its KV differs. Each file's sha256 is computed once and kept in `weights-sha256.json`
beside the prompt cache's folders, keyed by the file's resolved path, size, mtime_ns,
ctime_ns, device and inode: any write to the file, in place or by rename, changes one of
these (ctime cannot be set back by a copy that keeps mtime), so the hash is read again. A file
changed within RACY seconds of its hash is not recorded (a write in the same timestamp tick
as the hash would leave its stat as it was): it is hashed again at the next start.

Cost: the first start after a change reads the weights once more (files hashed in parallel,
one thread per core; hashlib releases the GIL); later starts stat them. `macserve dev
weights-hash` measures it on a machine's disk (docs/server.md, "Where").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.caches import CacheSpec, model_dtype
from ..fileio import atomic_write
from .disk_files import FORMAT, file_sha, sha

log = logging.getLogger("macserve.server")

STORE = "weights-sha256.json"
WAIT = 5.0  # seconds a start waits for the disk tier to open (hashes kept: milliseconds)
RACY = 2.0  # seconds: a file changed this recently is hashed but its hash not kept


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def _load(store: Path | None) -> dict:
    if store is None:
        return {}
    try:
        files = json.loads(store.read_text()).get("files")
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}  # none yet, or unreadable: every file is hashed again


def content_shas(paths: list[Path], store: Path | None) -> tuple[dict[str, str], list[Path]]:
    """{resolved path: sha256} of each file, and the files hashed now (not found in `store`
    with the same stat)."""
    known = _load(store)
    out: dict[str, str] = {}
    todo: list[tuple[str, list[int]]] = []
    for p in paths:
        real = str(Path(p).resolve())
        key = _stat_key(os.stat(real))
        rec = known.get(real)
        if isinstance(rec, dict) and rec.get("stat") == key and isinstance(rec.get("sha"), str):
            out[real] = rec["sha"]
        else:
            todo.append((real, key))
    if not todo:
        return out, []
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
        shas = list(pool.map(lambda item: file_sha(Path(item[0])), todo))
    took = time.perf_counter() - t
    now = time.time_ns()
    for (real, key), h in zip(todo, shas):
        out[real] = h
        after = _stat_key(os.stat(real))
        # Changed while hashed, or too recently to trust its stat: not kept.
        if after == key and now - max(key[1], key[2]) > RACY * 1e9:
            known[real] = {"stat": key, "sha": h}
    nbytes = sum(k[0] for _, k in todo)
    log.info(
        "prompt cache: hashed %d weight file(s), %.1f MB in %.2f s (%.0f MB/s)",
        len(todo),
        nbytes / 2**20,
        took,
        nbytes / 2**20 / max(took, 1e-9),
    )
    if store is not None:
        # Records of files gone from the disk go too; a concurrent writer's records may be
        # lost (the last rename wins): those files are hashed again, never trusted wrongly.
        known = {k: v for k, v in known.items() if os.path.exists(k)}
        try:
            atomic_write(store, json.dumps({"files": known}, indent=1, sort_keys=True))
        except OSError as e:
            log.warning("prompt cache: weight hashes not kept in %s: %s", store, e)
    return out, [Path(r) for r, _ in todo]


def weight_files(path: Path) -> list[Path]:
    return sorted(
        f for f in Path(path).glob("*.safetensors") if f.name != "latent-rotation.safetensors"
    )


def identity(bundle, spec: CacheSpec, root: Path | None = None, dtype=None) -> dict[str, str]:
    """What a stored cache is only valid for: the model (its config and its weight files'
    contents), the calibration (its bytes and method) and the cache's format and dtype.
    `root`: the prompt cache's folder, where the weights' hashes are kept (None: not kept).
    `dtype`: the model's, read on the thread that owns it when this runs on another."""
    path = Path(bundle.path)
    store = None if root is None else Path(root) / STORE
    files = weight_files(path)
    rotation = [spec.rotation] if spec.kind.calibrated else []
    shas, _ = content_shas(files + rotation, store)
    weights = [(f.name, shas[str(f.resolve())]) for f in files]
    model = sha((path / "config.json").read_bytes(), json.dumps(weights).encode())[:16]
    if spec.kind.calibrated:
        rot = shas[str(Path(spec.rotation).resolve())]
        calibration = f"{spec.rotation.name}:{rot[:16]}:{spec.method}"
    else:
        calibration = "none"
    cache = f"{FORMAT}:{spec.kind}:{spec.quant!r}:{dtype or model_dtype(bundle.model)}"
    return {"model": f"{path.name}:{model}", "calibration": calibration, "cache": cache}


def open_soon(pc, make: Callable[[], object], wait: float = WAIT) -> None:
    """`pc.disk = make()` on a thread of its own, waited for `wait` seconds: the weights'
    hashes of a first start after they changed (minutes for a large model: docs/server.md)
    do not hold the server's start; until the tier is open, entries stay in memory. A tier
    that cannot open costs the disk tier, never the server."""

    def run():
        try:
            pc.disk = make()
        except Exception as e:  # noqa: BLE001 - the disk tier is an optimization
            log.warning("prompt cache: no disk tier: %s: %s", type(e).__name__, e)

    t = threading.Thread(target=run, name="macserve-disk-identity", daemon=True)
    t.start()
    t.join(wait)
    if t.is_alive():
        log.info("prompt cache: the disk tier opens once the weights are hashed (they changed)")


def measure(folder: Path, files: int, mb: int) -> dict:
    """The full hash's cost on `folder`'s disk: `files` files of `mb` MB of random bytes
    written, synced and dropped from the page cache (posix_fadvise), then hashed as a first
    start does (cold: the disk and sha256), again with no record (warm: sha256 from the page
    cache), and once more with the record (a later start: stat alone). Seconds and MB/s."""
    folder = Path(folder)
    paths = [folder / f"weights-{i}.bin" for i in range(files)]
    chunk = os.urandom(1 << 20)
    for p in paths:
        with open(p, "wb") as f:
            for i in range(mb):
                f.write(chunk[:8] + i.to_bytes(8, "little") + chunk[16:])
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    time.sleep(RACY)  # as weights written before a start are: their hashes are kept
    store = folder / STORE
    runs = {}
    for name, keep in (("cold", True), ("warm", False), ("stat", True)):
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                store.unlink()
        t = time.perf_counter()
        _, hashed = content_shas(paths, store)
        runs[name] = (time.perf_counter() - t, len(hashed))
    total = files * mb
    return {"files": files, "mb": total, **{k: {"s": s, "hashed": n} for k, (s, n) in runs.items()}}
