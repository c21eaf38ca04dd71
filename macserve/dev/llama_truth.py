"""What llama.cpp itself allocates for a model config: a shrunken GGUF skeleton, loaded by the
real llama-server, and the cache sizes it logs.

`skeleton_metadata(config)` turns a config.json into the GGUF hyperparameters llama.cpp reads
(as its converter, convert_hf_to_gguf.py, would write them) and keeps everything the KV cache
depends on: layer count and kinds, KV heads, key/value lengths, MLA ranks, sliding windows and
their pattern, SSM and indexer dimensions. What the cache does not depend on is shrunk, so a
skeleton of a 1T-parameter model is a few MB: the vocabulary (64 dummy tokens), FFN and
expert widths, expert counts, the LoRA ranks of queries, and the hidden size where no cache
depends on it (llama.cpp needs explicit key/value lengths then; they are written).

The tensors are not listed by hand: `write_skeleton` asks llama.cpp. Each run of llama-server
on an incomplete skeleton stops at the first tensor it misses ("tensor 'X' not found") or
whose shape it disputes ("expected [a, b], got ..."); the skeleton grows by that tensor (a
placeholder first, then the shape llama.cpp expects, guessed for the next layer from the
previous one) until the model loads. Tensor data is a sparse-file hole (zeros, never
written); nothing is computed (`--no-warmup`).

`measure(config, server, ctx)` then runs `llama-server --fit off --no-warmup -lv 4 -c ctx
-np 1` and parses every cache line llama.cpp prints (`llama_kv_cache: size = ...`,
`llama_memory_recurrent: size = ...`, DeepSeek-V4's `llama_dsv4_comp_state: ... size = ...`),
in MiB with two decimals as logged.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from ..errors import MacserveError

VOCAB = 64  # dummy tokens (tokenizer model "none")
SMALL_FF = 32  # FFN / expert widths in the skeleton
SMALL_EMBD = 256  # hidden size where no cache depends on it
MAX_RUNS = 2000  # tensor-discovery runs before giving up (one per new tensor, about)

_NOT_FOUND = re.compile(r"tensor '([^']+)' not found|missing tensor '([^']+)'")
_WRONG = re.compile(r"tensor '([^']+)' has wrong shape; expected ([\d,\s]+), got")
_KV_LINE = re.compile(
    r"(llama_kv_cache|llama_memory_recurrent)\w*: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers"
)
# llama_dsv4_comp_state (src/llama-kv-cache-dsv4.cpp): DeepSeek-V4's f32 compressor states.
_STATE_LINE = re.compile(
    r"(llama_dsv4_comp_state)\w*: +(\w+) ratio = (\d+), state = (\d+) x (\d+), "
    r"streams = \d+, rs_seq = \d+, layers = +(\d+), size = +([\d.]+) MiB"
)
_PARTS = re.compile(r"([KVRSP]) \((\w+)\): +([\d.]+) MiB")
_COUNT = re.compile(r"wrong number of tensors; expected (\d+), got (\d+)")
_LOADING = re.compile(r"create_tensor: loading tensor (\S+)")
_POISON = (1,)  # a placeholder shape: llama.cpp answers with the one it wants


# ---------------------------------------------------------------------------------------
# config.json -> GGUF hyperparameters


@dataclass
class Skeleton:
    arch: str
    kv: dict  # key (without the "{arch}." prefix unless it has a dot prefix of its own) -> value
    notes: list = field(default_factory=list)


def _tc(config: dict) -> dict:
    tc = config.get("text_config")
    if isinstance(tc, dict) and "num_hidden_layers" in tc:
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(tc)
        return merged
    return config


def _need(c: dict, *keys):
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    raise MacserveError(f"config has none of {', '.join(keys)}: cannot write a skeleton")


def _base(c: dict, n_embd: int | None = None) -> dict:
    """The keys every llama.cpp architecture reads, with the attention geometry explicit."""
    heads = int(_need(c, "num_attention_heads"))
    hd = int(c.get("head_dim") or _need(c, "hidden_size") // heads)
    kv = {
        "block_count": int(_need(c, "num_hidden_layers")),
        "context_length": int(c.get("max_position_embeddings") or 4096),
        "embedding_length": n_embd or SMALL_EMBD,
        "feed_forward_length": SMALL_FF,
        "attention.head_count": heads,
        "attention.head_count_kv": int(c.get("num_key_value_heads") or heads),
        "attention.key_length": hd,
        "attention.value_length": int(c.get("v_head_dim") or hd),
        "attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps") or 1e-6),
        "rope.dimension_count": hd,
        "rope.freq_base": float(c.get("rope_theta") or 10000.0),
    }
    return kv


def _moe(kv: dict, c: dict) -> None:
    n = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if n:
        kv["expert_count"] = 4
        kv["expert_used_count"] = 2
        kv["expert_feed_forward_length"] = SMALL_FF
    if c.get("n_shared_experts") is not None or c.get("num_shared_experts") is not None:
        kv["expert_shared_count"] = int(c.get("n_shared_experts") or c.get("num_shared_experts"))
        kv["expert_shared_feed_forward_length"] = SMALL_FF


def _mla(kv: dict, c: dict) -> None:
    """deepseek2 and kin: MLA as MQA over the latent (convert_hf_to_gguf's DeepseekV2Model)."""
    lat, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
    kv["attention.head_count"] = 4  # MLA caches one latent row whatever the head count
    kv["attention.head_count_kv"] = 1
    kv["attention.kv_lora_rank"] = lat
    kv["attention.key_length"] = lat + rope
    kv["attention.value_length"] = lat
    kv["attention.key_length_mla"] = int(c["qk_nope_head_dim"]) + rope
    kv["attention.value_length_mla"] = int(c["v_head_dim"])
    kv["rope.dimension_count"] = rope
    if c.get("q_lora_rank"):
        kv["attention.q_lora_rank"] = 32
    kv["leading_dense_block_count"] = int(c.get("first_k_dense_replace") or 0)
    kv["expert_count"] = 4
    kv["expert_used_count"] = 2
    kv["expert_feed_forward_length"] = SMALL_FF
    kv["expert_shared_count"] = int(c.get("n_shared_experts") or 0)
    kv["expert_weights_scale"] = float(c.get("routed_scaling_factor") or 1.0)
    kv["expert_gating_func"] = 2  # sigmoid (DeepSeek-V3)


# Model types asked for that are not mapped, and why (issue 27).
UNMAPPED = {
    "step3": "llama-truth: step3 (Step-3, MFA attention) has no text architecture in this "
    "llama.cpp build (src/models/ has step35 for Step-3.5/3.7 only; step3vl is a vision "
    "encoder in tools/mtmd)",
    "step3_vl": "llama-truth: step3 (Step-3, MFA attention) has no text architecture in this "
    "llama.cpp build (src/models/ has step35 for Step-3.5/3.7 only)",
    "minimax_m1": "llama-truth: MiniMax-M1 / Text-01 (lightning attention) is not mapped: "
    "llama.cpp has minimax-01, but inspect does not size lightning-attention layers yet",
    "minimax_text_01": "llama-truth: MiniMax-Text-01 (lightning attention) is not mapped: "
    "llama.cpp has minimax-01, but inspect does not size lightning-attention layers yet",
    "minimax_m3": "llama-truth: minimax_m3 is not mapped yet (llama.cpp has minimax-m3; no "
    "published config of it was found to check against)",
}


def skeleton_metadata(config: dict) -> Skeleton:
    """The llama.cpp architecture and hyperparameters for `config` (raises for the model types
    this tool does not map; the list is `ARCHS`)."""
    mt = config.get("model_type")
    c = _tc(config)
    fn = ARCHS.get(mt) or ARCHS.get(c.get("model_type"))
    if fn is None and (mt in UNMAPPED or c.get("model_type") in UNMAPPED):
        raise MacserveError(UNMAPPED.get(mt) or UNMAPPED[c["model_type"]])
    if fn is None:
        raise MacserveError(
            f"llama-truth: no GGUF mapping for model_type {mt!r} (have: {', '.join(sorted(ARCHS))})"
        )
    return fn(c)


def _llama(c):
    kv = _base(c)
    _moe(kv, c)
    return Skeleton("llama", kv)


def _qwen3moe(c):
    kv = _base(c)
    _moe(kv, c)
    return Skeleton("qwen3moe" if c.get("num_experts") else "qwen3", kv)


def _minimax(c):
    types = c.get("layer_types") or c.get("attn_type_list") or []
    if "linear_attention" in types or 0 in types:
        # transformers' `minimax` type is also MiniMax-Text-01 / M1 (lightning attention).
        raise MacserveError(UNMAPPED["minimax_m1"])
    kv = _base(c)
    _moe(kv, c)
    kv["rope.dimension_count"] = int(c.get("rotary_dim") or kv["attention.key_length"])
    return Skeleton("minimax-m2", kv)


def _deepseek2(c):
    kv = _base(c)
    _mla(kv, c)
    kv["feed_forward_length"] = SMALL_FF
    return Skeleton("deepseek2", kv)


def _dsa(arch):
    def f(c):
        kv = _base(c)
        _mla(kv, c)
        kv["attention.indexer.head_count"] = int(c["index_n_heads"])
        kv["attention.indexer.key_length"] = int(c["index_head_dim"])
        kv["attention.indexer.top_k"] = int(c["index_topk"])
        types = c.get("indexer_types")
        if isinstance(types, list):
            kv["attention.indexer.types"] = [int(t == "full") for t in types]
        return Skeleton(arch, kv)

    return f


def _gpt_oss(c):
    kv = _base(c)
    _moe(kv, c)
    kv["attention.sliding_window"] = int(c["sliding_window"])
    types = c.get("layer_types")
    if isinstance(types, list):
        kv["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    return Skeleton("gpt-oss", kv)


def _qwen_hybrid(arch):
    def f(c):
        kv = _base(c)
        _moe(kv, c)
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


def _mimo2(c):
    # convert_hf_to_gguf's MiMoV2 model: per-layer KV heads, 1 = sliding in the pattern.
    kv = _base(c)
    _moe(kv, c)
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


def _gemma4(c):
    kv = _base(c)
    _moe(kv, c)
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


def _kimi(arch):
    def f(c):
        kv = _base(c)
        _mla(kv, c)
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


def _deci(c):
    # Nemotron-NAS: per-layer KV heads from block_configs (0: no attention in that layer).
    kv = _base(c)
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


def _llama4(c):
    # convert_hf_to_gguf's Llama4Model (conversion/llama.py): no sliding_window key unless
    # every layer is full attention; llama.cpp's llama4 loader (src/models/llama4.cpp,
    # load_arch_hparams) then makes the layers chunked (3 of every 4) with n_swa = 8192.
    kv = _base(c)
    _moe(kv, c)
    kv["interleave_moe_layer_step"] = int(c.get("interleave_moe_layer_step") or 1)
    types = c.get("layer_types")
    if isinstance(types, list) and all(t == "full_attention" for t in types):
        kv["attention.sliding_window"] = 0
    return Skeleton("llama4", kv)


def _deepseek4(c):
    # conversion/deepseek.py DeepseekV4Model.set_gguf_parameters; src/models/deepseek4.cpp
    # load_arch_hparams reads every key below (none optional). block_count is the trunk:
    # the converter counts the MTP layers only in an MTP-only export.
    kv = _base(c)
    n = kv["block_count"]
    kv["attention.head_count_kv"] = int(_need(c, "num_key_value_heads"))
    kv["attention.key_length"] = kv["attention.value_length"] = int(_need(c, "head_dim"))
    kv["rope.dimension_count"] = int(_need(c, "qk_rope_head_dim"))
    kv["attention.q_lora_rank"] = 32
    kv["attention.sliding_window"] = int(_need(c, "sliding_window"))
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
    kv["attention.indexer.head_count"] = int(_need(c, "index_n_heads"))
    kv["attention.indexer.key_length"] = int(_need(c, "index_head_dim"))
    kv["attention.indexer.top_k"] = int(_need(c, "index_topk"))
    kv["attention.output_group_count"] = int(_need(c, "o_groups"))
    kv["attention.output_lora_rank"] = 32
    kv["attention.compress_ratios"] = [int(r) for r in _need(c, "compress_ratios")]
    kv["attention.compress_rope_freq_base"] = float(c.get("compress_rope_theta") or 160000.0)
    kv["hyper_connection.count"] = int(_need(c, "hc_mult"))
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
    kv = _base(c)
    _mla(kv, c)
    types = _need(c, "layer_types")
    nextn = int(c.get("num_nextn_predict_layers") or 0)
    kv["block_count"] = len(types) + nextn
    if nextn:
        kv["nextn_predict_layers"] = nextn
    kv["attention.head_count"] = int(_need(c, "num_attention_heads"))  # KDA: n_head wide
    kv["attention.head_count_kv"] = [0 if t == "linear_attention" else 1 for t in types] + [
        1
    ] * nextn
    lc = _need(c, "linear_attn_config")
    kv["ssm.conv_kernel"] = int(lc.get("short_conv_kernel_size") or 4)
    kv["kda.head_dim"] = int(lc["head_dim"])
    kv["attention.layer_norm_epsilon"] = 1e-6
    kv["expert_shared_count"] = int(c.get("n_shared_experts") or 1)
    kv["expert_weights_norm"] = bool(c.get("norm_topk_prob", True))
    kv["attention.indexer.head_count"] = int(_need(c, "index_n_heads"))
    kv["attention.indexer.key_length"] = int(_need(c, "index_head_dim"))
    kv["attention.indexer.top_k"] = int(_need(c, "index_topk"))
    kv["attention.indexer.kpool"] = int(_need(c, "index_kpool"))
    kv["attention.indexer.kpool_select_tail"] = bool(c.get("index_kpool_always_select_tail", True))
    itypes = c.get("indexer_types")
    if isinstance(itypes, list):
        kv["attention.indexer.types"] = [t == "full" for t in itypes]
    kv["hyper_connection.count"] = int(_need(c, "hc_mult"))
    kv["hyper_connection.sinkhorn_iterations"] = int(c.get("hc_sinkhorn_iters") or 20)
    kv["hyper_connection.epsilon"] = float(c.get("hc_eps") or 1e-6)
    return Skeleton("glm5-next", kv)


def _exaone4(c):
    # conversion/exaone.py Exaone4Model: the window, and a per-layer pattern from layer_types
    # (or the LLLG string / period); src/models/exaone4.cpp reads both.
    kv = _base(c)
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


def _gemma3(c):
    # conversion/gemma.py Gemma3Model: the window only; src/models/gemma3.cpp then applies
    # load_swa_pattern(ml, 6) (5 sliding, 1 global).
    kv = _base(c)
    if c.get("sliding_window"):
        kv["attention.sliding_window"] = int(c["sliding_window"])
    return Skeleton("gemma3", kv)


def _hunyuan(c):
    # conversion/hunyuan.py HunYuanMoEModel (use_mla false, use_cla false: plain GQA).
    kv = _base(c)
    _moe(kv, c)
    kv["expert_shared_feed_forward_length"] = SMALL_FF
    return Skeleton("hunyuan-moe", kv)


def _qwen2(c):
    # conversion/qwen.py Qwen2Model: the llama keys; Qwen2.5 publishes `sliding_window` with
    # `use_sliding_window: false`, and the converter writes no window for it.
    kv = _base(c)
    _moe(kv, c)
    return Skeleton("qwen2moe" if kv.get("expert_count") else "qwen2", kv)


def _smollm3(c):
    # conversion/llama.py SmolLM3Model: the llama keys (its NoPE layers, every 4th, still
    # cache K and V; src/models/smollm3.cpp sets the interval itself).
    return Skeleton("smollm3", _base(c))


def _glm4_moe(c):
    # conversion/glm.py Glm4MoeModel: partial rotary, leading dense blocks, one shared
    # expert, and the nextn (MTP) blocks after the trunk (filtered out of the main cache).
    kv = _base(c)
    _moe(kv, c)
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


def _lfm2(c):
    # conversion/lfm2.py LFM2Model: the short-conv cache, and per-layer KV heads (0: a conv
    # layer, which llama.cpp makes recurrent). The conv state is (L - 1) x n_embd
    # (llama_hparams::n_embd_r), so the hidden size is kept.
    kv = _base(c, int(_need(c, "hidden_size")))
    kv["attention.layer_norm_rms_epsilon"] = float(c.get("norm_eps") or 1e-5)
    kv["shortconv.l_cache"] = int(_need(c, "conv_L_cache"))
    n = kv["block_count"]
    types = c.get("layer_types")
    if isinstance(types, list):
        full = [t == "full_attention" for t in types]
    else:
        idx = set(_need(c, "full_attn_idxs"))
        full = [i in idx for i in range(n)]
    h = kv["attention.head_count_kv"]
    kv["attention.head_count_kv"] = [h if f else 0 for f in full]
    rope = c.get("rope_parameters") or {}
    kv["rope.freq_base"] = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return Skeleton("lfm2", kv)


def _nemotron_h(c):
    # conversion/nemotron.py NemotronHModel: Mamba-2 keys, and per layer the KV heads (only
    # '*' layers attend) and FFN width (0 for Mamba and attention layers).
    kv = _base(c)
    pat = list(_need(c, "hybrid_override_pattern"))
    kv["block_count"] = len(pat)
    heads = int(_need(c, "mamba_num_heads"))
    kv["ssm.conv_kernel"] = int(_need(c, "conv_kernel"))
    kv["ssm.state_size"] = int(_need(c, "ssm_state_size"))
    kv["ssm.group_count"] = int(c.get("n_groups") or 1)
    kv["ssm.time_step_rank"] = heads
    kv["ssm.inner_size"] = heads * int(_need(c, "mamba_head_dim"))
    h = kv["attention.head_count_kv"]
    kv["attention.head_count_kv"] = [h if p == "*" else 0 for p in pat]
    kv["attention.head_count"] = [kv["attention.head_count"] if p == "*" else 0 for p in pat]
    kv["feed_forward_length"] = [SMALL_FF if p in "-E" else 0 for p in pat]
    # src/models/nemotron-h.cpp reads the Mamba norm's epsilon as well as the RMS one.
    kv["attention.layer_norm_epsilon"] = float(c.get("layer_norm_epsilon") or 1e-5)
    if "E" in pat:
        _moe(kv, c)
    return Skeleton("nemotron_h_moe" if "E" in pat else "nemotron_h", kv)


ARCHS = {
    "exaone4": _exaone4,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "hunyuan": _hunyuan,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "deepseek_v4": _deepseek4,
    "glm5_next": _glm5_next,
    "glm5_next_text": _glm5_next,
    "mimo_v2_flash": _mimo2,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "kimi_linear": _kimi("kimi-linear"),
    "kimi_k3": _kimi("kimi-k3"),
    "nemotron-nas": _deci,
    "llama": _llama,
    "mistral": _llama,
    # convert_hf_to_gguf writes Mixtral as llama with experts (MixtralForCausalLM -> LlamaModel).
    "mixtral": _llama,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2,
    "smollm3": _smollm3,
    "glm4_moe": _glm4_moe,
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
    "qwen3": _qwen3moe,
    "qwen3_moe": _qwen3moe,
    "minimax_m2": _minimax,
    "minimax": _minimax,
    "deepseek_v2": _deepseek2,
    "deepseek_v3": _deepseek2,
    "kimi_k2": _deepseek2,
    "kimi_k25": _deepseek2,
    "glm4_moe_lite": _deepseek2,
    "deepseek_v32": _dsa("deepseek32"),
    "glm_moe_dsa": _dsa("glm-dsa"),
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen_hybrid("qwen3next"),
    "qwen3_5_moe": _qwen_hybrid("qwen35moe"),
    "qwen3_5": _qwen_hybrid("qwen35"),
}


# ---------------------------------------------------------------------------------------
# the skeleton file


def _write(path: Path, sk: Skeleton, tensors: dict[str, tuple]) -> None:
    w = gguf.GGUFWriter(str(path), sk.arch)
    w.add_string("tokenizer.ggml.model", "none")
    w.add_uint32(f"{sk.arch}.vocab_size", VOCAB)
    for k, v in sk.kv.items():
        key = f"{sk.arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        else:
            w.add_string(key, str(v))
    for name, shape in tensors.items():
        # gguf-py takes numpy order (outermost first); llama.cpp reports ne order.
        np_shape, n = tuple(reversed(shape)), int(np.prod(shape))
        if len(shape) > 1 and shape[0] % 32 == 0:
            # Matrices as q4_0 (18 B per 32 values): the file, all of it mapped at load, is a
            # quarter of f16's size. Their values are never used.
            w.add_tensor_info(
                name, np_shape, np.dtype(np.float32), n // 32 * 18, gguf.GGMLQuantizationType.Q4_0
            )
        else:
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), 4 * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    start = gguf.GGUFWriter.ggml_pad(f.tell(), w.data_alignment)
    size = sum(
        gguf.GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values()
    )
    f.flush()
    f.truncate(start + size)  # the data: a hole of zeros, never written
    w.close()


def _run(server: str, model: Path, ctx: int, extra=(), timeout: float = 120.0, verbosity=4):
    """llama-server on `model`: (exit code or None if it came up, its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [server, "-m", str(model), "--fit", "off", "--no-warmup", "-lv", str(verbosity)]
    argv += ["-c", str(ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    # Its own session: a crash on a skeleton can make llama.cpp fork a debugger to print a
    # backtrace, and those children must go with it (killpg below).
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    lines: list[str] = []
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break  # it exited
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                line = raw.decode("utf-8", "replace")
                lines.append(line)
                # The caches are made before the scheduler reserves its graphs: what follows
                # (a graph over zero weights, a test decode) is of no interest here.
                if "sched_reserve" in line or "server is listening" in line:
                    return None, "\n".join(lines)
        lines.append(buf.decode("utf-8", "replace"))
        try:
            return p.wait(timeout=30), "\n".join(lines)
        except subprocess.TimeoutExpired:  # alive but silent past the deadline
            return -1, "\n".join(lines + ["(llama-server timed out)"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # the group we started, nothing else
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        p.stdout.close()


def write_skeleton(config: dict, path: Path, server: str, log=lambda m: None) -> Skeleton:
    """Write a skeleton GGUF of `config` that `server` loads, learning its tensors from
    llama.cpp's own errors. Returns the Skeleton (arch and hyperparameters).

    A tensor learned on one layer is guessed, with its shape, for every later layer (most
    layers are alike: about one run per kind of tensor instead of one per tensor). When
    llama.cpp then finds tensors in the file it never asked for, those are dropped: its debug
    log names every tensor it loads (`create_tensor: loading tensor ...`)."""
    sk = skeleton_metadata(config)
    shapes: dict[str, tuple] = {}
    n_layers = int(sk.kv["block_count"])
    killed = 0
    for runs in range(1, MAX_RUNS + 1):
        _write(path, sk, shapes)
        # -lv 5 (debug): the loader names each tensor it loads.
        code, out = _run(server, path, 256, verbosity=5)
        # Loaded: it made all its caches and went on to reserve its graphs (_run stops it
        # there: what follows, a graph over zero weights, does not matter here).
        if code is None:
            log(f"skeleton: {len(shapes)} tensors, {runs} llama-server runs")
            return sk
        if m := _WRONG.search(out):
            name = m.group(1)
            shapes[name] = tuple(int(x) for x in m.group(2).split(",") if x.strip())
            for later in _later(name, n_layers):
                shapes.setdefault(later, shapes[name])
            continue
        if m := _NOT_FOUND.search(out):
            name = m.group(1) or m.group(2)
            if name in shapes:
                raise MacserveError(f"llama-truth: llama.cpp still misses {name!r}")
            shapes[name] = _POISON  # a placeholder: llama.cpp says the shape it wants
            continue
        if _COUNT.search(out):
            asked = set(_LOADING.findall(out))
            unused = [n for n in shapes if n not in asked]
            if not asked or not unused:
                raise MacserveError("llama-truth: cannot tell which tensors llama.cpp left unused")
            for n in unused:
                del shapes[n]
            continue
        if code is not None and code < 0 and killed < 2:
            # Killed by a signal mid-load with nothing said (the OOM killer, on a shared
            # machine): the same run again, twice at most.
            killed += 1
            continue
        errors = [l for l in out.splitlines() if " E " in l or "error" in l.lower()]
        tail = "\n".join((errors or out.splitlines())[-12:])
        raise MacserveError(
            f"llama-truth: llama-server (exit {code}) refused the skeleton:\n{tail}"
        )
    raise MacserveError(f"llama-truth: no loadable skeleton after {MAX_RUNS} runs")


def _later(name: str, n_layers: int) -> list[str]:
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if not m:
        return []
    return [f"blk.{j}.{m.group(2)}" for j in range(int(m.group(1)) + 1, n_layers)]


# ---------------------------------------------------------------------------------------
# what llama.cpp allocates


@dataclass(frozen=True)
class CacheLine:
    """One `size = ...` line: a KV cache (K, V) or a recurrent memory (R, S, P)."""

    module: str
    mib: float
    cells: int
    layers: int
    parts: tuple  # ((letter, type, MiB), ...)


@dataclass(frozen=True)
class LlamaCaches:
    arch: str
    ctx: int
    lines: tuple

    @property
    def mib(self) -> float:
        return sum(line.mib for line in self.lines)

    @property
    def tolerance_mib(self) -> float:
        """Each logged figure is rounded to 0.01 MiB."""
        return 0.005 * len(self.lines) + 1e-9


def parse_caches(log: str) -> tuple:
    out = []
    for line in log.splitlines():
        if m := _STATE_LINE.search(line):
            # kv and score planes, f32: rows = the state's rows (fixed, whatever the context)
            mib = float(m.group(7))
            out.append(
                CacheLine(
                    f"{m.group(1)} ({m.group(2)})",
                    mib,
                    int(m.group(4)),
                    int(m.group(6)),
                    (("S", "f32", mib),),
                )
            )
            continue
        m = _KV_LINE.search(line)
        if not m:
            continue
        parts = tuple((p, t, float(v)) for p, t, v in _PARTS.findall(line))
        out.append(
            CacheLine(m.group(1), float(m.group(2)), int(m.group(3)), int(m.group(4)), parts)
        )
    return tuple(out)


def measure(
    config: dict, server: str, ctx: int, workdir: Path, cache_type: str = "f16", log=lambda m: None
) -> LlamaCaches:
    """Load a skeleton of `config` in llama-server at `-c ctx` and read its cache lines."""
    path = workdir / "skeleton.gguf"
    sk = write_skeleton(config, path, server, log)
    got = caches_of(path, sk.arch, server, ctx, cache_type)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return got


def caches_of(path: Path, arch: str, server: str, ctx: int, cache_type: str = "f16") -> LlamaCaches:
    """The caches llama-server makes for the GGUF at `path` (a skeleton write_skeleton made)
    at `-c ctx -np 1`."""
    extra = ("-ctk", cache_type, "-ctv", cache_type) if cache_type != "f16" else ()
    for _ in range(3):
        code, out = _run(server, path, ctx, extra)
        # code None: it got past making every cache. Anything else (killed mid-way on a
        # loaded machine, say) may have logged only some of them: run again.
        if code is None:
            break
    lines = parse_caches(out)
    if code is not None or not lines:
        tail = "\n".join(out.splitlines()[-15:])
        raise MacserveError(
            f"llama-truth: llama-server (exit {code}) did not make all its caches:\n{tail}"
        )
    return LlamaCaches(arch, ctx, lines)
