"""A model's config -> its shape: one layer kind per layer, plus MTP layers apart.

Every layer is classified from explicit fields (`layer_types`, `full_attention_interval`,
`hybrid_override_pattern`, `hybrid_layer_pattern`, `indexer_types`, MLA dims, GGUF keys).
What cannot be classified raises an error naming the field: a silent fall-back to full
attention is how other estimators end up 5-50x wrong on hybrid models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import MacserveError


@dataclass(frozen=True)
class Full:
    kv_heads: int
    k_dim: int
    v_dim: int
    kind: str = "full"


@dataclass(frozen=True)
class Sliding:
    window: int
    kv_heads: int
    k_dim: int
    v_dim: int
    kind: str = "sliding"


@dataclass(frozen=True)
class Linear:
    """A fixed recurrent state per sequence: conv tail (model dtype) + recurrent (fp32)."""
    conv_elems: int
    state_elems: int
    flavour: str
    kind: str = "linear"


@dataclass(frozen=True)
class MLA:
    latent: int
    rope: int
    heads: int
    k_head: int  # qk_nope + rope: what engines that expand per head cache as K
    v_head: int
    indexer: int = 0  # DSA indexer key width on this layer (0: none)
    indexer_shared: bool = False  # the layer reuses another layer's indexer
    indexer_pool: int = 1  # the indexer key is kept every `pool` tokens
    kind: str = "mla"


@dataclass(frozen=True)
class NoCache:
    kind: str = "none"


@dataclass
class ModelShape:
    model_type: str
    layers: list
    mtp_layers: list = field(default_factory=list)
    max_position_embeddings: int | None = None
    notes: list = field(default_factory=list)

    def counts(self) -> dict:
        out: dict[str, int] = {}
        for l in self.layers:
            out[l.kind] = out.get(l.kind, 0) + 1
        if self.mtp_layers:
            out["mtp"] = len(self.mtp_layers)
        return out


def text_config(config: dict) -> dict:
    """Multimodal configs nest the language model under `text_config`."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and "num_hidden_layers" in tc:
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(tc)
        return merged
    return config


def _req(c: dict, key: str, model_type: str):
    v = c.get(key)
    if v is None:
        raise MacserveError(f"{model_type}: config has no `{key}`; cannot size its cache")
    return v


def _head_dim(c: dict, mt: str) -> int:
    if c.get("head_dim"):
        return int(c["head_dim"])
    return int(_req(c, "hidden_size", mt)) // int(_req(c, "num_attention_heads", mt))


def _full(c: dict, mt: str) -> Full:
    hd = _head_dim(c, mt)
    kvh = int(c.get("num_key_value_heads") or _req(c, "num_attention_heads", mt))
    return Full(kvh, hd, int(c.get("v_head_dim") or hd))


def _mla(c: dict, mt: str, indexer: bool, shared: bool = False) -> MLA:
    rope = int(_req(c, "qk_rope_head_dim", mt)) if "qk_rope_head_dim" in c else 0
    nope = int(_req(c, "qk_nope_head_dim", mt))
    return MLA(
        latent=int(_req(c, "kv_lora_rank", mt)),
        rope=rope,
        heads=int(_req(c, "num_attention_heads", mt)),
        k_head=nope + rope,
        v_head=int(_req(c, "v_head_dim", mt)),
        indexer=int(_req(c, "index_head_dim", mt)) if indexer else 0,
        indexer_shared=shared,
        indexer_pool=int(c.get("index_kpool") or 1),
    )


def _gated_delta(c: dict, mt: str) -> Linear:
    kh, vh = int(_req(c, "linear_num_key_heads", mt)), int(_req(c, "linear_num_value_heads", mt))
    kd, vd = int(_req(c, "linear_key_head_dim", mt)), int(_req(c, "linear_value_head_dim", mt))
    kernel = int(_req(c, "linear_conv_kernel_dim", mt))
    conv_dim = 2 * kh * kd + vh * vd
    return Linear(conv_dim * (kernel - 1), vh * kd * vd, "gated_deltanet")


def _kimi_delta(c: dict, mt: str) -> Linear:
    lc = _req(c, "linear_attn_config", mt)
    heads, hd = int(lc["num_heads"]), int(lc["head_dim"])
    kernel = int(lc.get("short_conv_kernel_size", 4))
    return Linear(3 * heads * hd * (kernel - 1), heads * hd * hd, "kimi_delta")


def _mamba2(c: dict, mt: str) -> Linear:
    heads = int(_req(c, "mamba_num_heads", mt))
    hd = int(_req(c, "mamba_head_dim", mt))
    state = int(_req(c, "ssm_state_size", mt))
    groups = int(c.get("n_groups", 1))
    kernel = int(c.get("conv_kernel", 4))
    conv_dim = heads * hd + 2 * groups * state
    return Linear(conv_dim * (kernel - 1), heads * hd * state, "mamba2")


_MLA_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "deepseek2"}
_DSA_TYPES = {"deepseek_v32", "glm_moe_dsa"}
_FULL_TYPES = {
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "minimax_m2", "minimax",
    "mixtral", "phi3", "gemma", "glm4", "glm4_moe", "olmo2", "granite", "ernie4_5",
    "ernie4_5_moe", "dots1", "hunyuan", "seed_oss",
}


def _linear_for(c: dict, mt: str) -> Linear:
    if "linear_attn_config" in c:
        return _kimi_delta(c, mt)
    if "linear_num_value_heads" in c:
        return _gated_delta(c, mt)
    if "mamba_num_heads" in c:
        return _mamba2(c, mt)
    raise MacserveError(f"{mt}: linear layers but no linear_attn_config / linear_* / mamba_* fields")


def _from_layer_types(c: dict, mt: str) -> list:
    out = []
    for i, t in enumerate(c["layer_types"]):
        if t in ("full_attention", "attention"):
            out.append(_full(c, mt))
        elif t in ("sliding_attention", "sliding_window_attention", "chunked_attention"):
            f = _full(c, mt)
            out.append(Sliding(int(_req(c, "sliding_window", mt)), f.kv_heads, f.k_dim, f.v_dim))
        elif t in ("linear_attention", "mamba", "gated_deltanet", "kimi_delta_attention"):
            out.append(_linear_for(c, mt))
        elif t in ("deepseek_sparse_attention", "mla", "mla_attention"):
            out.append(_mla(c, mt, indexer="index_head_dim" in c))
        else:
            raise MacserveError(f"{mt}: unknown entry {t!r} at layer_types[{i}]")
    return out


def shape_from_config(config: dict) -> ModelShape:
    c = text_config(config)
    mt = c.get("model_type")
    if not mt:
        raise MacserveError("config has no `model_type`")
    n = int(_req(c, "num_hidden_layers", mt))
    mtp_n = int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0)
    notes: list[str] = []

    if c.get("compress_ratios") is not None:
        raise MacserveError(
            f"{mt}: `compress_ratios` (compressed MLA with a sliding window) is not sized yet; "
            "no engine's cache layout for it is settled"
        )
    if "layer_types" in c:
        layers = _from_layer_types(c, mt)
    elif "hybrid_override_pattern" in c:
        layers = []
        for i, ch in enumerate(c["hybrid_override_pattern"]):
            if ch == "*":
                layers.append(_full(c, mt))
            elif ch == "M":
                layers.append(_mamba2(c, mt))
            elif ch in "-E":
                layers.append(NoCache())
            else:
                raise MacserveError(f"{mt}: unknown {ch!r} at hybrid_override_pattern[{i}]")
    elif "full_attention_interval" in c and ("linear_num_value_heads" in c or "linear_attn_config" in c):
        k = int(c["full_attention_interval"])
        layers = [_full(c, mt) if (i + 1) % k == 0 else _linear_for(c, mt) for i in range(n)]
    elif "hybrid_layer_pattern" in c:
        # MiMo-V2: 0 = full attention, 1 = sliding window with its own head counts.
        f = _full(c, mt)
        sw = Sliding(
            int(c.get("sliding_window") or _req(c, "sliding_window_size", mt)),
            int(c.get("swa_num_key_value_heads") or f.kv_heads),
            int(c.get("swa_head_dim") or f.k_dim),
            int(c.get("swa_v_head_dim") or f.v_dim),
        )
        layers = [f if p == 0 else sw for p in c["hybrid_layer_pattern"]]
    elif mt in _DSA_TYPES:
        types = c.get("indexer_types")
        if types is not None and len(types) != n:
            raise MacserveError(f"{mt}: `indexer_types` has {len(types)} entries for {n} layers")
        layers = []
        for i in range(n):
            t = types[i] if types else "full"
            if t not in ("full", "shared"):
                raise MacserveError(f"{mt}: unknown {t!r} at indexer_types[{i}]")
            layers.append(_mla(c, mt, indexer=True, shared=(t == "shared")))
    elif mt in _MLA_TYPES or "kv_lora_rank" in c:
        layers = [_mla(c, mt, indexer=False) for _ in range(n)]
    elif mt in _FULL_TYPES or (mt not in ("qwen3_next",) and c.get("use_sliding_window") is False
                               and "linear_num_value_heads" not in c):
        if c.get("sliding_window") and c.get("use_sliding_window"):
            raise MacserveError(f"{mt}: `use_sliding_window` without `max_window_layers` rules")
        layers = [_full(c, mt) for _ in range(n)]
    else:
        raise MacserveError(
            f"unknown model_type {mt!r}: no layer_types / full_attention_interval / "
            "hybrid_override_pattern / kv_lora_rank to classify its layers"
        )
    if len(layers) != n:
        raise MacserveError(f"{mt}: {len(layers)} layer kinds for num_hidden_layers={n}")
    mtp = [layers[-1] if not isinstance(layers[-1], Linear) else _full(c, mt)] * mtp_n
    if mtp_n and isinstance(layers[0], MLA):
        mtp = [_mla(c, mt, indexer=False) for _ in range(mtp_n)]
    return ModelShape(mt, layers, mtp, c.get("max_position_embeddings"), notes)


def shape_from_gguf(meta: dict) -> ModelShape:
    """llama.cpp's own metadata: `{arch}.*` keys. `block_count` counts nextn layers."""
    arch = meta.get("general.architecture")
    if not arch:
        raise MacserveError("GGUF has no general.architecture")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    blocks = g("block_count")
    if blocks is None:
        raise MacserveError(f"GGUF has no {arch}.block_count")
    nextn = int(g("nextn_predict_layers", 0) or 0)
    n = int(blocks) - nextn
    heads = g("attention.head_count")
    if isinstance(heads, list):
        heads = max(heads)
    if g("attention.kv_lora_rank"):
        kv, rope = int(g("attention.kv_lora_rank")), int(g("rope.dimension_count", 0))
        k_mla = int(g("attention.key_length_mla", 0) or 0)
        l = MLA(kv, rope, int(heads), k_mla, int(g("attention.value_length_mla", 0) or 0))
        return ModelShape(arch, [l] * n, [l] * nextn, g("context_length"))
    kvh = g("attention.head_count_kv", heads)
    kd = int(g("attention.key_length") or int(g("embedding_length")) // int(heads))
    vd = int(g("attention.value_length") or kd)
    if isinstance(kvh, list):
        layers = [Full(int(h), kd, vd) if h else NoCache() for h in kvh]
    else:
        layers = [Full(int(kvh), kd, vd)] * n
    window = g("attention.sliding_window")
    pattern = g("attention.sliding_window_pattern")
    if window and isinstance(pattern, list):
        layers = [Sliding(int(window), l.kv_heads, l.k_dim, l.v_dim) if swa and l.kind == "full" else l
                  for l, swa in zip(layers, pattern)]
    elif window or g("ssm.state_size"):
        raise MacserveError(
            f"GGUF {arch}: `{arch}.attention.sliding_window`/`ssm.*` layouts are not read from "
            "GGUF yet; inspect the model's config.json instead"
        )
    return ModelShape(arch, layers, [layers[-1]] * nextn, g("context_length"))
