"""Real-width test models, made at run time: DeepSeek-V3's attention exactly, random weights.

    model, mtp = synthetic("deepseek-v3", layers=2, dtype=mx.bfloat16)

The attention is DeepSeek-V3's (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64
with its YaRN scaling, nope 128, v 128; from its published config.json), so the cache, the
attention's memory and its speed are what a 61-layer DeepSeek-V3 has per layer. What only
makes the model big is shrunk so it fits a small machine: few layers, a small vocabulary,
narrow MLPs and 4 small experts. The experts are 4-bit (MLX's CPU gather_mm runs only in
float32; gather_qmm runs in bf16 too). "deepseek-v3.2" adds V3.2's DSA indexer (64 heads of
128, top-2048). Speed and memory do not depend on trained values, quality does: nothing here
measures quality.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3, deepseek_v32

from ..mtp_layer import MTPLayer

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), attention and positions verbatim.
DEEPSEEK_V3_ATTENTION = dict(
    hidden_size=7168,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rms_norm_eps=1e-6,
    attention_bias=False,
)
# Shrunk: what only makes the model big.
SMALL_REST = dict(
    vocab_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    first_k_dense_replace=1,
    moe_layer_freq=1,
)
# What DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3) says of the rest of the model: the
# weights a decode step reads (bench engine's Mac projection), not built here.
DEEPSEEK_V3_REST = dict(
    num_hidden_layers=61,
    vocab_size=129280,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
)


def active_weights_per_token(att: dict = DEEPSEEK_V3_ATTENTION, rest: dict = DEEPSEEK_V3_REST):
    """Weights one decode token multiplies by, counted from the config: every layer's
    attention projections, the dense MLPs of the first layers, the routed and shared experts a
    token uses in the others, the routers and the vocabulary head (the embedding reads one
    row). DeepSeek-V3: 36.6 B, its published "37B activated"."""
    h, heads = att["hidden_size"], att["num_attention_heads"]
    qk = att["qk_nope_head_dim"] + att["qk_rope_head_dim"]
    attn = (
        h * att["q_lora_rank"]
        + att["q_lora_rank"] * heads * qk
        + h * (att["kv_lora_rank"] + att["qk_rope_head_dim"])
        + att["kv_lora_rank"] * heads * (att["qk_nope_head_dim"] + att["v_head_dim"])
        + heads * att["v_head_dim"] * h
    )
    n, dense = rest["num_hidden_layers"], rest["first_k_dense_replace"]
    mlp_dense = 3 * h * rest["intermediate_size"]
    experts = rest["num_experts_per_tok"] + rest["n_shared_experts"]
    mlp_moe = 3 * h * rest["moe_intermediate_size"] * experts + h * rest["n_routed_experts"]
    return n * attn + dense * mlp_dense + (n - dense) * mlp_moe + h * rest["vocab_size"]


# DeepSeek-V3.2's indexer (deepseek-ai/DeepSeek-V3.2's config.json).
V32_INDEXER = dict(index_head_dim=128, index_n_heads=64, index_topk=2048)
KINDS = ("deepseek-v3", "deepseek-v3.2")


def config(
    kind: str = "deepseek-v3", layers: int = 2, heads: int | None = None, hidden: int | None = None
) -> dict:
    """`heads`, `hidden`: narrower than DeepSeek-V3, for the tests of what does not depend on
    them (a cache row is kv_lora_rank + rope wide whatever the heads and the hidden size);
    `macserve bench engine --synthetic` always builds the full width."""
    if kind not in KINDS:
        raise ValueError(f"synthetic model kind {kind!r}: one of {', '.join(KINDS)}")
    cfg = dict(
        DEEPSEEK_V3_ATTENTION, **SMALL_REST, num_hidden_layers=layers, num_nextn_predict_layers=1
    )
    if heads:
        cfg.update(num_attention_heads=heads, num_key_value_heads=heads)
    if hidden:
        cfg.update(hidden_size=hidden)
    if kind == "deepseek-v3.2":
        cfg.update(V32_INDEXER, model_type="deepseek_v32")
    else:
        cfg["model_type"] = "deepseek_v3"
    return cfg


def synthetic(
    kind: str = "deepseek-v3",
    layers: int = 2,
    dtype=mx.bfloat16,
    seed: int = 0,
    heads: int | None = None,
    hidden: int | None = None,
):
    """(model, mtp layer) with random weights in `dtype`, experts 4-bit, evaluated."""
    cfg = config(kind, layers, heads, hidden)
    mod = deepseek_v32 if cfg["model_type"] == "deepseek_v32" else deepseek_v3
    mx.random.seed(seed)
    args = mod.ModelArgs.from_dict(cfg)
    model = mod.Model(args)
    mtp = MTPLayer(deepseek_v3.ModelArgs.from_dict(cfg), layers)
    for m in (model, mtp):
        m.set_dtype(dtype)
        nn.quantize(
            m,
            group_size=64,
            bits=4,
            class_predicate=lambda path, mod: "switch_mlp" in path and hasattr(mod, "to_quantized"),
        )
        mx.eval(m.parameters())
    model.args = args
    return model, mtp
