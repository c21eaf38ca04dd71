"""Where a model's metadata comes from: a config.json, a local folder, a local .gguf, or a
Hugging Face repo id (`org/name`, `org/name:QUANT` or `--quant` for GGUF repos).

Only config.json, the file listing and GGUF headers are read, never weights: a GGUF header
is parsed from a seekable stream (gguf_header.py), a local file or `HttpRangeFile`, which
fetches fixed-size blocks with HTTP range requests (a few hundred KB for most headers, the
tokenizer arrays being the bulk).

httpx and huggingface_hub's HfApi (0.3-0.5 s to import) are imported only for remote
sources, inside the functions that need them, so inspecting a local file stays fast. The hub endpoint is HF_ENDPOINT (read at call time); HF_HUB_OFFLINE=1 refuses
remote sources.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from .. import env
from ..errors import MacserveError
from .gguf_header import read_gguf_metadata

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 20.0
RANGE_BLOCK = 256 * 1024


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


# ---------------------------------------------------------------------------------------
# local


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


def _split_group(name: str, names) -> list[str]:
    """All parts of a split GGUF (`-00001-of-00003.gguf`), or just the file."""
    m = _SPLIT.search(name)
    if not m:
        return [name]
    stem = name[: m.start()]
    return sorted(
        n
        for n in names
        if _SPLIT.search(n)
        and n[: _SPLIT.search(n).start()] == stem
        and _SPLIT.search(n).group(2) == m.group(2)
    )


def _first_part(group: list[str]) -> str:
    firsts = [g for g in group if not _SPLIT.search(g) or _SPLIT.search(g).group(1) == "00001"]
    if not firsts:
        raise MacserveError(
            f"{group[0]}: part 00001 of this split GGUF is missing (only it holds the metadata)"
        )
    return firsts[0]


def read_gguf_file(path: Path) -> ModelSource:
    names = (
        [p.name for p in path.parent.glob("*.gguf")] if _SPLIT.search(path.name) else [path.name]
    )
    group = _split_group(path.name, names)
    first = path.parent / _first_part(group)
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


def _local(path: Path, quant: str | None) -> ModelSource:
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
        first, _group = _pick_gguf(str(path), ggufs, quant)
        return read_gguf_file(path / first)
    raise MacserveError(f"{path}: no config.json or .gguf file in this folder")


# ---------------------------------------------------------------------------------------
# choosing GGUF files by quant


def _quant_re(quant: str):
    # Q4_K must not match Q4_K_M, nor Q4_0 IQ4_0: the quant is a whole token of the name.
    return re.compile(
        rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9]|_[A-Za-z0-9])", re.IGNORECASE
    )


def _pick_gguf(where: str, ggufs: list[str], quant: str | None) -> tuple[str, list[str]]:
    """(file holding the header, all files of that model) for `quant` among `ggufs`."""
    model_files = [f for f in ggufs if "mmproj" not in f.lower()]
    if quant:
        rx = _quant_re(quant)
        model_files = [f for f in model_files if rx.search(f)]
        if not model_files:
            raise MacserveError(f"{where}: no GGUF file for quant {quant!r}")
    groups = {}
    for f in model_files:
        m = _SPLIT.search(f)
        groups.setdefault(f[: m.start()] if m else f, []).append(f)
    if len(groups) > 1:
        names = ", ".join(sorted(Path(k).name.removesuffix(".gguf") for k in groups)[:8])
        raise MacserveError(
            f"{where}: {len(groups)} GGUF models match; pick one with "
            f"--quant or REPO:QUANT ({names})"
        )
    (group,) = groups.values()
    return _first_part(sorted(group)), sorted(group)


# ---------------------------------------------------------------------------------------
# remote


class HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests, fetched in fixed-size blocks.

    `bytes_fetched` counts what came over the wire: the header reader never asks for tensor
    data, so a 400 GB GGUF costs a few blocks.
    """

    def __init__(
        self, url: str, headers: dict | None = None, block: int = RANGE_BLOCK, client=None
    ):
        import httpx  # remote sources only: see the module docstring

        super().__init__()
        self.url, self.block = url, block
        self._client = client or httpx.Client(
            headers=headers or {},
            follow_redirects=True,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        )
        self._pos, self._buf, self._buf_at, self._size = 0, b"", 0, None
        self.bytes_fetched = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            if self._size is None:
                self._fetch(0)
            self._pos = self._size + offset
        return self._pos

    def _fetch(self, at: int):
        r = self._client.get(self.url, headers={"Range": f"bytes={at}-{at + self.block - 1}"})
        if r.status_code == 416:
            self._buf, self._buf_at = b"", at
            return
        if r.status_code != 206:
            # A server that ignores Range would send the whole file: refuse, don't download.
            raise MacserveError(
                f"{self.url}: expected a range response (206), got HTTP {r.status_code}"
            )
        total = r.headers.get("Content-Range", "").rpartition("/")[2]
        if total.isdigit():
            self._size = int(total)
        self._buf, self._buf_at = r.content, at
        self.bytes_fetched += len(r.content)

    def readinto(self, b):
        n = len(b)
        if n == 0:
            return 0
        off = self._pos - self._buf_at
        if not (0 <= off < len(self._buf)):
            self._fetch(self._pos)
            off = 0
        chunk = self._buf[off : off + n]
        b[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, n=-1):
        if n is None or n < 0:
            raise MacserveError("HttpRangeFile reads bounded amounts only (no whole-file reads)")
        out = bytearray()
        while len(out) < n:
            chunk = super().read(n - len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def close(self):
        try:
            self._client.close()
        finally:
            super().close()


def hub_endpoint() -> str:
    return env.hf_endpoint()


def _hub_headers() -> dict:
    from huggingface_hub.utils import build_hf_headers  # remote only (module docstring)

    return build_hf_headers(library_name="macserve")


def resolve_url(repo: str, filename: str, revision: str = "main") -> str:
    return f"{hub_endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(filename)}"


def _hub_error(repo: str, e: Exception) -> MacserveError:
    name = type(e).__name__
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return MacserveError(f"{repo}: no such repository on {hub_endpoint()} (or no access)")
    if name == "RevisionNotFoundError":
        return MacserveError(f"{repo}: no such revision")
    return MacserveError(f"{repo}: cannot reach {hub_endpoint()} ({name})")


def list_repo_files(repo: str) -> dict[str, int]:
    """{path: size in bytes} for every file of a hub repo (sizes from the LFS metadata)."""
    from huggingface_hub import HfApi  # remote only (module docstring)

    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(
            repo, files_metadata=True, timeout=CONNECT_TIMEOUT + READ_TIMEOUT
        )
    except Exception as e:  # httpx and hub errors come in many types; the user needs one line
        raise _hub_error(repo, e) from None
    return {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}


def _remote(repo: str, quant: str | None) -> ModelSource:
    if env.hf_offline():
        raise MacserveError(f"{repo}: HF_HUB_OFFLINE is set; use a local folder or file")
    files = list_repo_files(repo)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if quant or (ggufs and "config.json" not in files):
        if not ggufs:
            raise MacserveError(f"{repo}: no GGUF files in this repository")
        first, group = _pick_gguf(repo, ggufs, quant)
        try:
            with HttpRangeFile(resolve_url(repo, first), _hub_headers()) as fh:
                meta, n = read_gguf_metadata(fh, first)
                fetched = fh.bytes_fetched
        except MacserveError:
            raise
        except Exception as e:
            raise _hub_error(repo, e) from None
        return ModelSource(
            f"{repo}:{quant}" if quant else repo,
            "gguf",
            gguf_meta=meta,
            weights_bytes=sum(files[g] for g in group),
            files=group,
            header_bytes_read=max(n, fetched),
        )
    if "config.json" not in files:
        raise MacserveError(f"{repo}: no config.json and no GGUF files")
    cfg = _fetch_json(repo, "config.json")
    st = [f for f in files if f.endswith(".safetensors")]
    return ModelSource(
        repo,
        "config",
        config=cfg,
        weights_bytes=sum(files[f] for f in st) if st else None,
        files=list(files),
    )


def _fetch_json(repo: str, filename: str) -> dict:
    import httpx  # remote sources only: see the module docstring

    try:
        r = httpx.get(
            resolve_url(repo, filename),
            headers=_hub_headers(),
            follow_redirects=True,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        )
    except httpx.HTTPError as e:
        raise _hub_error(repo, e) from None
    if r.status_code != 200:
        raise MacserveError(f"{repo}/{filename}: HTTP {r.status_code}")
    if len(r.content) > 8 * 2**20:
        raise MacserveError(f"{repo}/{filename}: too large for a config ({len(r.content):,} B)")
    try:
        d = json.loads(r.content)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MacserveError(f"{repo}/{filename}: malformed JSON ({e})") from None
    if not isinstance(d, dict):
        raise MacserveError(f"{repo}/{filename}: config is not a JSON object")
    return d


# ---------------------------------------------------------------------------------------


def split_source(source: str, quant: str | None = None) -> tuple[str, str | None]:
    """(repo id, quant) of `org/name`, `org/name:QUANT` (and --quant); refuses anything else."""
    repo = source
    if ":" in source:
        repo, _, q = source.rpartition(":")
        if quant and q and q.lower() != quant.lower():
            raise MacserveError(f"{source}: quant given twice ({q!r} and --quant {quant!r})")
        quant = quant or q or None
    if not _REPO.fullmatch(repo):
        raise MacserveError(f"{source}: no such file, and not a Hugging Face repo id (org/name)")
    return repo, quant


def resolve(source: str, quant: str | None = None) -> ModelSource:
    """A path if it exists, else a hub repo id (`org/name` or `org/name:QUANT`): from the
    Hugging Face cache when it holds what the model needs, else from the hub."""
    p = Path(source).expanduser()
    try:
        exists = p.exists()
    except (OSError, ValueError) as e:  # longer than PATH_MAX, a NUL: no file, no repo either
        raise MacserveError(
            f"{source[:80]}...: not a usable path or repo id: {e.__class__.__name__}"
        ) from None
    if exists:
        return _local(p, quant)
    if source.endswith((".json", ".gguf")) or source.startswith((".", "/", "~")):
        raise MacserveError(f"{source}: no such file")
    parent = p.parent
    if str(parent) not in ("", ".") and parent.is_dir():
        # `models/tiny-mal` beside a real `models/` folder is a typo, not a hub repo id:
        # say so before a hub look-up fails with a network error that hides it.
        raise MacserveError(
            f"{source}: no such file or folder (a folder {parent}/ is here, so this reads as "
            "a path; a Hugging Face repo id of the same name can be inspected from elsewhere)"
        )
    repo, quant = split_source(source, quant)
    cached = cached_source(repo, quant)
    if cached is not None:
        return cached
    if env.hf_offline():
        raise MacserveError(
            f"{repo}: not in the Hugging Face cache ({env.hf_hub_cache()}) and HF_HUB_OFFLINE "
            f"is set: run macserve pull {source} while online"
        )
    return _remote(repo, quant)


# ---------------------------------------------------------------------------------------
# the Hugging Face cache: what `macserve pull` (or any huggingface_hub download) left in
# HF_HUB_CACHE, read without the network. Layout (huggingface_hub's): models--ORG--NAME/
# refs/main holds the commit, snapshots/<commit>/ the files (links to blobs/, made only once a
# file is complete, so a file there is whole).


def hub_snapshot(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo` at `revision`, if the cache has one."""
    root = env.hf_hub_cache() / ("models--" + repo.replace("/", "--"))
    try:
        commit = (root / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snap = root / "snapshots" / commit
    return snap if commit and snap.is_dir() else None


def gguf_files(where: str, names: list[str], quant: str | None) -> tuple[str, list[str]]:
    """(the file holding the header, every part) of the GGUF model `quant` among `names`."""
    return _pick_gguf(where, names, quant)


def _complete_mlx(folder: Path) -> bool:
    """config.json and every weight file the index names (or at least one) are there."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def cached_source(repo: str, quant: str | None = None) -> ModelSource | None:
    """`repo` (and `quant`) from the Hugging Face cache, or None when it lacks what is needed."""
    snap = hub_snapshot(repo)
    if snap is None:
        return None
    ggufs = [str(p.relative_to(snap)) for p in snap.rglob("*.gguf")]
    if quant or (ggufs and not (snap / "config.json").exists()):
        if not ggufs:
            return None
        try:
            first, _ = _pick_gguf(repo, ggufs, quant)
        except MacserveError:
            return None
        src = read_gguf_file(snap / first)
        src.name = f"{repo}:{quant}" if quant else repo
        return src
    if not _complete_mlx(snap):
        return None
    src = _local(snap, None)
    src.name = repo
    return src
