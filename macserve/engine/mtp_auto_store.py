"""Where `--mtp auto`'s figures outlive the process: one small JSON file beside the prompt
cache (the disk tier's folder), one entry per model, cache kind and draft length, so a
restart decides from what was measured before instead of measuring again.

Written atomically (fileio.atomic_write) after each decision: a reader sees the old file or
the new one. A file that cannot be read or written costs the figures, never the server: one
log line, and auto measures afresh.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..fileio import atomic_write

log = logging.getLogger("macserve.engine")

FILE = "mtp-auto.json"


def store_key(model_path, cache_kind, k: int) -> str:
    """Figures hold for one model (its folder), cache kind and draft length."""
    return f"{Path(model_path).resolve()}|{cache_kind}|k={k}"


class AutoStore:
    def __init__(self, folder: Path, key: str):
        self.path = Path(folder) / FILE
        self.key = key

    def _all(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("MTP auto: %s unreadable (%s); measuring afresh", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def load(self) -> dict | None:
        entry = self._all().get(self.key)
        return entry if isinstance(entry, dict) else None

    def save(self, state: dict) -> None:
        data = self._all()  # other models' entries are kept
        data[self.key] = state
        try:
            atomic_write(self.path, json.dumps(data, indent=1) + "\n")
        except OSError as e:
            log.warning("MTP auto: figures not saved to %s: %s", self.path, e)
