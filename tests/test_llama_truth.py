"""inspect's llama.cpp rows against llama.cpp itself: each real config becomes a shrunken GGUF
skeleton (macserve/dev/llama_truth.py) that the real llama-server loads, and the caches it
logs must be what inspect computes for the same `-c`.

Runs every config in tests/configs whose architecture the skeleton writer maps (15 of 23;
DeepSeek-V4, GLM-5.3, Llama 4 have no mapping yet, nor do the mlx-lm test configs), at
-c 4096 with one sequence; a few seconds each (tensor discovery: one llama-server start per
kind of tensor)."""

import json

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.dev import llama_truth
from macserve.errors import MacserveError
from macserve.sizing.report import llama_bytes_at

from .conftest import CONFIGS

CTX = 4096


ONE_PER_ARCH = [
    "meta-llama__Meta-Llama-3.1-8B",  # llama: K and V per KV head
    "openai__gpt-oss-120b",  # gpt-oss: SWA cache of PAD(window + ubatch) cells
    "Qwen__Qwen3.5-35B-A3B",  # qwen35moe: KV + recurrent (R, S in f32)
    "deepseek-ai__DeepSeek-V3",  # deepseek2: MLA, K only
    "zai-org__GLM-5.2",  # glm-dsa: MLA + indexer keys on the 21 owning layers
    "google__gemma-4-26B-A4B",  # gemma4: global head dims and KV heads, SWA
    "moonshotai__Kimi-K3",  # kimi-k3: KDA recurrent + MLA
    "nvidia__Llama-3_3-Nemotron-Super-49B-v1",  # deci: layers without attention
    "XiaomiMiMo__MiMo-V2-Flash",  # mimo2: per-layer KV heads, K 192 / V 128
]
MAPPED = [CONFIGS / f"{n}.json" for n in ONE_PER_ARCH]


def test_every_listed_config_has_a_mapping():
    for p in MAPPED:
        llama_truth.skeleton_metadata(json.loads(p.read_text()))


@pytest.mark.parametrize("path", MAPPED, ids=lambda p: p.stem)
def test_llama_server_allocates_what_inspect_says(path, llama_server, tmp_path):
    cfg = json.loads(path.read_text())
    got = llama_truth.measure(cfg, llama_server, CTX, tmp_path)
    want, per_token = llama_bytes_at(cfg, CTX)
    assert want is not None, per_token
    # Every logged figure is MiB rounded to 2 decimals: that is the tolerance, no more.
    assert got.mib == pytest.approx(want / 2**20, abs=got.tolerance_mib), (want, got.lines)
    # The caches that grow: one row per cell of the padded context.
    growing = [l for l in got.lines if l.cells == CTX]
    assert growing, got.lines
    per = sum(l.mib for l in growing) * 2**20 / CTX
    assert per == pytest.approx(float(per_token), abs=0.005 * len(growing) * 2**20 / CTX), got.lines
    assert all(t == "f16" for l in growing for _, t, _ in l.parts)


def test_the_skeleton_is_small_and_says_what_llama_cpp_needs(llama_server, tmp_path):
    cfg = json.loads((CONFIGS / "deepseek-ai__DeepSeek-V3.json").read_text())
    path = tmp_path / "s.gguf"
    sk = llama_truth.write_skeleton(cfg, path, llama_server)
    assert sk.arch == "deepseek2" and sk.kv["block_count"] == 61
    assert sk.kv["attention.kv_lora_rank"] == 512 and sk.kv["attention.key_length"] == 576
    assert path.stat().st_blocks * 512 < 8 * 2**20  # a hole, not 671B parameters


def test_unmapped_types_are_one_line_errors():
    with pytest.raises(MacserveError, match="no GGUF mapping"):
        llama_truth.skeleton_metadata({"model_type": "frobnicator", "num_hidden_layers": 2})


def test_the_dev_command_prints_both_figures(llama_server):
    path = str(CONFIGS / "openai__gpt-oss-120b.json")
    r = CliRunner().invoke(
        main, ["dev", "llama-truth", path, "-c", "1024", "--server", llama_server]
    )
    assert r.exit_code == 0, r.output
    row = next(l for l in r.output.splitlines() if l.startswith("openai__gpt-oss-120b"))
    assert row.split()[1] == "gpt-oss" and row.endswith("agree")
    assert "1 of 1 agree at -c 1024" in r.output
