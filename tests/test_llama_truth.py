"""inspect's llama.cpp rows against llama.cpp itself: each real config becomes a shrunken GGUF
skeleton (macserve/dev/gguf_skeleton.py, skeleton_tensors.py) that the real llama-server
loads, and the caches it logs (macserve/dev/llama_truth.py) must be what inspect computes for
the same `-c`.

Runs 20 of the 29 configs in tests/configs, one per llama.cpp architecture and kind of
memory, plus mlx-lm's own test configs of mixtral, smollm3 and nemotron_h (no published
config of those was found verbatim); `macserve dev llama-truth tests/configs/*.json` runs all
29. At -c 4096 with one sequence, Llama 4 and EXAONE 4 also past their window; a few seconds
each (tensor discovery: one llama-server start per kind of tensor)."""

import json

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.dev import llama_truth
from macserve.dev.gguf_skeleton import skeleton_metadata
from macserve.dev.skeleton_tensors import write_skeleton
from macserve.errors import MacserveError
from macserve.sizing.arch_config import shape_from_config
from macserve.sizing.arch_gguf import shape_from_gguf
from macserve.sizing.kv_buffers import Layout
from macserve.sizing.kv_layout import layout
from macserve.sizing.model_source import read_gguf_file

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
    # deepseek4: K-only window on every layer, CSA (1/4) and HCA (1/128) compressed K and
    # CSA indexer keys each padded to 256 cells, f32 compressor states
    "deepseek-ai__DeepSeek-V4-Flash",
    # glm5-next: KDA recurrent + nope-only MLA + k-pool indexer rows (key | gate | pooled)
    "zai-org__GLM-5.3-Flash.RECONSTRUCTED",
    "meta-llama__Llama-4-Scout-17B-16E-Instruct",  # llama4: chunked iSWA, n_swa = 8192
    "LGAI-EXAONE__EXAONE-4.0-32B",  # exaone4: LLLG sliding pattern, window 4096
    "google__gemma-3-27b-it",  # gemma3: llama.cpp's default pattern 6, window 1024
    "tencent__Hunyuan-A13B-Instruct",  # hunyuan-moe: GQA on every layer
    "Qwen__Qwen2.5-7B-Instruct",  # qwen2: a sliding_window the config turns off
    "zai-org__GLM-4.7.ABRIDGED",  # glm4moe: GQA, partial rotary, leading dense blocks
    "LiquidAI__LFM2.5-VL-1.6B",  # lfm2: KV + short-conv recurrent (R in f32), VLM wrapper
    # minimax-01: KV on every 8th layer + the lightning layers' f32 state (S only) per sequence
    "MiniMaxAI__MiniMax-M1",
    # minimax-m3: KV + llama_kv_cache_msa's indexer cache (key + one V head) past dense layers
    "MiniMaxAI__MiniMax-M3.RECONSTRUCTED",
]
# Architectures whose only config here is the small one mlx-lm's own tests build the model
# type from (no published config.json found verbatim; tests/configs/README.md).
MLX_TEST_ARCHS = [
    "mixtral",  # written as llama with experts
    "smollm3",  # smollm3: NoPE layers still cache K and V
    # nemotron_h (KV on '*' layers + Mamba-2 state) is mapped and agreed when checked by
    # hand, but this llama-server segfaults on its skeleton right after making its caches in
    # about 1 run of 3: not a test until that is understood (docs/inspect.md).
]
MAPPED = [CONFIGS / f"{n}.json" for n in ONE_PER_ARCH] + [
    CONFIGS / "mlx-lm" / f"{n}.json" for n in MLX_TEST_ARCHS
]
# Also read back from the skeleton GGUF: inspect's GGUF path must agree with llama.cpp too
# (`macserve inspect model.gguf` reads those keys, not the config).
GGUF_ALSO = {
    "deepseek-ai__DeepSeek-V4-Flash",
    "zai-org__GLM-5.3-Flash.RECONSTRUCTED",
    "meta-llama__Llama-4-Scout-17B-16E-Instruct",
    "google__gemma-3-27b-it",
    "tencent__Hunyuan-A13B-Instruct",
    "Qwen__Qwen2.5-7B-Instruct",
    "zai-org__GLM-4.7.ABRIDGED",
    "LiquidAI__LFM2.5-VL-1.6B",
    "MiniMaxAI__MiniMax-M1",
    "MiniMaxAI__MiniMax-M3.RECONSTRUCTED",
}
# Contexts past the window + ubatch (a window no shorter than -c 4096 is not seen at 4096):
# Llama 4's chunk, 8,192 + 512 cells; EXAONE 4's window, 4,096 + 512 = 4,608 cells.
MORE_CTX = {
    "meta-llama__Llama-4-Scout-17B-16E-Instruct": (16384,),
    "LGAI-EXAONE__EXAONE-4.0-32B": (8192,),
}


def _cells_at(lay: Layout, ctx: int) -> int:
    """Bytes per cell of the buffers inspect sizes at exactly the padded context."""
    cells = -(-ctx // lay.pad) * lay.pad
    return sum(
        b.row
        for b in lay.buffers
        if Layout(lay.key, [b], pad_compressed=True, pad_window=True).bytes_at(ctx) == b.row * cells
    )


def test_every_listed_config_has_a_mapping():
    for p in MAPPED:
        skeleton_metadata(json.loads(p.read_text()))


@pytest.mark.e2e
@pytest.mark.parametrize("path", MAPPED, ids=lambda p: p.stem)
def test_llama_server_allocates_what_inspect_says(path, llama_server, tmp_path):
    cfg = json.loads(path.read_text())
    gguf = tmp_path / "skeleton.gguf"
    sk = write_skeleton(cfg, gguf, llama_server)
    shapes = [shape_from_config(cfg)]
    if path.stem in GGUF_ALSO:
        shapes.append(shape_from_gguf(read_gguf_file(gguf).gguf_meta))
    for ctx in (CTX, *MORE_CTX.get(path.stem, ())):
        got = llama_truth.caches_of(gguf, sk.arch, llama_server, ctx)
        for shape in shapes:
            lay = layout(shape, "llama.cpp/f16")
            assert lay.supported, lay.reason
            # Every logged figure is MiB rounded to 2 decimals: that is the tolerance, no more.
            want = lay.bytes_at(ctx)
            assert got.mib == pytest.approx(want / 2**20, abs=got.tolerance_mib), (
                ctx,
                want,
                got.lines,
            )
            # The caches of one row per cell of the padded context: what inspect sizes at
            # exactly that many rows (its per-token rows, and windows no shorter than ctx;
            # past every window, inspect's per-token figure).
            per_cell = _cells_at(lay, ctx)
            growing = [l for l in got.lines if l.cells == ctx]
            per = sum(l.mib for l in growing) * 2**20 / ctx
            tol = 0.005 * len(growing) * 2**20 / ctx
            assert per == pytest.approx(per_cell, abs=tol), (ctx, got.lines)
            assert all(t == "f16" for l in growing for _, t, _ in l.parts)


@pytest.mark.e2e
def test_the_skeleton_is_small_and_says_what_llama_cpp_needs(llama_server, tmp_path):
    cfg = json.loads((CONFIGS / "deepseek-ai__DeepSeek-V3.json").read_text())
    path = tmp_path / "s.gguf"
    sk = write_skeleton(cfg, path, llama_server)
    assert sk.arch == "deepseek2" and sk.kv["block_count"] == 61
    assert sk.kv["attention.kv_lora_rank"] == 512 and sk.kv["attention.key_length"] == 576
    assert path.stat().st_blocks * 512 < 8 * 2**20  # a hole, not 671B parameters


def test_unmapped_types_are_one_line_errors():
    with pytest.raises(MacserveError, match="no GGUF mapping"):
        skeleton_metadata({"model_type": "frobnicator", "num_hidden_layers": 2})


@pytest.mark.parametrize(
    "cfg, why",
    [
        ({"model_type": "step3"}, "no text architecture in this llama.cpp build"),
        # convert_hf_to_gguf writes no layer pattern for minimax-01: llama.cpp assumes 1 in 8.
        ({"model_type": "minimax_m1", "attn_type_list": [0, 0, 1]}, "7 lightning"),
    ],
)
def test_what_cannot_be_checked_says_why(cfg, why):
    with pytest.raises(MacserveError, match=why):
        skeleton_metadata({"num_hidden_layers": 3, **cfg})


def test_transformers_minimax_with_lightning_layers_is_minimax_01_not_m2():
    """transformers' `minimax` type covers MiniMax-Text-01 / M1 (layer_types with linear
    attention) as well as M2-style configs: the first is written as minimax-01."""
    m1 = json.loads((CONFIGS / "MiniMaxAI__MiniMax-M1.json").read_text())
    types = ["full_attention" if t else "linear_attention" for t in m1.pop("attn_type_list")]
    sk = skeleton_metadata({**m1, "model_type": "minimax", "layer_types": types})
    assert sk.arch == "minimax-01"
    assert shape_from_config({**m1, "model_type": "minimax", "layer_types": types}).counts() == {
        "linear": 70,
        "full": 10,
    }
    m2 = json.loads((CONFIGS / "MiniMaxAI__MiniMax-M2.5.json").read_text())
    assert skeleton_metadata({**m2, "model_type": "minimax"}).arch == "minimax-m2"


@pytest.mark.e2e
def test_the_dev_command_prints_both_figures(llama_server):
    path = str(CONFIGS / "openai__gpt-oss-120b.json")
    r = CliRunner().invoke(
        main, ["dev", "llama-truth", path, "-c", "1024", "--server", llama_server]
    )
    assert r.exit_code == 0, r.output
    row = next(l for l in r.output.splitlines() if l.startswith("openai__gpt-oss-120b"))
    assert row.split()[1] == "gpt-oss" and row.endswith("agree")
    assert "1 of 1 agree at -c 1024" in r.output
    assert "inspect of the skeleton's GGUF header" not in r.output


@pytest.mark.e2e
def test_the_dev_command_sizes_the_skeletons_gguf_header_too(llama_server):
    """--gguf: the skeleton's own header read as `inspect model.gguf` reads it, beside what
    llama-server allocated (Qwen2.5: the GGUF path reads llama.cpp's keys, not the config)."""
    path = str(CONFIGS / "Qwen__Qwen2.5-7B-Instruct.json")
    r = CliRunner().invoke(
        main, ["dev", "llama-truth", path, "-c", "1024", "--gguf", "--server", llama_server]
    )
    assert r.exit_code == 0, r.output
    row = next(l for l in r.output.splitlines() if l.startswith("Qwen__Qwen2.5-7B-Instruct"))
    llama_mib, inspect_mib = float(row.split()[2]), float(row.split()[3])
    said = next(l for l in r.output.splitlines() if "skeleton's GGUF header:" in l)
    assert float(said.split(":")[1].split()[0]) == pytest.approx(llama_mib, abs=0.01)
    assert inspect_mib == pytest.approx(llama_mib, abs=0.01) and row.endswith("agree")
