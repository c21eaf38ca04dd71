"""`macserve pull` and the Hugging Face cache, against a local hub (tests/fakehub.py) serving
the project's real model files and GGUF exports of it over real HTTP: only the needed files are
fetched, an interrupted file resumes with a Range request, `inspect` and `new` use the cache
(offline too), and `new` sizes a model before it downloads it, then serves the local copy."""

import fnmatch
import json
import re

import httpx
import pytest

from .conftest import TINY_MODEL
from .fixtures import GGUF_REPO, MLX_REPO, cli, free_port, status

pytestmark = pytest.mark.e2e


def test_pull_one_quant_resumes_an_interrupted_file(hub, ggufs):
    cut = 11 * 2**20  # past huggingface_hub's first 10 MiB chunk, which it has written
    hub.cut_once["tiny-mla-F16.gguf"] = cut
    r = cli("pull", f"{GGUF_REPO}:F16")
    assert r.returncode == 0, r.stderr
    path = hub.cache / "models--test--tiny-mla-GGUF" / "snapshots"
    (snap,) = path.iterdir()
    assert r.stdout.strip() == f"{GGUF_REPO}:F16: {snap / 'tiny-mla-F16.gguf'}"
    assert "100%" in r.stderr  # huggingface_hub's progress bar
    assert hub.fetched(GGUF_REPO) == ["tiny-mla-F16.gguf"]  # not F32, not the README
    assert (snap / "tiny-mla-F16.gguf").read_bytes() == ggufs["F16"].read_bytes()
    ranges = [
        int(m.group(1))
        for meth, p, rng in hub.requests
        if meth == "GET" and p.endswith("/tiny-mla-F16.gguf") and rng
        for m in [re.fullmatch(r"bytes=(\d+)-", rng)]
        if m
    ]
    assert ranges and 0 < ranges[0] <= cut  # continued where the dropped transfer stopped


def test_pull_mlx_layout_fetches_what_mlx_lm_and_the_engine_load(hub):
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    r = cli("pull", MLX_REPO)
    assert r.returncode == 0, r.stderr
    snap = (
        hub.cache
        / "models--test--tiny-mla"
        / "snapshots"
        / "0123456789abcdef0123456789abcdef01234567"
    )
    assert r.stdout.strip() == f"{MLX_REPO}: {snap}"
    files = [p.name for p in TINY_MODEL.iterdir() if p.is_file()]
    want = {f for f in files if any(fnmatch.fnmatch(f, pat) for pat in DEFAULT_ALLOW_PATTERNS)}
    want |= {"latent-rotation.safetensors", "mtp.safetensors"}  # engine: INT2 rotation, MTP
    assert set(hub.fetched(MLX_REPO)) == want
    assert "README.md" not in want and "original/consolidated.pth" not in hub.fetched(MLX_REPO)
    for f in want:
        assert (snap / f).read_bytes() == (TINY_MODEL / f).read_bytes(), f


def test_inspect_and_pull_use_the_cache_offline(hub, ggufs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = cli("inspect", f"{GGUF_REPO}:F16", "--json")
    assert r.returncode == 2
    assert "not in the Hugging Face cache" in r.stderr and "macserve pull" in r.stderr
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for source in (f"{GGUF_REPO}:F16", MLX_REPO):
        assert cli("pull", source).returncode == 0
    seen = len(hub.requests)
    # online, a cached model is read from the cache: not one request to the hub
    assert cli("inspect", MLX_REPO, "--json").returncode == 0
    assert len(hub.requests) == seen
    # offline, with the hub unreachable: the same figures as the local files give
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for source, local in ((f"{GGUF_REPO}:F16", ggufs["F16"]), (MLX_REPO, TINY_MODEL)):
        r = cli("inspect", source, "--json", "--memory", "64GB")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        ref = json.loads(cli("inspect", str(local), "--json", "--memory", "64GB").stdout)
        for k in ("kv_bytes_per_token", "max_context", "weights_bytes", "mtp_layers"):
            assert got[k] == ref[k], k
    r = cli("pull", f"{GGUF_REPO}:F16")  # offline pull of a cached model: its path
    assert r.returncode == 0 and r.stdout.strip().endswith("tiny-mla-F16.gguf")
    r = cli("pull", f"{GGUF_REPO}:F32")
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr
    assert len(hub.requests) == seen


def test_new_sizes_then_pulls_then_serves(hub, llama_server, services, macserve_home):  # noqa: F811
    port = free_port()
    r = cli(
        "new", f"{GGUF_REPO}:F32", "--name", "hubbed", "--port", str(port), "--extra-args", "-t 1"
    )
    assert r.returncode == 0, r.stderr
    assert f"pulling {GGUF_REPO}:F32" in r.stderr and "100%" in r.stderr
    gets = [(p, rng) for m, p, rng in hub.requests if m == "GET" and p.endswith("F32.gguf")]
    assert gets[0][1] and gets[0][1].startswith("bytes=0-")  # the header, read to size it
    assert any(rng is None for _, rng in gets[1:])  # then the download
    text = (macserve_home / "profiles" / "hubbed.env").read_text()
    model = re.search(r"^MODEL=(.*)$", text, re.M).group(1)
    assert model.startswith(str(hub.cache)) and model.endswith("tiny-mla-F32.gguf")
    assert f"# macserve new {GGUF_REPO}:F32" in text
    s = status("hubbed")
    assert s["healthy"]
    services.append(s["pid"])
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60
    )
    assert resp.status_code == 200
    assert cli("rm", "hubbed").returncode == 0
    # the engine gets the snapshot folder, MTP weights and rotation included
    r = cli("new", MLX_REPO, "--provider", "macserve", "--name", "eng", "--no-start")
    assert r.returncode == 0, r.stderr
    text = (macserve_home / "profiles" / "eng.env").read_text()
    folder = re.search(r"^MODEL=(.*)$", text, re.M).group(1)
    assert folder.startswith(str(hub.cache))
    assert {"mtp.safetensors", "latent-rotation.safetensors", "config.json"} <= {
        p.name for p in __import__("pathlib").Path(folder).iterdir()
    }
