"""Every real config in tests/configs against the figures engines allocate, per engine.

EXPECTED is transcribed from the project's reference table (EXPECTED.md). DERIVED holds figures that
EXPECTED.md leaves open ("—" or "derive it"), worked out by hand from the engines' code
(docs/inspect.md shows the arithmetic); they are literals here so the library cannot
agree with itself by construction.
"""

import json

import pytest

from macserve.errors import MacserveError
from macserve.sizing.arch import MLA, Compressed, Linear
from macserve.sizing.arch_config import shape_from_config
from macserve.sizing.kv_layout import (
    kv_bytes_per_token,
    layout,
    max_context,
    state_bytes_per_sequence,
)

from .conftest import CONFIGS

KEYS = ("mlx/bf16", "llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0", "macserve/int2")
_ = None  # "—" in EXPECTED.md: not pinned there

EXPECTED = {
    "deepseek-ai__DeepSeek-V2-Lite": (276480, 31104, 16524, 8748, 6156),
    "deepseek-ai__DeepSeek-V3": (70272, 70272, 37332, 19764, 13908),
    "moonshotai__Kimi-K2-Instruct": (70272, 70272, 37332, 19764, 13908),
    "zai-org__GLM-4.7-Flash.ABRIDGED": (54144, 54144, 28764, 15228, 10716),
    # DSA: mlx-lm's Indexer keeps a zero-filled `values` array as large as its key on every
    # layer (deepseek_v32.py: cache.values = mx.zeros_like(cache.keys)), measured by building
    # the model in mlx-lm: 61 x (1,152 + 256 + 256) and 78 x (1,152 + 256 + 256). The
    # reference table said 85,888 / 109,824 (no values array) until the engine showed otherwise.
    "deepseek-ai__DeepSeek-V3.2": (101504, _, _, _, _),
    "zai-org__GLM-5": (129792, _, _, _, _),
    "zai-org__GLM-5.2": (129792, _, _, _, _),
    "Qwen__Qwen3-Next-80B-A3B-Thinking": (24576, 24576, 13056, 6912, _),
    "Qwen__Qwen3.5-35B-A3B": (20480, 20480, 10880, 5760, _),
    "Qwen__Qwen3-30B-A3B": (98304, 98304, 52224, 27648, _),
    "meta-llama__Meta-Llama-3.1-8B": (131072, 131072, 69632, 36864, _),
    "openai__gpt-oss-120b": (36864, 36864, 19584, 10368, _),
    "XiaomiMiMo__MiMo-V2-Flash": (23040, _, _, _, _),
    "MiniMaxAI__MiniMax-M2.5": (253952, 253952, 134912, 71424, _),
}
# Real configs added with issue 15 (not in EXPECTED.md), derived by hand from the config
# and confirmed by both engines: mlx-lm (tests/test_inspect_measured.py) and llama-server
# (tests/test_llama_truth.py).
ADDED = {
    # Gemma 4: 5 full layers x 2 global KV heads x (512 + 512) x 2 B; the 25 sliding layers
    # (window 1024) are state. q8_0: 1,024-value rows = 32 x 34 B; q4_0: 32 x 18 B.
    "google__gemma-4-26B-A4B": (20480, 20480, 5 * 2 * 1088, 5 * 2 * 576, _),
    # kimi_k25 wraps a deepseek_v3 text config: 61 MLA layers, as Kimi-K2.
    "moonshotai__Kimi-K2.5": (70272, 70272, 37332, 19764, 13908),
    # Kimi-Linear hybrid: 24 MLA layers (512 + 64) of 93; the 69 KDA layers are state.
    "moonshotai__Kimi-K3": (24 * 1152, 24 * 1152, 24 * 612, 24 * 324, 24 * 228),
    # Nemotron-NAS: 49 attention layers x 8 KV heads (64 heads / 8 per group) x (128 + 128)
    # x 2 B; 31 layers have no attention (no_op).
    "nvidia__Llama-3_3-Nemotron-Super-49B-v1": (200704, 200704, 49 * 2 * 1088, 49 * 2 * 576, _),
    # EXAONE 4.0 (LLLG): 16 global layers x 8 KV heads x (128 + 128) x 2 B; the 48 sliding
    # layers (window 4,096) are state. q8_0: 128-value rows = 4 x 34 B; q4_0: 4 x 18 B.
    # mlx-lm's exaone4.make_cache; llama.cpp's models/exaone4.cpp (SWA pattern 4).
    "LGAI-EXAONE__EXAONE-4.0-32B": (65536, 65536, 16 * 8 * 272, 16 * 8 * 144, _),
    # Gemma 3: the text_config has no `sliding_window_pattern`; mlx-lm's gemma3_text and
    # llama.cpp's models/gemma3.cpp both default it to 6: 10 global layers (i % 6 == 5) x 16
    # KV heads x (128 + 128) x 2 B; the 52 sliding layers (window 1,024) are state.
    "google__gemma-3-27b-it": (81920, 81920, 10 * 16 * 272, 10 * 16 * 144, _),
    # Hunyuan-A13B: `use_mla` false (`kv_lora_rank` null, not MLA) and `use_cla` false: GQA
    # on all 32 layers (mlx-lm's hunyuan, llama.cpp's models/hunyuan-moe.cpp), 8 x 256 x 2 B.
    "tencent__Hunyuan-A13B-Instruct": (131072, 131072, 32 * 8 * 272, 32 * 8 * 144, _),
    # Llama 4 Scout: every 4th layer global, 12 x 8 KV heads x (128 + 128) x 2 B; the other
    # 36 attend within chunks of 8,192 tokens (state: mlx-lm's ChunkedKVCache, llama.cpp's
    # iSWA cache with n_swa = 8192).
    "meta-llama__Llama-4-Scout-17B-16E-Instruct": (49152, 49152, 12 * 8 * 272, 12 * 8 * 144, _),
    # Issue 27. Qwen2.5-7B: `use_sliding_window` false, so full attention on all 28 layers,
    # 4 KV heads x (128 + 128) x 2 B (mlx-lm's qwen2, llama.cpp's models/qwen2.cpp).
    "Qwen__Qwen2.5-7B-Instruct": (57344, 57344, 28 * 2 * 4 * 136, 28 * 2 * 4 * 72, _),
    # GLM-4.7 (glm4_moe): GQA on all 92 layers, 8 KV heads x (128 + 128) x 2 B; partial
    # rotary does not change what is cached. llama.cpp's models/glm4-moe.cpp.
    "zai-org__GLM-4.7.ABRIDGED": (376832, 376832, 92 * 2 * 8 * 136, 92 * 2 * 8 * 72, _),
    # LFM2.5-VL (lfm2 text model): 6 attention layers x 8 KV heads x (64 + 64) x 2 B; the 10
    # short-conv layers are state ((3 - 1) x 2,048 values each, f32 in llama.cpp).
    "LiquidAI__LFM2.5-VL-1.6B": (12288, 12288, 6 * 2 * 8 * 68, 6 * 2 * 8 * 36, _),
    # MiniMax-M1 (attn_type_list): 10 softmax layers x 8 KV heads x (128 + 128) x 2 B; the 70
    # lightning layers are state (llama.cpp's models/minimax-01.cpp, recurrent memory).
    "MiniMaxAI__MiniMax-M1": (40960, 40960, 10 * 2 * 8 * 136, 10 * 2 * 8 * 72, _),
    # MiniMax-M3 (reconstructed): 60 layers x 8 KV heads x (128 + 128) x 2 B, and on the 57
    # past the 3 dense ones llama_kv_cache_msa's indexer cache: a 128-wide key and one
    # 128-wide V head (llama.cpp); mlx (no module) the key only.
    "MiniMaxAI__MiniMax-M3.RECONSTRUCTED": (
        60 * 8 * 256 * 2 + 57 * 128 * 2,
        60 * 8 * 256 * 2 + 57 * 256 * 2,
        60 * 2 * 8 * 136 + 57 * 2 * 136,
        60 * 2 * 8 * 72 + 57 * 2 * 72,
        _,
    ),
}
# EXPECTED.md gives a range for GLM-5.3-Flash's mlx/bf16 figure.
GLM53_MLX_RANGE = (11264, 14080)

# Not pinned by EXPECTED.md; from llama.cpp's src/llama-kv-cache*.cpp and mlx-lm's models/.
DERIVED = {
    # llama.cpp DSA: K-only latent row (576) + an indexer-key row (128) on every layer.
    # q8_0: 576 -> 18 x 34 = 612, 128 -> 4 x 34 = 136; q4_0: 18 x 18 = 324, 4 x 18 = 72.
    # int2: 61 x (228 + 136: the engine's 8-bit indexer key, 128 + 2 x 4).
    "deepseek-ai__DeepSeek-V3.2": (_, 85888, 61 * 748, 61 * 396, 61 * 364),
    "zai-org__GLM-5": (_, 109824, 78 * 748, 78 * 396, 78 * 364),
    # llama.cpp honours indexer_types: 78 latent rows + 21 owned indexer rows.
    "zai-org__GLM-5.2": (
        _,
        78 * 1152 + 21 * 256,
        78 * 612 + 21 * 136,
        78 * 324 + 21 * 72,
        78 * 364,
    ),
    # 9 full layers x 4 heads: K 768 values (24 blocks), V 512 (16 blocks).
    "XiaomiMiMo__MiMo-V2-Flash": (_, 23040, 9 * (816 + 544), 9 * (432 + 288), _),
    # 11 nope-only MLA layers: latent 512; llama.cpp's k-pool indexer row is key|gate|pooled
    # = 3 x 128 per token; mlx keeps a 128-wide bf16 key per token (the range's top).
    "zai-org__GLM-5.3-Flash.RECONSTRUCTED": (
        11 * (1024 + 256),
        11 * (1024 + 768),
        11 * (544 + 408),
        11 * (288 + 216),
        11 * (160 + 136),
    ),
    # 21 CSA layers (ratio 4): K 512 per 4 tokens + indexer 128 per 4 tokens; 20 HCA layers
    # (ratio 128): K 512 per 128 tokens. f16: 21 x (256 + 64) + 20 x 8.
    "deepseek-ai__DeepSeek-V4-Flash": (
        6880,
        6880,
        21 * (544 / 4 + 136 / 4) + 20 * 544 / 128,
        21 * (288 / 4 + 72 / 4) + 20 * 288 / 128,
        _,
    ),
}


def _cfg(name):
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _shape(name):
    return shape_from_config(_cfg(name))


def test_every_config_is_covered():
    names = {p.stem for p in CONFIGS.glob("*.json")}
    assert names == set(EXPECTED) | set(DERIVED) | set(ADDED)


@pytest.mark.parametrize("name", sorted(ADDED))
def test_per_token_figures_of_added_configs(name):
    shape = _shape(name)
    for key, want in zip(KEYS, ADDED[name]):
        if want is not None:
            assert kv_bytes_per_token(shape, key) == want, key


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_per_token_figures_match_expected(name):
    shape = _shape(name)
    for key, want in zip(KEYS, EXPECTED[name]):
        if want is not None:
            assert kv_bytes_per_token(shape, key) == want, key


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_per_token_figures_derived_from_engine_code(name):
    shape = _shape(name)
    for key, want in zip(KEYS, DERIVED[name]):
        if want is not None:
            assert kv_bytes_per_token(shape, key) == pytest.approx(want, abs=1e-9), key


def test_glm53_flash_in_expected_range_with_linear_layers_holding_nothing():
    shape = _shape("zai-org__GLM-5.3-Flash.RECONSTRUCTED")
    assert shape.counts() == {"linear": 34, "mla": 11, "mtp": 1}
    per = kv_bytes_per_token(shape, "mlx/bf16")
    lo, hi = GLM53_MLX_RANGE
    assert lo <= per <= hi
    # Our choice: the upper bound (a per-token indexer key; docs/inspect.md says why).
    assert per == hi
    lay = layout(shape, "mlx/bf16")
    linear = {i for i, l in enumerate(shape.layers) if isinstance(l, Linear)}
    assert all(b.grow == "fixed" for b in lay.buffers if b.layer in linear)


def test_kinds_of_layers():
    assert _shape("Qwen__Qwen3-Next-80B-A3B-Thinking").counts() == {"linear": 36, "full": 12}
    assert _shape("Qwen__Qwen3.5-35B-A3B").counts() == {"linear": 30, "full": 10, "mtp": 1}
    assert _shape("openai__gpt-oss-120b").counts() == {"sliding": 18, "full": 18}
    assert _shape("XiaomiMiMo__MiMo-V2-Flash").counts() == {"full": 9, "sliding": 39}
    assert _shape("deepseek-ai__DeepSeek-V3").counts() == {"mla": 61, "mtp": 1}
    assert _shape("zai-org__GLM-5.2").indexers() == {"owned": 21, "shared": 57}
    assert _shape("zai-org__GLM-5").indexers() == {"owned": 78, "shared": 0}
    # Issue 15: hybrids that used to fall back to one kind for every layer.
    assert _shape("moonshotai__Kimi-K3").counts() == {"linear": 69, "mla": 24}
    assert _shape("google__gemma-4-26B-A4B").counts() == {"sliding": 25, "full": 5}
    assert _shape("nvidia__Llama-3_3-Nemotron-Super-49B-v1").counts() == {"full": 49, "none": 31}
    v4 = _shape("deepseek-ai__DeepSeek-V4-Flash")
    assert v4.counts() == {"compressed": 43, "mtp": 1}
    ratios = [l.ratio for l in v4.layers if isinstance(l, Compressed)]
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (2, 21, 20)


def test_kinds_of_layers_of_minimax():
    assert _shape("MiniMaxAI__MiniMax-M1").counts() == {"linear": 70, "full": 10}
    m3 = _shape("MiniMaxAI__MiniMax-M3.RECONSTRUCTED")
    assert m3.counts() == {"full": 60}
    assert [l.indexer for l in m3.layers] == [0] * 3 + [128] * 57


def test_kinds_of_layers_of_published_exaone4():
    assert _shape("LGAI-EXAONE__EXAONE-4.0-32B").counts() == {"sliding": 48, "full": 16}


STATE = {  # bytes per sequence that do not grow with context
    # mlx: ArraysCache conv tail bf16 (8192 x 3) + gated-delta state fp32 (32 x 128 x 128).
    ("Qwen__Qwen3.5-35B-A3B", "mlx/bf16"): 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4),
    # llama.cpp: r and s in f32.
    ("Qwen__Qwen3.5-35B-A3B", "llama.cpp/f16"): 30 * (8192 * 3 * 4 + 32 * 128 * 128 * 4),
    ("Qwen__Qwen3-Next-80B-A3B-Thinking", "mlx/bf16"): 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4),
    # mlx RotatingKVCache(128): 18 layers x 128 tokens x 8 heads x (64 + 64) x 2 B.
    ("openai__gpt-oss-120b", "mlx/bf16"): 18 * 128 * 8 * 128 * 2,
    # llama.cpp SWA cache: PAD(128 + 512 ubatch, 256) = 768 cells.
    ("openai__gpt-oss-120b", "llama.cpp/f16"): 18 * 768 * 8 * 128 * 2,
    ("XiaomiMiMo__MiMo-V2-Flash", "llama.cpp/f16"): 39 * 768 * 8 * 320 * 2,
    # Gemma 4 sliding layers: mlx ring of 1,024 tokens; llama.cpp PAD(1024 + 512) = 1,536
    # cells; 25 layers x 8 KV heads x (256 + 256) x 2 B per token.
    ("google__gemma-4-26B-A4B", "mlx/bf16"): 25 * 1024 * 8192,
    ("google__gemma-4-26B-A4B", "llama.cpp/f16"): 25 * 1536 * 8192,
    # Kimi Delta (69 layers, 96 heads of 128, kernel 4): mlx 3 bf16 conv tails + an fp32
    # state; llama.cpp both f32.
    ("moonshotai__Kimi-K3", "mlx/bf16"): 69 * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4),
    ("moonshotai__Kimi-K3", "llama.cpp/f16"): 69 * (3 * 96 * 128 * 3 * 4 + 96 * 128 * 128 * 4),
    # Kimi Delta: 3 convs of 64 x 128 x 3 (bf16) + a 64 x 128 x 128 fp32 state.
    ("zai-org__GLM-5.3-Flash.RECONSTRUCTED", "mlx/bf16"): 34
    * (3 * 8192 * 3 * 2 + 64 * 128 * 128 * 4),
    # INT2: the first 64 and last 512 tokens, and 16 rows of trim slack, also in bf16
    # (576 x 2 B) on each MLA layer: what the engine's allocator holds (bench engine).
    ("deepseek-ai__DeepSeek-V3", "macserve/int2"): 61 * 592 * 1152,
    ("deepseek-ai__DeepSeek-V3", "llama.cpp/f16"): 0,
    # DeepSeek-V4 in llama.cpp: a 768-cell K window on all 43 layers, f32 compressor states
    # (CSA 2 x 8 x 1024, HCA 2 x 128 x 512, indexer 2 x 8 x 256 floats).
    ("deepseek-ai__DeepSeek-V4-Flash", "llama.cpp/f16"): 43 * 768 * 1024
    + 21 * 2 * 8 * 1024 * 4
    + 20 * 2 * 128 * 512 * 4
    + 21 * 2 * 8 * 256 * 4,
    # EXAONE 4.0 sliding layers: mlx ring of 4,096 tokens; llama.cpp PAD(4096 + 512) = 4,608
    # cells; 48 layers x 8 KV heads x (128 + 128) x 2 B per token.
    ("LGAI-EXAONE__EXAONE-4.0-32B", "mlx/bf16"): 48 * 4096 * 4096,
    ("LGAI-EXAONE__EXAONE-4.0-32B", "llama.cpp/f16"): 48 * 4608 * 4096,
    # Gemma 3: 52 sliding layers x 16 KV heads x (128 + 128) x 2 B per token: mlx a ring of
    # 1,024; llama.cpp PAD(1024 + 512) = 1,536 cells.
    ("google__gemma-3-27b-it", "mlx/bf16"): 52 * 1024 * 8192,
    ("google__gemma-3-27b-it", "llama.cpp/f16"): 52 * 1536 * 8192,
    ("tencent__Hunyuan-A13B-Instruct", "mlx/bf16"): 0,
    # Llama 4: 36 chunked layers x 4,096 B per token: mlx's ChunkedKVCache holds the chunk
    # plus the 256-row step it grows by before trimming; llama.cpp 8,192 + 512 cells.
    ("meta-llama__Llama-4-Scout-17B-16E-Instruct", "mlx/bf16"): 36 * (8192 + 256) * 4096,
    ("meta-llama__Llama-4-Scout-17B-16E-Instruct", "llama.cpp/f16"): 36 * 8704 * 4096,
    # MiniMax-M1 lightning layers: no conv; a 128 x 128 state per head (64 heads) in f32
    # (llama.cpp's n_embd_s with n_embd_head_la = head_dim), 70 layers.
    ("MiniMaxAI__MiniMax-M1", "llama.cpp/f16"): 70 * 64 * 128 * 128 * 4,
    ("MiniMaxAI__MiniMax-M1", "mlx/bf16"): 70 * 64 * 128 * 128 * 4,
    ("MiniMaxAI__MiniMax-M3.RECONSTRUCTED", "llama.cpp/f16"): 0,
}


@pytest.mark.parametrize("name,key", sorted(STATE))
def test_state_per_sequence(name, key):
    assert state_bytes_per_sequence(_shape(name), key) == STATE[(name, key)]


def test_engine_padding_in_bytes_at_context():
    llama = layout(_shape("meta-llama__Meta-Llama-3.1-8B"), "llama.cpp/f16")
    assert llama.bytes_at(1000) == 1024 * 131072  # llama.cpp pads n_ctx to 256 cells
    assert llama.bytes_at(1024) == 1024 * 131072
    oss = layout(_shape("openai__gpt-oss-120b"), "llama.cpp/f16")
    # 300 tokens: 512 cells; the SWA cache min(512, 640) -> 512.
    assert oss.bytes_at(300) == 512 * 36864 + 18 * 512 * 2048
    v4 = layout(_shape("deepseek-ai__DeepSeek-V4-Flash"), "llama.cpp/f16")
    # 1024 tokens: compressed caches hold at least 256 padded cells each.
    assert v4.bytes_at(1024) == (
        43 * 768 * 1024
        + 21 * 256 * 1024
        + 21 * 256 * 256
        + 20 * 256 * 1024
        + (STATE[("deepseek-ai__DeepSeek-V4-Flash", "llama.cpp/f16")] - 43 * 768 * 1024)
    )


def test_max_context_fills_the_budget_exactly():
    shape = _shape("meta-llama__Meta-Llama-3.1-8B")
    budget = 4 * 2**30
    n = max_context(shape, "llama.cpp/f16", budget, weights_bytes=2**30, parallel=2)
    assert n == (3 * 2**30 // 2 // 131072) // 256 * 256  # whole 256-cell steps
    assert max_context(shape, "llama.cpp/f16", 2**29, weights_bytes=2**30) == 0


def test_pure_linear_model_has_zero_kv_per_token():
    cfg = _cfg("Qwen__Qwen3-Next-80B-A3B-Thinking")
    cfg["layer_types"] = ["linear_attention"] * cfg["num_hidden_layers"]
    shape = shape_from_config(cfg)
    for key in ("mlx/bf16", "llama.cpp/f16"):
        assert kv_bytes_per_token(shape, key) == 0
        assert max_context(shape, key, 2**36) == cfg["max_position_embeddings"]


def test_mtp_layers_are_apart_from_the_trunk():
    shape = _shape("deepseek-ai__DeepSeek-V3")
    assert len(shape.layers) == 61 and len(shape.mtp_layers) == 1
    assert isinstance(shape.mtp_layers[0], MLA)
    assert layout(shape, "llama.cpp/f16", mtp=True).per_token == 1152


def test_mlx_figures_follow_the_mlx_lm_module():
    # mlx-lm's deepseek_v2 expands per head; kimi_k2 is remapped to deepseek_v3 (latent).
    assert kv_bytes_per_token(_shape("deepseek-ai__DeepSeek-V2-Lite"), "mlx/bf16") == 276480
    assert kv_bytes_per_token(_shape("moonshotai__Kimi-K2-Instruct"), "mlx/bf16") == 70272


@pytest.mark.parametrize(
    "name,mutate,field",
    [
        ("openai__gpt-oss-120b", lambda c: c.update(layer_types=["weird"] * 36), "layer_types"),
        (
            "openai__gpt-oss-120b",
            lambda c: c.update(layer_types=["full_attention"] * 3),
            "layer_types",
        ),
        (
            "meta-llama__Meta-Llama-3.1-8B",
            lambda c: c.update(model_type="frobnicator"),
            "frobnicator",
        ),
        ("meta-llama__Meta-Llama-3.1-8B", lambda c: c.pop("model_type"), "model_type"),
        (
            "meta-llama__Meta-Llama-3.1-8B",
            lambda c: c.pop("num_hidden_layers"),
            "num_hidden_layers",
        ),
        (
            "meta-llama__Meta-Llama-3.1-8B",
            lambda c: c.update(sliding_window=4096),
            "sliding_window",
        ),
        ("zai-org__GLM-4.7-Flash.ABRIDGED", lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
        ("zai-org__GLM-5.2", lambda c: c["indexer_types"].__setitem__(5, "half"), "indexer_types"),
        (
            "Qwen__Qwen3-Next-80B-A3B-Thinking",
            lambda c: c.pop("linear_num_value_heads"),
            "linear_attn_config",
        ),
        (
            "deepseek-ai__DeepSeek-V4-Flash",
            lambda c: c.update(compress_ratios=[4] * 3),
            "compress_ratios",
        ),
        (
            "XiaomiMiMo__MiMo-V2-Flash",
            lambda c: c["hybrid_layer_pattern"].__setitem__(0, 7),
            "hybrid_layer_pattern",
        ),
    ],
)
def test_unclassifiable_is_an_error_naming_the_field(name, mutate, field):
    cfg = _cfg(name)
    mutate(cfg)
    with pytest.raises(MacserveError, match=field):
        shape_from_config(cfg)


def test_llama_cpp_refuses_compress_ratios_it_does_not_cache():
    cfg = _cfg("deepseek-ai__DeepSeek-V4-Flash")
    cfg["compress_ratios"] = [0, 0] + [8] * 42
    lay = layout(shape_from_config(cfg), "llama.cpp/f16")
    assert not lay.supported and "8" in lay.reason


def test_mlx_sliding_layers_grow_when_the_module_has_no_ring_buffer():
    # mlx-lm's qwen3 module makes a plain KVCache for every layer: a sliding layer there
    # grows with the context, so it counts per token (gpt_oss uses RotatingKVCache).
    cfg = _cfg("openai__gpt-oss-120b")
    assert kv_bytes_per_token(shape_from_config(cfg), "mlx/bf16") == 18 * 2048
    cfg["model_type"] = "qwen3"
    assert kv_bytes_per_token(shape_from_config(cfg), "mlx/bf16") == 36 * 2048
    assert kv_bytes_per_token(shape_from_config(cfg), "llama.cpp/f16") == 18 * 2048
