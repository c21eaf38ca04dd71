"""config.json -> GGUF hyperparameters for the architectures with latent or recurrent layers:
MLA (deepseek2 and kin), DSA indexers, DeepSeek-V4's compressed attention, KDA (kimi,
glm5-next), gated DeltaNet (qwen3next, qwen35), short convs (lfm2), Mamba-2 (nemotron_h) and
MiniMax-01's lightning attention,
as llama.cpp's converter writes them.
"""

from __future__ import annotations

from ..errors import MacserveError
from .skeleton_base import SMALL_FF, Skeleton, base_keys, mla_keys, moe_keys, need


def _deepseek2(c):
    kv = base_keys(c)
    mla_keys(kv, c)
    kv["feed_forward_length"] = SMALL_FF
    return Skeleton("deepseek2", kv)


def _dsa(arch):
    def f(c):
        kv = base_keys(c)
        mla_keys(kv, c)
        kv["attention.indexer.head_count"] = int(c["index_n_heads"])
        kv["attention.indexer.key_length"] = int(c["index_head_dim"])
        kv["attention.indexer.top_k"] = int(c["index_topk"])
        types = c.get("indexer_types")
        if isinstance(types, list):
            kv["attention.indexer.types"] = [int(t == "full") for t in types]
        return Skeleton(arch, kv)

    return f


def _kimi(arch):
    def f(c):
        kv = base_keys(c)
        mla_keys(kv, c)
        lc = c["linear_attn_config"]
        n = int(c["num_hidden_layers"])
        full = set(lc.get("full_attn_layers") or [])
        kv["attention.head_count"] = int(c["num_attention_heads"])  # KDA state: n_head wide
        kv["attention.head_count_kv"] = [1 if i + 1 in full else 0 for i in range(n)]
        kv["ssm.conv_kernel"] = int(lc.get("short_conv_kernel_size") or 4)
        kv["kda.head_dim"] = int(lc["head_dim"])
        for k, key in (
            ("activation_situ_beta", "activation.situ_beta"),
            ("activation_situ_linear_beta", "activation.situ_linear_beta"),
            ("gate_lower_bound", "kda.gate_lower_bound"),
        ):
            v = c.get(k, lc.get(k))
            if v is not None:
                kv[key] = float(v)
        if c.get("attn_res_block_size") is not None:
            kv["attn_res.block_size"] = int(c["attn_res_block_size"])
        return Skeleton(arch, kv)

    return f


def _deepseek4(c):
    # conversion/deepseek.py DeepseekV4Model.set_gguf_parameters; src/models/deepseek4.cpp
    # load_arch_hparams reads every key below (none optional). block_count is the trunk:
    # the converter counts the MTP layers only in an MTP-only export.
    kv = base_keys(c)
    n = kv["block_count"]
    kv["attention.head_count_kv"] = int(need(c, "num_key_value_heads"))
    kv["attention.key_length"] = kv["attention.value_length"] = int(need(c, "head_dim"))
    kv["rope.dimension_count"] = int(need(c, "qk_rope_head_dim"))
    kv["attention.q_lora_rank"] = 32
    kv["attention.sliding_window"] = int(need(c, "sliding_window"))
    kv["expert_count"] = 4
    kv["expert_used_count"] = 2
    kv["expert_feed_forward_length"] = SMALL_FF
    kv["expert_shared_count"] = int(c.get("n_shared_experts") or 1)
    kv["expert_weights_scale"] = float(c.get("routed_scaling_factor") or 1.0)
    kv["expert_weights_norm"] = bool(c.get("norm_topk_prob", True))
    kv["expert_gating_func"] = 4  # sqrtsoftplus: the only scoring the loader accepts
    limit = float(c.get("swiglu_limit") or 10.0)
    kv["swiglu_clamp_exp"] = [limit] * n
    kv["swiglu_clamp_shexp"] = [limit] * n
    kv["attention.indexer.head_count"] = int(need(c, "index_n_heads"))
    kv["attention.indexer.key_length"] = int(need(c, "index_head_dim"))
    kv["attention.indexer.top_k"] = int(need(c, "index_topk"))
    kv["attention.output_group_count"] = int(need(c, "o_groups"))
    kv["attention.output_lora_rank"] = 32
    kv["attention.compress_ratios"] = [int(r) for r in need(c, "compress_ratios")]
    kv["attention.compress_rope_freq_base"] = float(c.get("compress_rope_theta") or 160000.0)
    kv["hyper_connection.count"] = int(need(c, "hc_mult"))
    kv["hyper_connection.sinkhorn_iterations"] = int(c.get("hc_sinkhorn_iters") or 20)
    kv["hyper_connection.epsilon"] = float(c.get("hc_eps") or 1e-6)
    kv["hash_layer_count"] = int(c.get("num_hash_layers") or 0)
    kv["embedding_length_out"] = kv["embedding_length"] * kv["hyper_connection.count"]
    return Skeleton("deepseek4", kv)


def _glm5_next(c):
    # conversion/glm.py Glm5NextModel.set_gguf_parameters; src/models/glm5-next.cpp
    # load_arch_hparams: KDA layers are the ones with head_count_kv 0, the others nope-only
    # MLA with a k-pool indexer; the NextN block is written after the trunk (as the converter
    # does unless --no-mtp).
    kv = base_keys(c)
    mla_keys(kv, c)
    types = need(c, "layer_types")
    nextn = int(c.get("num_nextn_predict_layers") or 0)
    kv["block_count"] = len(types) + nextn
    if nextn:
        kv["nextn_predict_layers"] = nextn
    kv["attention.head_count"] = int(need(c, "num_attention_heads"))  # KDA: n_head wide
    kv["attention.head_count_kv"] = [0 if t == "linear_attention" else 1 for t in types] + [
        1
    ] * nextn
    lc = need(c, "linear_attn_config")
    kv["ssm.conv_kernel"] = int(lc.get("short_conv_kernel_size") or 4)
    kv["kda.head_dim"] = int(lc["head_dim"])
    kv["attention.layer_norm_epsilon"] = 1e-6
    kv["expert_shared_count"] = int(c.get("n_shared_experts") or 1)
    kv["expert_weights_norm"] = bool(c.get("norm_topk_prob", True))
    kv["attention.indexer.head_count"] = int(need(c, "index_n_heads"))
    kv["attention.indexer.key_length"] = int(need(c, "index_head_dim"))
    kv["attention.indexer.top_k"] = int(need(c, "index_topk"))
    kv["attention.indexer.kpool"] = int(need(c, "index_kpool"))
    kv["attention.indexer.kpool_select_tail"] = bool(c.get("index_kpool_always_select_tail", True))
    itypes = c.get("indexer_types")
    if isinstance(itypes, list):
        kv["attention.indexer.types"] = [t == "full" for t in itypes]
    kv["hyper_connection.count"] = int(need(c, "hc_mult"))
    kv["hyper_connection.sinkhorn_iterations"] = int(c.get("hc_sinkhorn_iters") or 20)
    kv["hyper_connection.epsilon"] = float(c.get("hc_eps") or 1e-6)
    return Skeleton("glm5-next", kv)


def _qwen_hybrid(arch):
    def f(c):
        kv = base_keys(c)
        moe_keys(kv, c)
        kv["rope.dimension_count"] = int(
            kv["attention.key_length"] * float(c.get("partial_rotary_factor") or 1.0)
        )
        kv["ssm.conv_kernel"] = int(c["linear_conv_kernel_dim"])
        kv["ssm.state_size"] = int(c["linear_key_head_dim"])
        kv["ssm.group_count"] = int(c["linear_num_key_heads"])
        kv["ssm.time_step_rank"] = int(c["linear_num_value_heads"])
        kv["ssm.inner_size"] = int(c["linear_value_head_dim"]) * int(c["linear_num_value_heads"])
        kv["full_attention_interval"] = int(c.get("full_attention_interval") or 4)
        if arch != "qwen3next":
            kv["rope.dimension_sections"] = [11, 11, 10, 0]
        return Skeleton(arch, kv)

    return f


def _lfm2(c):
    # conversion/lfm2.py LFM2Model: the short-conv cache, and per-layer KV heads (0: a conv
    # layer, which llama.cpp makes recurrent). The conv state is (L - 1) x n_embd
    # (llama_hparams::n_embd_r), so the hidden size is kept.
    kv = base_keys(c, int(need(c, "hidden_size")))
    kv["attention.layer_norm_rms_epsilon"] = float(c.get("norm_eps") or 1e-5)
    kv["shortconv.l_cache"] = int(need(c, "conv_L_cache"))
    n = kv["block_count"]
    types = c.get("layer_types")
    if isinstance(types, list):
        full = [t == "full_attention" for t in types]
    else:
        idx = set(need(c, "full_attn_idxs"))
        full = [i in idx for i in range(n)]
    h = kv["attention.head_count_kv"]
    kv["attention.head_count_kv"] = [h if f else 0 for f in full]
    rope = c.get("rope_parameters") or {}
    kv["rope.freq_base"] = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return Skeleton("lfm2", kv)


def _nemotron_h(c):
    # conversion/nemotron.py NemotronHModel: Mamba-2 keys, and per layer the KV heads (only
    # '*' layers attend) and FFN width (0 for Mamba and attention layers).
    kv = base_keys(c)
    pat = list(need(c, "hybrid_override_pattern"))
    kv["block_count"] = len(pat)
    heads = int(need(c, "mamba_num_heads"))
    kv["ssm.conv_kernel"] = int(need(c, "conv_kernel"))
    kv["ssm.state_size"] = int(need(c, "ssm_state_size"))
    kv["ssm.group_count"] = int(c.get("n_groups") or 1)
    kv["ssm.time_step_rank"] = heads
    kv["ssm.inner_size"] = heads * int(need(c, "mamba_head_dim"))
    h = kv["attention.head_count_kv"]
    kv["attention.head_count_kv"] = [h if p == "*" else 0 for p in pat]
    kv["attention.head_count"] = [kv["attention.head_count"] if p == "*" else 0 for p in pat]
    kv["feed_forward_length"] = [SMALL_FF if p in "-E" else 0 for p in pat]
    # src/models/nemotron-h.cpp reads the Mamba norm's epsilon as well as the RMS one.
    kv["attention.layer_norm_epsilon"] = float(c.get("layer_norm_epsilon") or 1e-5)
    if "E" in pat:
        moe_keys(kv, c)
    return Skeleton("nemotron_h_moe" if "E" in pat else "nemotron_h", kv)


def minimax01(c):
    # conversion/minimax.py MiniMaxText01Model: the base keys, residual_scale and the rotary
    # width; no layer pattern (src/models/minimax-01.cpp then makes every layer but each 8th
    # a lightning-attention layer, as MiniMax-M1 / Text-01's attn_type_list has it). The
    # lightning state is key_length^2 x head_count per sequence: both kept.
    types = c.get("attn_type_list")
    if isinstance(types, list) and any(t != int((i + 1) % 8 == 0) for i, t in enumerate(types)):
        raise MacserveError(
            "llama-truth: this attn_type_list is not 7 lightning + 1 softmax layers per 8: "
            "convert_hf_to_gguf writes no layer pattern, and llama.cpp's minimax-01 loader "
            "assumes that one"
        )
    kv = base_keys(c)
    moe_keys(kv, c)
    kv["residual_scale"] = float(c.get("layernorm_full_attention_alpha") or 1.0)
    kv["rope.dimension_count"] = int(c.get("rotary_dim") or kv["attention.key_length"])
    return Skeleton("minimax-01", kv)


HYBRID_ARCHS = {
    "minimax_m1": minimax01,
    "minimax_text_01": minimax01,
    "deepseek_v4": _deepseek4,
    "glm5_next": _glm5_next,
    "glm5_next_text": _glm5_next,
    "kimi_linear": _kimi("kimi-linear"),
    "kimi_k3": _kimi("kimi-k3"),
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
    "deepseek_v2": _deepseek2,
    "deepseek_v3": _deepseek2,
    "kimi_k2": _deepseek2,
    "kimi_k25": _deepseek2,
    "glm4_moe_lite": _deepseek2,
    "deepseek_v32": _dsa("deepseek32"),
    "glm_moe_dsa": _dsa("glm-dsa"),
    "qwen3_next": _qwen_hybrid("qwen3next"),
    "qwen3_5_moe": _qwen_hybrid("qwen35moe"),
    "qwen3_5": _qwen_hybrid("qwen35"),
}
