"""config.json fields -> one layer's kind: the dimensions of a full, sliding, latent (MLA) or
linear-attention layer, read from the config's own keys, each missing or malformed key an
error naming it. Which layer gets which kind is arch_config.py's business.
"""

from __future__ import annotations

from ..errors import MacserveError
from .arch import MLA, Full, Linear, Sliding

# MiniMax-01 (Text-01, M1): transformers' `minimax` (layer_types) and the remote code's
# `minimax_m1` / `minimax_text_01` (attn_type_list: 0 = lightning, 1 = softmax attention).
MINIMAX01_TYPES = ("minimax", "minimax_m1", "minimax_text_01", "MiniMaxM1", "MiniMaxText01")


def required(c: dict, key: str, mt: str):
    v = c.get(key)
    if v is None:
        raise MacserveError(f"{mt}: config has no `{key}`; cannot size its cache")
    return v


def uint(c: dict, key: str, mt: str) -> int:
    v = required(c, key, mt)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
        raise MacserveError(f"{mt}: `{key}` = {v!r} is not a non-negative integer")
    return int(v)


def head_dim(c: dict, mt: str) -> int:
    if c.get("head_dim"):
        return uint(c, "head_dim", mt)
    return uint(c, "hidden_size", mt) // uint(c, "num_attention_heads", mt)


def full_layer(c: dict, mt: str, global_layer: bool = False) -> Full:
    hd = head_dim(c, mt)
    kvh = (
        uint(c, "num_key_value_heads", mt)
        if c.get("num_key_value_heads") is not None
        else uint(c, "num_attention_heads", mt)
    )
    if global_layer and c.get("global_head_dim"):
        # Gemma 4: full-attention layers have their own head size and, with K = V
        # projections (`attention_k_eq_v`), their own KV head count; K and V are still
        # cached apart (V is normalised differently), so both count.
        hd = uint(c, "global_head_dim", mt)
        if c.get("attention_k_eq_v") and c.get("num_global_key_value_heads"):
            kvh = uint(c, "num_global_key_value_heads", mt)
        return Full(kvh, hd, hd)
    return Full(kvh, hd, uint(c, "v_head_dim", mt) if c.get("v_head_dim") else hd)


def sliding_layer(c: dict, mt: str) -> Sliding:
    f = full_layer(c, mt)
    window = c.get("sliding_window") or c.get("sliding_window_size")
    if not window:
        raise MacserveError(f"{mt}: sliding layers but no `sliding_window`")
    # MiMo-V2 gives sliding layers their own head counts and dims.
    return Sliding(
        int(window),
        int(c.get("swa_num_key_value_heads") or f.kv_heads),
        int(c.get("swa_head_dim") or f.k_dim),
        int(c.get("swa_v_head_dim") or f.v_dim),
    )


def mla_layer(c: dict, mt: str, indexer: bool = False, shared: bool = False) -> MLA:
    rope = uint(c, "qk_rope_head_dim", mt)
    nope = uint(c, "qk_nope_head_dim", mt)
    return MLA(
        latent=uint(c, "kv_lora_rank", mt),
        rope=rope,
        heads=uint(c, "num_attention_heads", mt),
        k_head=nope + rope,
        v_head=uint(c, "v_head_dim", mt),
        indexer=uint(c, "index_head_dim", mt) if indexer else 0,
        indexer_shared=shared,
        indexer_pool=int(c.get("index_kpool") or 1) if indexer else 1,
    )


def gated_delta_layer(c: dict, mt: str) -> Linear:
    kh, vh = uint(c, "linear_num_key_heads", mt), uint(c, "linear_num_value_heads", mt)
    kd, vd = uint(c, "linear_key_head_dim", mt), uint(c, "linear_value_head_dim", mt)
    kernel = uint(c, "linear_conv_kernel_dim", mt)
    # q, k and v go through one depthwise conv; the state is one Dv x Dk matrix per V head.
    return Linear("gated_deltanet", (2 * kh * kd + vh * vd) * (kernel - 1), vh * vd * kd)


def kimi_delta_layer(c: dict, mt: str) -> Linear:
    lc = c["linear_attn_config"]
    if not isinstance(lc, dict):
        raise MacserveError(f"{mt}: `linear_attn_config` is not an object")
    heads, hd = uint(lc, "num_heads", mt), uint(lc, "head_dim", mt)
    # mlx-lm's kimi_linear and llama.cpp's converter default the kernel to 4.
    kernel = uint(lc, "short_conv_kernel_size", mt) if "short_conv_kernel_size" in lc else 4
    # Separate q, k, v short convs; a head_dim x head_dim state per head.
    return Linear("kimi_delta", 3 * heads * hd * (kernel - 1), heads * hd * hd)


def mamba2_layer(c: dict, mt: str) -> Linear:
    heads = uint(c, "mamba_num_heads", mt)
    hd = uint(c, "mamba_head_dim", mt)
    state = uint(c, "ssm_state_size", mt)
    groups = int(c.get("n_groups", 1))
    kernel = uint(c, "conv_kernel", mt)
    return Linear("mamba2", (heads * hd + 2 * groups * state) * (kernel - 1), heads * hd * state)


def short_conv_layer(c: dict, mt: str) -> Linear:
    # LFM2: a depthwise conv over the hidden state keeps its last L - 1 inputs; no
    # recurrent state.
    return Linear("short_conv", (uint(c, "conv_L_cache", mt) - 1) * uint(c, "hidden_size", mt), 0)


def lightning_layer(c: dict, mt: str) -> Linear:
    # MiniMax-01 / M1 lightning attention: no convolution; a head_dim x head_dim state per
    # attention head (llama.cpp's n_embd_s with n_embd_head_la = head_dim).
    hd = head_dim(c, mt)
    return Linear("lightning", 0, uint(c, "num_attention_heads", mt) * hd * hd)


def linear_layer(c: dict, mt: str) -> Linear:
    if "attn_type_list" in c or mt in MINIMAX01_TYPES:
        return lightning_layer(c, mt)
    if "linear_attn_config" in c:
        return kimi_delta_layer(c, mt)
    if "linear_num_value_heads" in c:
        return gated_delta_layer(c, mt)
    if "mamba_num_heads" in c:
        return mamba2_layer(c, mt)
    raise MacserveError(
        f"{mt}: linear-attention layers but no `linear_attn_config`, `linear_*`, `mamba_*` or "
        "`attn_type_list` fields to size their state"
    )


def shared_indexers(c: dict, mt: str, n: int) -> list[bool] | None:
    """Per layer: True when the layer shares another layer's indexer."""
    types = c.get("indexer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise MacserveError(f"{mt}: `indexer_types` must list one entry per layer ({n})")
    out = []
    for i, t in enumerate(types):
        if t not in ("full", "shared"):
            raise MacserveError(f"{mt}: unknown {t!r} at indexer_types[{i}]")
        out.append(t == "shared")
    return out


def has_mla(c: dict) -> bool:
    # Hunyuan-A13B publishes `"kv_lora_rank": null` beside `"use_mla": false`: no MLA.
    return c.get("kv_lora_rank") is not None
