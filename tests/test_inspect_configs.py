"""Every real config in ../shared/configs against the figures in EXPECTED.md (the spec)."""

import json

import pytest

from macserve.arch import shape_from_config
from macserve.errors import MacserveError
from macserve.memory import kv_bytes_per_token, state_bytes_per_sequence

from .conftest import SHARED_CONFIGS

KEYS = ("mlx/bf16", "llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0", "macserve/int2")
# Transcribed from ../shared/configs/EXPECTED.md; None where the table says "—".
EXPECTED = {
    "deepseek-ai__DeepSeek-V2-Lite": (276480, 31104, 16524, 8748, 6156),
    "deepseek-ai__DeepSeek-V3": (70272, 70272, 37332, 19764, 13908),
    "moonshotai__Kimi-K2-Instruct": (70272, 70272, 37332, 19764, 13908),
    "zai-org__GLM-4.7-Flash.ABRIDGED": (54144, 54144, 28764, 15228, 10716),
    "deepseek-ai__DeepSeek-V3.2": (85888,),
    "zai-org__GLM-5": (109824,),
    "zai-org__GLM-5.2": (109824,),
    "Qwen__Qwen3-Next-80B-A3B-Thinking": (24576, 24576, 13056, 6912),
    "Qwen__Qwen3.5-35B-A3B": (20480, 20480, 10880, 5760),
    "Qwen__Qwen3-30B-A3B": (98304, 98304, 52224, 27648),
    "meta-llama__Meta-Llama-3.1-8B": (131072, 131072, 69632, 36864),
    "openai__gpt-oss-120b": (36864, 36864, 19584, 10368),
    "XiaomiMiMo__MiMo-V2-Flash": (23040,),
    "MiniMaxAI__MiniMax-M2.5": (253952, 253952, 134912, 71424),
}


def _shape(name):
    return shape_from_config(json.loads((SHARED_CONFIGS / f"{name}.json").read_text()))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_per_token_figures_match_expected(name):
    shape = _shape(name)
    for key, want in zip(KEYS, EXPECTED[name]):
        assert kv_bytes_per_token(shape, key) == want, key


def test_every_shared_config_is_covered():
    names = {p.stem for p in SHARED_CONFIGS.glob("*.json")}
    assert names - set(EXPECTED) == {
        "zai-org__GLM-5.3-Flash.RECONSTRUCTED", "deepseek-ai__DeepSeek-V4-Flash"}


def test_glm53_flash_linear_layers_hold_nothing_per_token():
    shape = _shape("zai-org__GLM-5.3-Flash.RECONSTRUCTED")
    assert shape.counts() == {"linear": 34, "mla": 11, "mtp": 1}
    per = kv_bytes_per_token(shape, "mlx/bf16")
    # EXPECTED.md gives a range; we honour the indexer's 4-token pooling: 11 x (1024 + 256/4).
    assert 11264 <= per <= 14080 and per == 11 * (1024 + 64)
    assert state_bytes_per_sequence(shape, "mlx/bf16") > 0


def test_linear_state_is_per_sequence_not_per_token():
    shape = _shape("Qwen__Qwen3.5-35B-A3B")
    # 30 x (conv 8192x3 in bf16 + recurrent 32x128x128 in fp32)
    assert state_bytes_per_sequence(shape, "mlx/bf16") == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


def test_shared_indexers_own_none_in_int2():
    full = _shape("zai-org__GLM-5")
    shared = _shape("zai-org__GLM-5.2")
    assert kv_bytes_per_token(shared, "macserve/int2") < kv_bytes_per_token(full, "macserve/int2")


def test_mtp_layers_reported_apart():
    shape = _shape("deepseek-ai__DeepSeek-V3")
    assert len(shape.layers) == 61 and len(shape.mtp_layers) == 1


def test_pure_linear_model_has_zero_kv_per_token():
    cfg = json.loads((SHARED_CONFIGS / "Qwen__Qwen3-Next-80B-A3B-Thinking.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * cfg["num_hidden_layers"]
    assert kv_bytes_per_token(shape_from_config(cfg), "mlx/bf16") == 0


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.update(layer_types=["weird"] * c["num_hidden_layers"]), "layer_types"),
    (lambda c: c.update(model_type="frobnicator"), "frobnicator"),
    (lambda c: c.pop("model_type"), "model_type"),
    (lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
])
def test_unclassifiable_is_an_error_naming_the_field(mutate, field):
    name = "zai-org__GLM-4.7-Flash.ABRIDGED" if field == "kv_lora_rank" else "meta-llama__Meta-Llama-3.1-8B"
    if field == "layer_types":
        name = "openai__gpt-oss-120b"
    cfg = json.loads((SHARED_CONFIGS / f"{name}.json").read_text())
    mutate(cfg)
    with pytest.raises(MacserveError, match=field):
        shape_from_config(cfg)


def test_deepseek_v4_refused_naming_the_field():
    with pytest.raises(MacserveError, match="compress_ratios"):
        _shape("deepseek-ai__DeepSeek-V4-Flash")
