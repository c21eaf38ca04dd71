"""A model's metadata as read (`ModelSource`: a config.json or a GGUF header, the weights'
size, the files), and reading one from this machine's files: a config.json, a .gguf (every
part of a split one), or a folder holding either. Never the weights themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MacserveError
from .gguf_files import SPLIT, first_part, gguf_files, split_group
from .gguf_header import read_gguf_metadata


@dataclass
class ModelSource:
    name: str
    kind: str  # "config" | "gguf"
    config: dict | None = None
    gguf_meta: dict | None = None
    weights_bytes: int | None = None  # None: unknown (a bare config.json)
    files: list = field(default_factory=list)
    header_bytes_read: int = 0
    local_path: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"


def _load_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise MacserveError(f"{p}: no such file") from None
    except UnicodeDecodeError:
        raise MacserveError(f"{p}: not a text file") from None
    except json.JSONDecodeError as e:
        raise MacserveError(f"{p}: malformed JSON (line {e.lineno}: {e.msg})") from None
    except OSError as e:
        raise MacserveError(f"{p}: {e.strerror}") from None
    if not isinstance(d, dict):
        raise MacserveError(f"{p}: config is not a JSON object")
    return d


def read_gguf_file(path: Path) -> ModelSource:
    """A local .gguf's header (part 00001's, for a split file) and the size of all its parts."""
    names = [p.name for p in path.parent.glob("*.gguf")] if SPLIT.search(path.name) else [path.name]
    group = split_group(path.name, names)
    first = path.parent / first_part(group)
    try:
        with open(first, "rb") as f:
            meta, n = read_gguf_metadata(f, first.name)
    except OSError as e:
        raise MacserveError(f"{first}: {e.strerror}") from None
    size = sum((path.parent / g).stat().st_size for g in group)
    return ModelSource(
        path.name,
        "gguf",
        gguf_meta=meta,
        weights_bytes=size,
        files=[str(path.parent / g) for g in group],
        header_bytes_read=n,
        local_path=str(first),
    )


def _weights_in(folder: Path) -> int | None:
    files = list(folder.glob("*.safetensors"))
    return sum(p.stat().st_size for p in files) if files else None


def read_local(path: Path, quant: str | None) -> ModelSource:
    """A config.json, a .gguf, or a folder (its config.json, unless `quant` or no config.json
    picks one of its GGUF models)."""
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return read_gguf_file(path)
        if path.suffix.lower() == ".json":
            cfg = _load_json(path)
            name = path.stem if path.name != "config.json" else path.parent.name
            return ModelSource(
                name,
                "config",
                config=cfg,
                weights_bytes=_weights_in(path.parent),
                local_path=str(path),
            )
        raise MacserveError(f"{path}: neither a config.json nor a .gguf file")
    if not path.is_dir():
        raise MacserveError(f"{path}: not a file or folder")
    ggufs = sorted(str(p.relative_to(path)) for p in path.rglob("*.gguf"))
    if (path / "config.json").exists() and not quant:
        cfg = _load_json(path / "config.json")
        return ModelSource(
            path.name, "config", config=cfg, weights_bytes=_weights_in(path), local_path=str(path)
        )
    if ggufs:
        first, _group = gguf_files(str(path), ggufs, quant)
        return read_gguf_file(path / first)
    raise MacserveError(f"{path}: no config.json or .gguf file in this folder")
