"""The Hugging Face hub over the network: a repository's file list, a GGUF header read by
HTTP range requests (`HttpRangeFile`: fixed-size blocks, a few hundred KB for most headers,
the tokenizer arrays being the bulk), a config.json fetched.

httpx and huggingface_hub's HfApi (0.3-0.5 s to import) are imported only here, inside the
functions that need them, so inspecting a local file stays fast. The hub endpoint is
HF_ENDPOINT (read at call time); HF_HUB_OFFLINE=1 refuses remote sources.
"""

from __future__ import annotations

import io
import json
from urllib.parse import quote

from .. import env
from ..errors import MacserveError
from .gguf_files import gguf_files
from .gguf_header import read_gguf_metadata
from .model_source import ModelSource

CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 20.0
RANGE_BLOCK = 256 * 1024


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
    """The hub's URL: HF_ENDPOINT, read at each call."""
    return env.hf_endpoint()


def _hub_headers() -> dict:
    from huggingface_hub.utils import build_hf_headers  # remote only (module docstring)

    return build_hf_headers(library_name="macserve")


def resolve_url(repo: str, filename: str, revision: str = "main") -> str:
    """The download URL of one file of a hub repo."""
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


def read_remote(repo: str, quant: str | None) -> ModelSource:
    """`repo` (and `quant`) from the hub: its file list, then the GGUF header by range requests
    or config.json; refused under HF_HUB_OFFLINE."""
    if env.hf_offline():
        raise MacserveError(f"{repo}: HF_HUB_OFFLINE is set; use a local folder or file")
    files = list_repo_files(repo)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if quant or (ggufs and "config.json" not in files):
        if not ggufs:
            raise MacserveError(f"{repo}: no GGUF files in this repository")
        first, group = gguf_files(repo, ggufs, quant)
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
