"""Where a model's metadata comes from: a local config/folder/GGUF or a Hugging Face repo.

Only config.json, the file listing and GGUF headers are read, never weights. Remote GGUF
headers come through huggingface_hub's file system, which reads with HTTP range requests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MacserveError
from .gguf_header import read_gguf_metadata

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass
class ModelSource:
    name: str
    kind: str  # "config" | "gguf"
    config: dict | None = None
    gguf_meta: dict | None = None
    weights_bytes: int = 0
    files: list = field(default_factory=list)
    header_bytes_read: int = 0
    is_gguf: bool = False
    local_path: str | None = None


def _load_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise MacserveError(f"{p}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MacserveError(f"{p}: malformed JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(d, dict):
        raise MacserveError(f"{p}: config is not a JSON object")
    return d


def _first_part(files: list[str]) -> list[str]:
    """For split GGUFs only part 1 holds the metadata; others are listed for their size."""
    parts = [f for f in files if not _SPLIT.search(f) or _SPLIT.search(f).group(1) == "00001"]
    return sorted(parts)


def read_gguf_file(path: Path) -> ModelSource:
    try:
        with open(path, "rb") as f:
            meta, n = read_gguf_metadata(f, path.name)
    except OSError as e:
        raise MacserveError(f"{path}: {e.strerror}") from None
    files = [path]
    m = _SPLIT.search(path.name)
    if m:
        files = sorted(path.parent.glob(_SPLIT.sub("-*-of-" + m.group(2) + ".gguf", path.name)))
    size = sum(p.stat().st_size for p in files)
    return ModelSource(path.name, "gguf", gguf_meta=meta, weights_bytes=size,
                       files=[str(p) for p in files], header_bytes_read=n, is_gguf=True,
                       local_path=str(path))


def read_gguf_stream(f, name: str, weights_bytes: int) -> ModelSource:
    meta, n = read_gguf_metadata(f, name)
    return ModelSource(name, "gguf", gguf_meta=meta, weights_bytes=weights_bytes,
                       header_bytes_read=n, is_gguf=True)


def _local(path: Path, quant: str | None) -> ModelSource:
    if path.is_file():
        if path.suffix == ".gguf":
            return read_gguf_file(path)
        if path.suffix == ".json":
            cfg = _load_json(path)
            name = path.stem if path.name != "config.json" else path.parent.name
            return ModelSource(name, "config", config=cfg,
                               weights_bytes=_weights_in(path.parent), local_path=str(path.parent))
        raise MacserveError(f"{path}: neither a config.json nor a .gguf file")
    ggufs = _first_part([p.name for p in path.glob("*.gguf")])
    if quant:
        ggufs = [g for g in ggufs if quant.lower() in g.lower()]
    if (path / "config.json").exists() and not quant:
        cfg = _load_json(path / "config.json")
        return ModelSource(path.name, "config", config=cfg, weights_bytes=_weights_in(path),
                           local_path=str(path))
    if ggufs:
        return read_gguf_file(path / ggufs[0])
    raise MacserveError(f"{path}: no config.json or .gguf file in this folder")


def _weights_in(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _remote(repo: str, quant: str | None) -> ModelSource:
    import os

    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import HfApi, HfFileSystem, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    try:
        info = HfApi().model_info(repo, files_metadata=True, timeout=10)
        files = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
        ggufs = [f for f in files if f.endswith(".gguf")]
        if quant or (ggufs and not any(f == "config.json" for f in files)):
            chosen = [f for f in ggufs if not quant or quant.lower() in f.lower()]
            if not chosen:
                raise MacserveError(f"{repo}: no GGUF files for quant {quant!r}")
            first = _first_part(chosen)[0]
            group = [f for f in chosen if f.rsplit("/", 1)[0] == first.rsplit("/", 1)[0]
                     and (_SPLIT.sub("", f) == _SPLIT.sub("", first))]
            with HfFileSystem().open(f"{repo}/{first}", "rb", block_size=1 << 20) as fh:
                src = read_gguf_stream(fh, f"{repo}:{quant or first}", sum(files[g] for g in group))
            src.files = group
            return src
        cfg = _load_json(Path(hf_hub_download(repo, "config.json")))
        size = sum(v for k, v in files.items() if k.endswith(".safetensors"))
        return ModelSource(repo, "config", config=cfg, weights_bytes=size, files=list(files))
    except MacserveError:
        raise
    except RepositoryNotFoundError:
        raise MacserveError(f"{repo}: no such repository on the Hugging Face hub") from None
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as e:
        raise MacserveError(f"{repo}: cannot reach the Hugging Face hub ({type(e).__name__})") from None
    except Exception as e:  # network stacks raise many types; the user needs one line
        raise MacserveError(f"{repo}: cannot read from the Hugging Face hub ({type(e).__name__})") from None


def resolve(source: str, quant: str | None = None) -> ModelSource:
    p = Path(source).expanduser()
    if p.exists():
        return _local(p, quant)
    if ":" in source and not quant and not source.startswith(("/", ".")):
        source, quant = source.rsplit(":", 1)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        raise MacserveError(f"{source}: no such file, and not a Hugging Face repo id (org/name)")
    return _remote(source, quant)
