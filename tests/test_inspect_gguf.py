"""GGUFs written here with the `gguf` package, inspected from disk and from a local fake
Hugging Face hub (HF_ENDPOINT) through HTTP range requests: same answer, header only."""

import http.server
import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.dev.skeleton_tensors import write_header
from macserve.errors import MacserveError
from macserve.sizing.arch import MLA, Compressed, Full, Linear, NoCache, Sliding
from macserve.sizing.arch_gguf import shape_from_gguf
from macserve.sizing.hub import HttpRangeFile
from macserve.sizing.kv_layout import kv_bytes_per_token
from macserve.sizing.model_source import read_gguf_file

from .conftest import CONFIGS

BIG = 8 * 2**20  # a tensor this big: reading the whole file would cost over 1 MB


def write_deepseek2(path: Path, blocks=4, nextn=1, split=None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(blocks)
    w.add_nextn_predict_layers(nextn)
    w.add_context_length(4096)
    w.add_embedding_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_kv_lora_rank(128)
    w.add_key_length(128 + 32)
    w.add_value_length(128)
    w.add_key_length_mla(64 + 32)
    w.add_value_length_mla(64)
    w.add_rope_dimension_count(32)
    if split:
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", split)
    w.add_token_list([f"tok{i}" for i in range(20000)])  # a long string array, as real files have
    w.add_tensor("token_embd.weight", np.zeros((BIG // 4 // 256, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Just enough of the hub: /api/models/<repo> (listing with sizes) and
    /<repo>/resolve/main/<file> with Range support. `honour_range = False` mimics a server
    that ignores Range and would send a whole file."""

    root: Path
    served: dict
    honour_range = True

    def log_message(self, *a):
        pass

    def _send(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?")[0]
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/main)?", path)
        if m:
            repo = self.root / m.group(1)
            if not repo.is_dir():
                return self._send(
                    404,
                    b'{"error":"Repository not found"}',
                    [("X-Error-Code", "RepoNotFound"), ("Content-Type", "application/json")],
                )
            sib = [
                {"rfilename": str(p.relative_to(repo)), "size": p.stat().st_size}
                for p in sorted(repo.rglob("*"))
                if p.is_file()
            ]
            body = json.dumps({"id": m.group(1), "sha": "0" * 40, "siblings": sib}).encode()
            return self._send(200, body, [("Content-Type", "application/json")])
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/main/(.+)", path)
        if not m or not (self.root / m.group(1) / m.group(2)).is_file():
            return self._send(404)
        data = (self.root / m.group(1) / m.group(2)).read_bytes()
        rng = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if rng and self.honour_range:
            a = int(rng.group(1))
            b = min(int(rng.group(2) or len(data) - 1), len(data) - 1)
            chunk = data[a : b + 1]
            headers = [("Content-Range", f"bytes {a}-{a + len(chunk) - 1}/{len(data)}")]
            code = 206
        else:
            chunk, headers, code = data, [], 200
        type(self).served[m.group(2)] = type(self).served.get(m.group(2), 0) + len(chunk)
        self._send(code, chunk, headers)


def isolate_hf_home(tmp_path, monkeypatch):
    """huggingface_hub fixes its token paths at import: point them at tmp_path, so no test
    reads (or refreshes) a token in the real home."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    repo = root / "org" / "tiny-GGUF"
    (repo / "Q8_0").mkdir(parents=True)
    write_deepseek2(repo / "Q8_0" / "tiny-Q8_0-00001-of-00002.gguf", split=2)
    (repo / "Q8_0" / "tiny-Q8_0-00002-of-00002.gguf").write_bytes(b"\0" * 3000)
    write_deepseek2(repo / "tiny-Q4_K_M.gguf", blocks=3, nextn=0)
    (repo / "README.md").write_text("a model card")
    cfg_repo = root / "org" / "tiny-cfg"
    cfg_repo.mkdir(parents=True)
    (cfg_repo / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 2048,
            }
        )
    )
    (cfg_repo / "model.safetensors").write_bytes(b"\0" * 12345)

    handler = type("Hub", (FakeHub,), {"root": root, "served": {}})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    isolate_hf_home(tmp_path, monkeypatch)
    yield root, handler
    srv.shutdown()


def inspect_json(*args):
    r = CliRunner().invoke(main, ["inspect", *args, "--memory", "64GB", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_gguf_from_disk_and_over_http_agree_reading_under_1mb(hub):
    root, handler = hub
    part1 = root / "org" / "tiny-GGUF" / "Q8_0" / "tiny-Q8_0-00001-of-00002.gguf"
    assert part1.stat().st_size > BIG
    local = inspect_json(str(part1))
    remote = inspect_json("org/tiny-GGUF:Q8_0")
    served = dict(handler.served)
    again = inspect_json("org/tiny-GGUF", "--quant", "q8_0")
    assert {**again, "source": None} == {**remote, "source": None}

    assert set(served) == {"Q8_0/tiny-Q8_0-00001-of-00002.gguf"}  # part 1 only, header only
    assert served["Q8_0/tiny-Q8_0-00001-of-00002.gguf"] < 2**20
    assert local["gguf_header_bytes_read"] < 2**20 and remote["gguf_header_bytes_read"] < 2**20

    for k in (
        "model_type",
        "layers",
        "kv_bytes_per_token",
        "state_bytes_per_sequence",
        "max_context",
        "mtp",
        "weights_bytes",
    ):
        assert local[k] == remote[k], k
    # 4 blocks of which 1 nextn: llama.cpp caches K only (128 + 32) on the 3 trunk layers.
    assert local["layers"] == {"mla": 3, "mtp": 1}
    assert local["kv_bytes_per_token"]["llama.cpp/f16"] == 3 * 160 * 2
    assert local["mtp"]["kv_bytes_per_token"]["llama.cpp/f16"] == 160 * 2
    assert set(local["kv_bytes_per_token"]) == {"llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0"}
    both = part1.stat().st_size + 3000  # every part counts as weights
    assert local["weights_bytes"] == remote["weights_bytes"] == both


def test_other_quant_and_config_repos(hub):
    d = inspect_json("org/tiny-GGUF:Q4_K_M")
    assert d["layers"] == {"mla": 3}
    d = inspect_json("org/tiny-cfg")
    assert d["model_type"] == "llama" and d["weights_bytes"] == 12345
    assert d["kv_bytes_per_token"]["mlx/bf16"] == 2 * 2 * 16 * 2 * 2


@pytest.mark.parametrize(
    "source,msg",
    [
        ("org/tiny-GGUF:Q2_K", "no GGUF file for quant"),
        ("org/tiny-GGUF", "2 GGUF models match"),
        ("org/missing", "no such repository"),
    ],
)
def test_hub_errors_are_one_line(hub, source, msg):
    r = CliRunner().invoke(main, ["inspect", source])
    assert r.exit_code == 2 and msg in r.output, r.output
    assert r.output.startswith("error:") and r.output.count("\n") == 1


def test_a_server_ignoring_range_is_refused_not_downloaded(hub):
    _, handler = hub
    handler.honour_range = False
    r = CliRunner().invoke(main, ["inspect", "org/tiny-GGUF:Q4_K_M"])
    assert r.exit_code == 2 and "range response" in r.output


def test_range_reader_seeks_without_fetching(hub):
    root, handler = hub
    import os

    url = os.environ["HF_ENDPOINT"] + "/org/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"
    with HttpRangeFile(url, block=4096) as f:
        assert f.read(4) == b"GGUF"
        f.seek(BIG, 1)
        tail = f.read(10)
        assert f.bytes_fetched <= 2 * 4096
    assert tail == (root / "org/tiny-GGUF/tiny-Q4_K_M.gguf").read_bytes()[4 + BIG : 14 + BIG]


def test_truncated_and_non_gguf_files_are_one_line_errors(tmp_path):
    good = write_deepseek2(tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:300])
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for p, msg in ((cut, "truncated"), (bad, "not a GGUF"), (empty, "not a GGUF")):
        r = CliRunner().invoke(main, ["inspect", str(p)])
        assert r.exit_code == 2 and msg in r.output, r.output
        assert r.output.count("\n") == 1 and "Traceback" not in r.output


def test_local_split_part_reads_part_one(tmp_path):
    p1 = write_deepseek2(tmp_path / "m-00001-of-00002.gguf", split=2)
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(b"\0" * 10)
    src = read_gguf_file(tmp_path / "m-00002-of-00002.gguf")
    assert src.local_path == str(p1) and src.weights_bytes == p1.stat().st_size + 10


# --- GGUF metadata -> shape, per llama.cpp's loaders --------------------------------------


def _meta(arch, **kv):
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in kv.items()}}


def test_pre_mla_deepseek2_gguf_caches_k_and_v_per_head():
    m = _meta(
        "deepseek2",
        block_count=2,
        embedding_length=512,
        **{
            "attention.head_count": 16,
            "attention.head_count_kv": 16,
            "attention.kv_lora_rank": 512,
            "attention.key_length": 192,
            "attention.value_length": 128,
            "rope.dimension_count": 64,
        },
    )
    s = shape_from_gguf(m)
    assert s.layers == [Full(16, 192, 128)] * 2
    assert kv_bytes_per_token(s, "llama.cpp/f16") == 2 * 16 * 320 * 2


def test_dsa_gguf_with_indexer_types():
    m = _meta(
        "glm-dsa",
        block_count=5,
        nextn_predict_layers=1,
        embedding_length=512,
        context_length=4096,
        **{
            "attention.head_count": 8,
            "attention.head_count_kv": 1,
            "attention.kv_lora_rank": 512,
            "attention.key_length": 576,
            "attention.value_length": 512,
            "attention.key_length_mla": 256,
            "attention.value_length_mla": 256,
            "rope.dimension_count": 64,
            "attention.indexer.key_length": 128,
            "attention.indexer.types": [True, False, False, True],
        },
    )
    s = shape_from_gguf(m)
    assert [l.indexer_shared for l in s.layers] == [False, True, True, False]
    assert kv_bytes_per_token(s, "llama.cpp/f16") == 4 * 1152 + 2 * 256
    assert s.mtp_layers[0].indexer == 0


def test_hybrid_and_sliding_ggufs():
    q = shape_from_gguf(
        _meta(
            "qwen35moe",
            block_count=8,
            embedding_length=2048,
            full_attention_interval=4,
            **{
                "attention.head_count": 16,
                "attention.head_count_kv": 2,
                "attention.key_length": 256,
                "attention.value_length": 256,
                "ssm.conv_kernel": 4,
                "ssm.inner_size": 4096,
                "ssm.state_size": 128,
                "ssm.group_count": 16,
            },
        )
    )
    assert [l.kind for l in q.layers] == ["linear"] * 3 + ["full"] + ["linear"] * 3 + ["full"]
    assert q.layers[0] == Linear("gated_deltanet", 3 * 8192, 128 * 4096)
    g = shape_from_gguf(
        _meta(
            "gpt-oss",
            block_count=4,
            embedding_length=2880,
            **{
                "attention.head_count": 64,
                "attention.head_count_kv": 8,
                "attention.key_length": 64,
                "attention.value_length": 64,
                "attention.sliding_window": 128,
            },
        )
    )
    assert [type(l) for l in g.layers] == [Sliding, Full, Sliding, Full]
    v4 = shape_from_gguf(
        _meta(
            "deepseek4",
            block_count=3,
            embedding_length=4096,
            **{
                "attention.head_count": 64,
                "attention.head_count_kv": 1,
                "attention.key_length": 512,
                "attention.compress_ratios": [0, 4, 128],
                "attention.sliding_window": 128,
                "attention.indexer.key_length": 128,
            },
        )
    )
    assert v4.layers == [
        Compressed(0, 512, 128),
        Compressed(4, 512, 128, 128),
        Compressed(128, 512, 128),
    ]
    nc = shape_from_gguf(
        _meta(
            "llama",
            block_count=2,
            embedding_length=64,
            **{"attention.head_count": 4, "attention.head_count_kv": [2, 0]},
        )
    )
    assert nc.layers == [Full(2, 16, 16), NoCache()]


def test_nemotron_h_gguf_caches_kv_on_attention_layers_and_mamba2_state_per_sequence():
    """llama.cpp's nemotron_h loader: a layer with KV heads attends; one with neither KV heads
    nor an FFN is Mamba-2 (conv and SSM state per sequence); an MLP / MoE layer caches nothing."""
    m = _meta(
        "nemotron_h_moe",
        block_count=4,
        embedding_length=64,
        **{
            "attention.head_count": [0, 8, 0, 0],
            "attention.head_count_kv": [0, 2, 0, 0],
            "attention.key_length": 128,
            "attention.value_length": 128,
            "feed_forward_length": [0, 0, 32, 0],
            "ssm.conv_kernel": 4,
            "ssm.inner_size": 1024,
            "ssm.state_size": 128,
            "ssm.group_count": 8,
        },
    )
    s = shape_from_gguf(m)
    # llama_hparams::n_embd_r = (d_conv - 1) * (d_inner + 2 * groups * d_state), n_embd_s =
    # d_state * d_inner
    mamba = Linear("mamba2", (4 - 1) * (1024 + 2 * 8 * 128), 128 * 1024)
    assert s.layers == [mamba, Full(2, 128, 128), NoCache(), mamba]
    assert kv_bytes_per_token(s, "llama.cpp/f16") == 2 * 128 * 2 * 2  # K and V, f16


def test_nemotron_h_gguf_is_sized_as_its_config(tmp_path):
    """The GGUF header llama-truth's skeleton writes for mlx-lm's nemotron_h test config
    (mamba2 + attention): inspect of the .gguf gives the config's llama.cpp figures, which
    llama-server itself agreed with (docs/inspect.md); before, the GGUF was refused."""
    cfg = CONFIGS / "mlx-lm" / "nemotron_h.json"
    write_header(json.loads(cfg.read_text()), tmp_path / "n.gguf")
    g = inspect_json(str(tmp_path / "n.gguf"))
    c = inspect_json(str(cfg), "--modelled")
    assert g["model_type"] == "nemotron_h"
    for key in ("kv_bytes_per_token", "state_bytes_per_sequence"):
        assert g[key]["llama.cpp/f16"] == c[key]["llama.cpp/f16"], key
    assert g["state_bytes_per_sequence"]["llama.cpp/f16"] > 0
    assert g["layers"] == c["layers"]


@pytest.mark.parametrize(
    "name, arch, state",
    [
        # minimax-01: 70 lightning layers, a 64 x 128 x 128 f32 state each, per sequence.
        ("MiniMaxAI__MiniMax-M1", "minimax-01", 70 * 64 * 128 * 128 * 4),
        # minimax-m3: no state; K and V plus the MSA indexer cache on 57 of 60 layers.
        ("MiniMaxAI__MiniMax-M3.RECONSTRUCTED", "minimax-m3", 0),
    ],
)
def test_minimax_ggufs_are_sized_as_their_configs(tmp_path, name, arch, state):
    """The GGUF header llama-truth's skeleton writes (as llama.cpp's converter would): inspect
    of the .gguf gives the config's llama.cpp figures, which llama-server agreed with
    (tests/test_llama_truth.py)."""
    cfg = CONFIGS / f"{name}.json"
    write_header(json.loads(cfg.read_text()), tmp_path / "m.gguf")
    g = inspect_json(str(tmp_path / "m.gguf"))
    c = inspect_json(str(cfg), "--modelled")
    assert g["model_type"] == arch
    for key in ("kv_bytes_per_token", "state_bytes_per_sequence"):
        for cache in ("llama.cpp/f16", "llama.cpp/q8_0"):
            assert g[key][cache] == c[key][cache], (key, cache)
    assert g["state_bytes_per_sequence"]["llama.cpp/f16"] == state
    assert g["layers"] == c["layers"]


@pytest.mark.parametrize(
    "meta,field",
    [
        ({"general.architecture": "llama"}, "block_count"),
        (
            _meta(
                "mamba2",
                block_count=2,
                embedding_length=64,
                **{"attention.head_count": 1, "ssm.state_size": 16},
            ),
            "ssm",
        ),
        (
            _meta(
                "gemma9",
                block_count=2,
                embedding_length=64,
                **{"attention.head_count": 4, "attention.sliding_window": 512},
            ),
            "sliding_window_pattern",
        ),
        ({}, "general.architecture"),
    ],
)
def test_unclassifiable_gguf_names_the_key(meta, field):
    with pytest.raises(MacserveError, match=field):
        shape_from_gguf(meta)


def test_mla_layer_from_gguf_dims():
    m = _meta(
        "deepseek2",
        block_count=1,
        embedding_length=64,
        **{
            "attention.head_count": 4,
            "attention.head_count_kv": 1,
            "attention.kv_lora_rank": 512,
            "attention.key_length": 576,
            "attention.value_length": 512,
            "attention.key_length_mla": 192,
            "attention.value_length_mla": 128,
            "rope.dimension_count": 64,
        },
    )
    assert shape_from_gguf(m).layers == [MLA(512, 64, 4, 192, 128)]


# --- against a real llama-server (skipped without the binary) -----------------------------


@pytest.mark.e2e
def test_llama_server_allocates_what_inspect_says(llama_server, tmp_path):
    """The project's deepseek2 GGUF (4 MLA layers + 1 nextn) under -np 2 -c 1000 with q8_0:
    llama.cpp pads the context to 1024, gives each sequence 512 cells, and filters the nextn
    layer out of the main cache."""
    import subprocess
    import time

    from macserve.dev.gguf_export import export_gguf
    from macserve.sizing.report import inspect_source

    from .conftest import TINY_MODEL

    gguf = export_gguf(TINY_MODEL, tmp_path / "tiny-mla.gguf")
    lay = inspect_source(str(gguf)).layouts["llama.cpp/q8_0"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [
                llama_server,
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                "18477",
                "-t",
                "2",
                "-np",
                "2",
                "-c",
                "1000",
                "-ctk",
                "q8_0",
                "-ctv",
                "q8_0",
                "-v",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "llama_kv_cache: size" not in log_path.read_text():
            if p.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        p.terminate()
        p.wait(timeout=30)
    text = log_path.read_text()
    line = next((l for l in text.splitlines() if "llama_kv_cache: size =" in l), None)
    assert line, text[-2000:]
    mib = float(line.split("size =")[1].split("MiB")[0])
    assert "512 cells" in line and "4 layers" in line and "2/2 seqs" in line, line
    assert "layer   4: filtered" in text
    assert abs(mib * 2**20 - 2 * lay.bytes_at(500)) < 0.01 * 2**20, line


def test_glm5_next_gguf_kda_and_kpool_indexer():
    m = _meta(
        "glm5-next",
        block_count=5,
        nextn_predict_layers=1,
        embedding_length=6144,
        **{
            "attention.head_count": 64,
            "attention.head_count_kv": [0, 0, 0, 1, 1],
            "attention.kv_lora_rank": 512,
            "attention.key_length": 512,
            "attention.value_length": 512,
            "attention.key_length_mla": 192,
            "attention.value_length_mla": 256,
            "rope.dimension_count": 0,
            "kda.head_dim": 128,
            "ssm.conv_kernel": 4,
            "attention.indexer.key_length": 128,
            "attention.indexer.kpool": 4,
        },
    )
    s = shape_from_gguf(m)
    assert s.counts() == {"linear": 3, "mla": 1, "mtp": 1}
    from macserve.sizing.kv_layout import state_bytes_per_sequence

    # llama.cpp: latent row 512 + indexer key|gate|pooled 3 x 128, f16.
    assert kv_bytes_per_token(s, "llama.cpp/f16") == 1024 + 768
    # n_embd_r = 3 x (4 - 1) x 64 x 128, n_embd_s = 128 x 128 x 64, both f32.
    assert state_bytes_per_sequence(s, "llama.cpp/f16") == 3 * 4 * (3 * 3 * 8192 + 128 * 128 * 64)
