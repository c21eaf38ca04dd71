"""config.json -> GGUF hyperparameters for the architectures whose layers cache K and V per
head, on every layer or in a sliding window (llama, qwen, gemma, gpt-oss, mimo2, llama4's
chunks, exaone4, deci, glm4moe, ...), as llama.cpp's converter writes them.
"""

from __future__ import annotations

from .skeleton_base import SMALL_FF, Skeleton, base_keys, moe_keys, need
from .skeleton_hybrid import minimax01


def _llama(c):
    kv = base_keys(c)
    moe_keys(kv, c)
    return Skeleton("llama", kv)


def _qwen3moe(c):
    kv = base_keys(c)
    moe_keys(kv, c)
    return Skeleton("qwen3moe" if c.get("num_experts") else "qwen3", kv)


def _qwen2(c):
    # conversion/qwen.py Qwen2Model: the llama keys; Qwen2.5 publishes `sliding_window` with
    # `use_sliding_window: false`, and the converter writes no window for it.
    kv = base_keys(c)
    moe_keys(kv, c)
    return Skeleton("qwen2moe" if kv.get("expert_count") else "qwen2", kv)


def _smollm3(c):
    # conversion/llama.py SmolLM3Model: the llama keys (its NoPE layers, every 4th, still
    # cache K and V; src/models/smollm3.cpp sets the interval itself).
    return Skeleton("smollm3", base_keys(c))


def _hunyuan(c):
    # conversion/hunyuan.py HunYuanMoEModel (use_mla false, use_cla false: plain GQA).
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["expert_shared_feed_forward_length"] = SMALL_FF
    return Skeleton("hunyuan-moe", kv)


def _minimax(c):
    types = c.get("layer_types") or c.get("attn_type_list") or []
    if "linear_attention" in types or 0 in types:
        # transformers' `minimax` type is also MiniMax-Text-01 / M1 (lightning attention).
        return minimax01({**c, "attn_type_list": [int(t in (1, "full_attention")) for t in types]})
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["rope.dimension_count"] = int(c.get("rotary_dim") or kv["attention.key_length"])
    return Skeleton("minimax-m2", kv)


def _gpt_oss(c):
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["attention.sliding_window"] = int(c["sliding_window"])
    types = c.get("layer_types")
    if isinstance(types, list):
        kv["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    return Skeleton("gpt-oss", kv)


def _mimo2(c):
    # convert_hf_to_gguf's MiMoV2 model: per-layer KV heads, 1 = sliding in the pattern.
    kv = base_keys(c)
    moe_keys(kv, c)
    pattern = [bool(p) for p in c["hybrid_layer_pattern"]]
    kv["attention.head_count_kv"] = [
        int(c["swa_num_key_value_heads"] if p else c["num_key_value_heads"]) for p in pattern
    ]
    kv["attention.sliding_window"] = int(c["sliding_window"])
    kv["attention.sliding_window_pattern"] = pattern
    rot = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0
    )
    kv["rope.dimension_count"] = int(kv["attention.key_length"] * float(rot))
    return Skeleton("mimo2", kv)


def _gemma3(c):
    # conversion/gemma.py Gemma3Model: the window only; src/models/gemma3.cpp then applies
    # load_swa_pattern(ml, 6) (5 sliding, 1 global).
    kv = base_keys(c)
    if c.get("sliding_window"):
        kv["attention.sliding_window"] = int(c["sliding_window"])
    return Skeleton("gemma3", kv)


def _gemma4(c):
    kv = base_keys(c)
    moe_keys(kv, c)
    types = c["layer_types"]
    swa = [t == "sliding_attention" for t in types]
    full_hd, swa_hd = int(c["global_head_dim"]), int(c["head_dim"])
    kv["attention.key_length"] = kv["attention.value_length"] = full_hd
    kv["attention.key_length_swa"] = kv["attention.value_length_swa"] = swa_hd
    kv["attention.sliding_window"] = int(c["sliding_window"])
    kv["attention.sliding_window_pattern"] = swa
    kv["attention.shared_kv_layers"] = int(c.get("num_kv_shared_layers") or 0)
    kv["embedding_length_per_layer_input"] = int(c.get("hidden_size_per_layer_input") or 0)
    if c.get("num_global_key_value_heads") is not None:
        g, l = int(c["num_global_key_value_heads"]), int(c["num_key_value_heads"])
        kv["attention.head_count_kv"] = [l if s else g for s in swa]
    kv["rope.dimension_count"] = full_hd
    kv["rope.dimension_count_swa"] = swa_hd
    return Skeleton("gemma4", kv)


def _exaone4(c):
    # conversion/exaone.py Exaone4Model: the window, and a per-layer pattern from layer_types
    # (or the LLLG string / period); src/models/exaone4.cpp reads both.
    kv = base_keys(c)
    if c.get("sliding_window") is not None:
        kv["attention.sliding_window"] = int(c["sliding_window"])
        n, types, pat = kv["block_count"], c.get("layer_types"), c.get("sliding_window_pattern")
        if isinstance(types, list):
            kv["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
        elif isinstance(pat, str) and pat:
            kv["attention.sliding_window_pattern"] = [pat[i % len(pat)] == "L" for i in range(n)]
        elif isinstance(pat, int) and pat > 0:
            kv["attention.sliding_window_pattern"] = [(i + 1) % pat != 0 for i in range(n)]
    return Skeleton("exaone4", kv)


def _llama4(c):
    # convert_hf_to_gguf's Llama4Model (conversion/llama.py): no sliding_window key unless
    # every layer is full attention; llama.cpp's llama4 loader (src/models/llama4.cpp,
    # load_arch_hparams) then makes the layers chunked (3 of every 4) with n_swa = 8192.
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["interleave_moe_layer_step"] = int(c.get("interleave_moe_layer_step") or 1)
    types = c.get("layer_types")
    if isinstance(types, list) and all(t == "full_attention" for t in types):
        kv["attention.sliding_window"] = 0
    return Skeleton("llama4", kv)


def _deci(c):
    # Nemotron-NAS: per-layer KV heads from block_configs (0: no attention in that layer).
    kv = base_keys(c)
    heads = int(c["num_attention_heads"])
    n_kv, n_head = [], []
    for b in c["block_configs"]:
        a = b["attention"]
        if a.get("no_op") or a.get("replace_with_linear"):
            n_kv.append(0)
            n_head.append(0 if a.get("no_op") else heads)
        else:
            n_kv.append(heads // int(a["n_heads_in_group"]))
            n_head.append(heads)
    kv["attention.head_count"] = n_head
    kv["attention.head_count_kv"] = n_kv
    kv["feed_forward_length"] = [SMALL_FF] * len(n_kv)
    return Skeleton("deci", kv)


def _glm4_moe(c):
    # conversion/glm.py Glm4MoeModel: partial rotary, leading dense blocks, one shared
    # expert, and the nextn (MTP) blocks after the trunk (filtered out of the main cache).
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["rope.dimension_count"] = int(
        kv["attention.key_length"] * float(c.get("partial_rotary_factor") or 0.5)
    )
    kv["leading_dense_block_count"] = int(c.get("first_k_dense_replace") or 0)
    kv["expert_shared_count"] = int(c.get("n_shared_experts") or 0)
    kv["expert_weights_scale"] = float(c.get("routed_scaling_factor") or 1.0)
    kv["expert_weights_norm"] = bool(c.get("norm_topk_prob", True))
    kv["expert_gating_func"] = 2  # sigmoid
    nextn = int(c.get("num_nextn_predict_layers") or 0)
    if nextn:
        kv["block_count"] += nextn
        kv["nextn_predict_layers"] = nextn
    return Skeleton("glm4moe", kv)


def _minimax_m3(c):
    # conversion/minimax.py MiniMaxM3Model: MiniMax-M2's keys, the shared experts, the MSA
    # indexer (src/models/minimax-m3.cpp reads all five), and the leading dense blocks (the
    # leading zeros of moe_layer_freq), which have no indexer cache.
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["rope.dimension_count"] = int(c.get("rotary_dim") or kv["attention.key_length"])
    kv["expert_shared_count"] = int(need(c, "n_shared_experts"))
    kv["expert_weights_scale"] = float(c.get("routed_scaling_factor") or 1.0)
    kv["expert_weights_norm"] = True
    kv["expert_gating_func"] = 2  # sigmoid
    sac = need(c, "sparse_attention_config")
    kv["attention.indexer.head_count"] = int(need(sac, "sparse_num_index_heads"))
    kv["attention.indexer.key_length"] = int(need(sac, "sparse_index_dim"))
    kv["attention.indexer.top_k"] = int(need(sac, "sparse_topk_blocks"))
    kv["attention.indexer.block_size"] = int(need(sac, "sparse_block_size"))
    kv["attention.indexer.local_blocks"] = int(need(sac, "sparse_local_block"))
    freq = need(c, "moe_layer_freq")
    kv["leading_dense_block_count"] = next((i for i, v in enumerate(freq) if v != 0), len(freq))
    return Skeleton("minimax-m3", kv)


GQA_ARCHS = {
    "minimax_m3": _minimax_m3,
    "exaone4": _exaone4,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "hunyuan": _hunyuan,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "mimo_v2_flash": _mimo2,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "nemotron-nas": _deci,
    "llama": _llama,
    "mistral": _llama,
    # convert_hf_to_gguf writes Mixtral as llama with experts (MixtralForCausalLM -> LlamaModel).
    "mixtral": _llama,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2,
    "smollm3": _smollm3,
    "glm4_moe": _glm4_moe,
    "qwen3": _qwen3moe,
    "qwen3_moe": _qwen3moe,
    "minimax_m2": _minimax,
    "minimax": _minimax,
    "gpt_oss": _gpt_oss,
}
