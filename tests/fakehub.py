"""A local stand-in for the Hugging Face hub: real files over real HTTP, for HF_ENDPOINT.

Only the endpoints huggingface_hub's `snapshot_download` and `model_info` call (2.x):
  GET  /api/models/ORG/NAME[/revision/REV]     model info, `siblings` with sizes (blobs=true)
  GET  /api/models/ORG/NAME/tree/REV           the file listing (recursive), one page
  HEAD /ORG/NAME/resolve/REV/PATH              X-Repo-Commit, ETag, Content-Length
  GET  /ORG/NAME/resolve/REV/PATH              the bytes; `Range: bytes=A-[B]` answers 206
                                               (downloads resume with it; inspect reads a
                                               GGUF header with it)
Every request is recorded. `cut_once[path] = n` sends only the first n bytes of that file's
next full GET and drops the connection (a download interrupted mid-file).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.cut_once: dict[str, int] = {}
        self._sha: dict[Path, str] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def sha256(self, path: Path) -> str:
        if path not in self._sha:
            self._sha[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._sha[path]

    def fetched(self, repo: str) -> list[str]:
        """Files of `repo` whose bytes were requested (GET on resolve/)."""
        pre = f"/{repo}/resolve/"
        return sorted(
            {
                p[len(pre) :].split("/", 1)[1]
                for m, p, _ in self.requests
                if m == "GET" and p.startswith(pre)
            }
        )

    def _entry(self, name: str, path: Path, tree: bool) -> dict:
        size, sha = path.stat().st_size, self.sha256(path)
        oid = hashlib.sha1(path.read_bytes()).hexdigest()
        lfs = {"size": size, "pointerSize": 134}
        if tree:
            return {
                "type": "file",
                "oid": oid,
                "size": size,
                "path": name,
                "lfs": {**lfs, "oid": sha},
            }
        return {"rfilename": name, "size": size, "blobId": oid, "lfs": {**lfs, "sha256": sha}}

    def _json(self, h, body, code=200):
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool):
        path = unquote(urlparse(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if m and m.group(1) in self.repos:
            files = self.repos[m.group(1)]
            return self._json(
                h,
                {
                    "id": m.group(1),
                    "modelId": m.group(1),
                    "sha": SHA,
                    "private": False,
                    "siblings": [self._entry(n, p, False) for n, p in sorted(files.items())],
                },
            )
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
        if m and m.group(1) in self.repos:
            files = self.repos[m.group(1)]
            return self._json(h, [self._entry(n, p, True) for n, p in sorted(files.items())])
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        if m and m.group(2) in self.repos.get(m.group(1), {}):
            return self._file(h, self.repos[m.group(1)][m.group(2)], head, m.group(2))
        self._json(h, {"error": "Repository not found"}, 404)

    def _file(self, h, path: Path, head: bool, name: str):
        data = path.read_bytes()
        start, end = 0, len(data) - 1
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or "")
        if rng and not head:
            start = int(rng.group(1))
            end = min(end, int(rng.group(2))) if rng.group(2) else end
        partial = (start, end) != (0, len(data) - 1)
        h.send_response(206 if partial else 200)
        h.send_header("X-Repo-Commit", SHA)
        h.send_header("ETag", f'"{self.sha256(path)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end + 1 - start))
        if partial:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.end_headers()
        if head:
            return
        cut = self.cut_once.pop(name, None) if not partial else None
        if cut is not None:
            h.wfile.write(data[:cut])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(data[start : end + 1])
