"""What every skeleton shares: the `Skeleton` (a llama.cpp architecture and its GGUF
hyperparameters), the sizes it shrinks to, and the keys most architectures write alike
(attention geometry, experts, MLA). The per-architecture mappings are skeleton_gqa.py and
skeleton_hybrid.py; gguf_skeleton.py picks one for a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MacserveError

SMALL_FF = 32  # FFN / expert widths in the skeleton
SMALL_EMBD = 256  # hidden size where no cache depends on it


@dataclass
class Skeleton:
    arch: str
    kv: dict  # key (without the "{arch}." prefix unless it has a dot prefix of its own) -> value
    notes: list = field(default_factory=list)


def need(c: dict, *keys):
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    raise MacserveError(f"config has none of {', '.join(keys)}: cannot write a skeleton")


def base_keys(c: dict, n_embd: int | None = None) -> dict:
    """The keys every llama.cpp architecture reads, with the attention geometry explicit."""
    heads = int(need(c, "num_attention_heads"))
    hd = int(c.get("head_dim") or need(c, "hidden_size") // heads)
    kv = {
        "block_count": int(need(c, "num_hidden_layers")),
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


def moe_keys(kv: dict, c: dict) -> None:
    n = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if n:
        kv["expert_count"] = 4
        kv["expert_used_count"] = 2
        kv["expert_feed_forward_length"] = SMALL_FF
    if c.get("n_shared_experts") is not None or c.get("num_shared_experts") is not None:
        kv["expert_shared_count"] = int(c.get("n_shared_experts") or c.get("num_shared_experts"))
        kv["expert_shared_feed_forward_length"] = SMALL_FF


def mla_keys(kv: dict, c: dict) -> None:
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
}
