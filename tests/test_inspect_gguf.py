"""A GGUF written here is inspected from disk and over HTTP range requests, header only."""

import http.server
import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.sources import read_gguf_file, read_gguf_stream


def _write_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(3)
    w.add_nextn_predict_layers(1)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_kv_lora_rank(512)
    w.add_key_length(576)
    w.add_value_length(512)
    w.add_key_length_mla(192)
    w.add_value_length_mla(128)
    w.add_rope_dimension_count(64)
    w.add_token_list([f"t{i}" for i in range(20000)])  # a long array, as real files have
    w.add_tensor("token_embd.weight", np.zeros((2048, 1024), dtype=np.float32))  # 8 MB
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    served = 0

    def log_message(self, *a):
        pass

    def do_GET(self):
        data = Path(self.translate_path(self.path)).read_bytes()
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            a, b = int(m.group(1)), int(m.group(2) or len(data) - 1)
            chunk = data[a : b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{a + len(chunk) - 1}/{len(data)}")
        else:
            chunk = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        self.wfile.write(chunk)
        type(self).served += len(chunk)


class _HttpRangeFile:
    """A minimal seekable reader over HTTP range requests (what HfFileSystem does)."""

    def __init__(self, url, block=64 * 1024):
        import httpx

        self.url, self.pos, self.block, self.client = url, 0, block, httpx.Client()
        self.buf, self.buf_at = b"", 0

    def read(self, n):
        out = b""
        while n > 0:
            off = self.pos - self.buf_at
            if not (0 <= off < len(self.buf)):
                r = self.client.get(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + self.block - 1}"})
                assert r.status_code == 206
                self.buf, self.buf_at, off = r.content, self.pos, 0
                if not self.buf:
                    break
            take = self.buf[off : off + n]
            out += take
            self.pos += len(take)
            n -= len(take)
        return out

    def seek(self, n, whence=0):
        self.pos = n if whence == 0 else self.pos + n


@pytest.fixture
def gguf_file(tmp_path):
    return _write_gguf(tmp_path / "tiny-Q8_0.gguf")


def test_gguf_from_disk_and_http_agree_reading_under_1mb(gguf_file):
    local = read_gguf_file(gguf_file)
    handler = type("H", (_RangeHandler,), {"served": 0})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(gguf_file.parent)))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        f = _HttpRangeFile(f"http://127.0.0.1:{srv.server_address[1]}/{gguf_file.name}")
        remote = read_gguf_stream(f, "remote", gguf_file.stat().st_size)
    finally:
        srv.shutdown()
    assert gguf_file.stat().st_size > 8 * 2**20
    assert handler.served < 2**20 and local.header_bytes_read < 2**20
    strip = lambda m: {k: v for k, v in m.items()}  # noqa: E731
    assert strip(local.gguf_meta) == strip(remote.gguf_meta)
    r = CliRunner().invoke(main, ["inspect", str(gguf_file), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["layers"] == {"mla": 2, "mtp": 1}
    assert d["kv_bytes_per_token"]["llama.cpp/f16"] == 2 * 576 * 2


def test_truncated_and_non_gguf_files_are_one_line_errors(gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:300])
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    for p, msg in ((cut, "truncated"), (bad, "not a GGUF")):
        r = CliRunner().invoke(main, ["inspect", str(p)])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
