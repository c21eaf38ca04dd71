"""A model's config (or GGUF header) -> its shape: one layer kind per layer, MTP layers apart.

Every layer is classified from explicit fields: `layer_types`, `full_attention_interval`,
`hybrid_override_pattern`, `hybrid_layer_pattern`, `compress_ratios`, `indexer_types`,
`linear_attn_config`, MLA dims, or a GGUF's `{arch}.*` keys. What cannot be classified
raises MacserveError naming the field: a silent fall-back to full attention is how other
estimators end up 5-50x wrong on hybrid models.

The kinds hold model dimensions only; what each engine stores for them (dtypes, padding,
which caches it keeps at all) is memory.py's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MacserveError


@dataclass(frozen=True)
class Full:
    """Full attention (MHA/GQA/MQA): K and V per KV head, per token."""

    kv_heads: int
    k_dim: int
    v_dim: int
    kind: str = "full"


@dataclass(frozen=True)
class Sliding:
    """Sliding-window attention: K and V for the last `window` tokens only. `chunked`
    (Llama 4): attention within fixed chunks of `window` tokens, which the engines cache
    as a window too (mlx-lm's ChunkedKVCache, llama.cpp's iSWA cache)."""

    window: int
    kv_heads: int
    k_dim: int
    v_dim: int
    kind: str = "sliding"
    chunked: bool = False


@dataclass(frozen=True)
class Linear:
    """Linear attention / SSM: a fixed state per sequence, whatever the context.

    conv_elems: the short-convolution tail (kernel - 1 rows); state_elems: the recurrent
    state. Element counts, not bytes: engines keep them in different dtypes.
    """

    flavour: str  # "gated_deltanet" | "kimi_delta" | "mamba2"
    conv_elems: int
    state_elems: int
    kind: str = "linear"


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: a compressed latent + a shared rotary key per token.

    heads/k_head/v_head are what an engine that decompresses per head would store.
    indexer: the DSA lightning-indexer key width on this layer (0: no indexer);
    indexer_shared: the layer reuses another layer's top-k (`indexer_types: shared`);
    indexer_pool: keys are pooled every `pool` tokens at read time (GLM-5.3 `index_kpool`).
    """

    latent: int
    rope: int
    heads: int
    k_head: int
    v_head: int
    indexer: int = 0
    indexer_shared: bool = False
    indexer_pool: int = 1
    kind: str = "mla"


@dataclass(frozen=True)
class Compressed:
    """DeepSeek-V4 attention: one shared K=V row per token (`head_dim`) kept for a sliding
    window, plus, when ratio > 0, one pooled row per `ratio` tokens for the whole context,
    plus a pooled indexer key (`indexer` wide, 0: none) on the layers that select top-k."""

    ratio: int
    head_dim: int
    window: int
    indexer: int = 0
    kind: str = "compressed"


@dataclass(frozen=True)
class NoCache:
    kind: str = "none"


# The model's limit where a published config leaves it out and the loaders fall back to
# their config class's default (transformers' configuration_<model>.py; mlx-lm reads no limit).
DEFAULT_POSITIONS = {
    "gemma3_text": (131_072, "transformers' Gemma3TextConfig"),
    "gemma3": (131_072, "transformers' Gemma3TextConfig"),
}


@dataclass
class ModelShape:
    model_type: str  # what engines dispatch on: config `model_type`, or the GGUF architecture
    layers: list
    mtp_layers: list = field(default_factory=list)
    max_position_embeddings: int | None = None
    source_format: str = "config"  # "config" | "gguf"
    notes: list = field(default_factory=list)

    def counts(self) -> dict:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + 1
        if self.mtp_layers:
            out["mtp"] = len(self.mtp_layers)
        return out

    def indexers(self) -> dict:
        """DSA indexers on MLA layers: owned vs shared (reported apart from the kinds)."""
        mla = [l for l in self.layers if isinstance(l, MLA) and l.indexer]
        if not mla:
            return {}
        shared = sum(1 for l in mla if l.indexer_shared)
        return {"owned": len(mla) - shared, "shared": shared}


# ---------------------------------------------------------------------------------------
# config.json


def text_config(config: dict) -> dict:
    """Multimodal configs nest the language model under `text_config`; flatten it."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and "num_hidden_layers" in tc:
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(tc)
        return merged
    return config


def _req(c: dict, key: str, mt: str):
    v = c.get(key)
    if v is None:
        raise MacserveError(f"{mt}: config has no `{key}`; cannot size its cache")
    return v


def _int(c: dict, key: str, mt: str) -> int:
    v = _req(c, key, mt)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
        raise MacserveError(f"{mt}: `{key}` = {v!r} is not a non-negative integer")
    return int(v)


def _head_dim(c: dict, mt: str) -> int:
    if c.get("head_dim"):
        return _int(c, "head_dim", mt)
    return _int(c, "hidden_size", mt) // _int(c, "num_attention_heads", mt)


def _full(c: dict, mt: str, global_layer: bool = False) -> Full:
    hd = _head_dim(c, mt)
    kvh = (
        _int(c, "num_key_value_heads", mt)
        if c.get("num_key_value_heads") is not None
        else _int(c, "num_attention_heads", mt)
    )
    if global_layer and c.get("global_head_dim"):
        # Gemma 4: full-attention layers have their own head size and, with K = V
        # projections (`attention_k_eq_v`), their own KV head count; K and V are still
        # cached apart (V is normalised differently), so both count.
        hd = _int(c, "global_head_dim", mt)
        if c.get("attention_k_eq_v") and c.get("num_global_key_value_heads"):
            kvh = _int(c, "num_global_key_value_heads", mt)
        return Full(kvh, hd, hd)
    return Full(kvh, hd, _int(c, "v_head_dim", mt) if c.get("v_head_dim") else hd)


def _sliding(c: dict, mt: str) -> Sliding:
    f = _full(c, mt)
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


def _mla(c: dict, mt: str, indexer: bool = False, shared: bool = False) -> MLA:
    rope = _int(c, "qk_rope_head_dim", mt)
    nope = _int(c, "qk_nope_head_dim", mt)
    return MLA(
        latent=_int(c, "kv_lora_rank", mt),
        rope=rope,
        heads=_int(c, "num_attention_heads", mt),
        k_head=nope + rope,
        v_head=_int(c, "v_head_dim", mt),
        indexer=_int(c, "index_head_dim", mt) if indexer else 0,
        indexer_shared=shared,
        indexer_pool=int(c.get("index_kpool") or 1) if indexer else 1,
    )


def _gated_delta(c: dict, mt: str) -> Linear:
    kh, vh = _int(c, "linear_num_key_heads", mt), _int(c, "linear_num_value_heads", mt)
    kd, vd = _int(c, "linear_key_head_dim", mt), _int(c, "linear_value_head_dim", mt)
    kernel = _int(c, "linear_conv_kernel_dim", mt)
    # q, k and v go through one depthwise conv; the state is one Dv x Dk matrix per V head.
    return Linear("gated_deltanet", (2 * kh * kd + vh * vd) * (kernel - 1), vh * vd * kd)


def _kimi_delta(c: dict, mt: str) -> Linear:
    lc = c["linear_attn_config"]
    if not isinstance(lc, dict):
        raise MacserveError(f"{mt}: `linear_attn_config` is not an object")
    heads, hd = _int(lc, "num_heads", mt), _int(lc, "head_dim", mt)
    # mlx-lm's kimi_linear and llama.cpp's converter default the kernel to 4.
    kernel = _int(lc, "short_conv_kernel_size", mt) if "short_conv_kernel_size" in lc else 4
    # Separate q, k, v short convs; a head_dim x head_dim state per head.
    return Linear("kimi_delta", 3 * heads * hd * (kernel - 1), heads * hd * hd)


def _mamba2(c: dict, mt: str) -> Linear:
    heads = _int(c, "mamba_num_heads", mt)
    hd = _int(c, "mamba_head_dim", mt)
    state = _int(c, "ssm_state_size", mt)
    groups = int(c.get("n_groups", 1))
    kernel = _int(c, "conv_kernel", mt)
    return Linear("mamba2", (heads * hd + 2 * groups * state) * (kernel - 1), heads * hd * state)


def _short_conv(c: dict, mt: str) -> Linear:
    # LFM2: a depthwise conv over the hidden state keeps its last L - 1 inputs; no
    # recurrent state.
    return Linear("short_conv", (_int(c, "conv_L_cache", mt) - 1) * _int(c, "hidden_size", mt), 0)


def _linear_for(c: dict, mt: str) -> Linear:
    if "linear_attn_config" in c:
        return _kimi_delta(c, mt)
    if "linear_num_value_heads" in c:
        return _gated_delta(c, mt)
    if "mamba_num_heads" in c:
        return _mamba2(c, mt)
    raise MacserveError(
        f"{mt}: linear-attention layers but no `linear_attn_config`, `linear_*` or `mamba_*` "
        "fields to size their state"
    )


def _indexer_types(c: dict, mt: str, n: int) -> list[bool] | None:
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


_ATTN = ("full_attention", "attention", "global_attention")
_CONV = ("conv", "short_conv")


def _has_mla(c: dict) -> bool:
    # Hunyuan-A13B publishes `"kv_lora_rank": null` beside `"use_mla": false`: no MLA.
    return c.get("kv_lora_rank") is not None


_SLIDING = ("sliding_attention", "sliding_window_attention", "local_attention")
_LINEAR = ("linear_attention", "gated_deltanet", "kimi_delta_attention", "mamba")
_DSA = ("deepseek_sparse_attention", "sparse_attention")


def _from_layer_types(c: dict, mt: str, n: int) -> list:
    types = c["layer_types"]
    if not isinstance(types, list) or len(types) != n:
        raise MacserveError(f"{mt}: `layer_types` must list one entry per layer ({n})")
    shared = _indexer_types(c, mt, n) or [False] * n
    lfm2 = "conv_L_cache" in c  # LFM2: any entry but full attention is a short conv
    out = []
    for i, t in enumerate(types):
        if t in _ATTN:
            out.append(_mla(c, mt) if _has_mla(c) else _full(c, mt, global_layer=True))
        elif t in _CONV or lfm2:
            out.append(_short_conv(c, mt))
        elif t in _SLIDING:
            out.append(_sliding(c, mt))
        elif t in _LINEAR:
            out.append(_linear_for(c, mt))
        elif t in _DSA:
            out.append(_mla(c, mt, indexer=True, shared=shared[i]))
        else:
            raise MacserveError(f"{mt}: unknown entry {t!r} at layer_types[{i}]")
    return out


def _compressed(c: dict, mt: str, n: int, mtp_n: int) -> tuple[list, list]:
    ratios = c["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < n:
        raise MacserveError(f"{mt}: `compress_ratios` must have an entry for each of {n} layers")
    hd = _int(c, "head_dim", mt)
    window = _int(c, "sliding_window", mt)
    idx = _int(c, "index_head_dim", mt)
    if _int(c, "num_key_value_heads", mt) != 1:
        raise MacserveError(
            f"{mt}: compressed attention expects one shared KV head (`num_key_value_heads` = 1)"
        )

    def layer(i, r):
        if not isinstance(r, int) or r < 0:
            raise MacserveError(f"{mt}: bad entry {r!r} at compress_ratios[{i}]")
        # DeepSeek-V4 runs its lightning indexer only on the 4x-compressed (CSA) layers;
        # 128x (HCA) layers attend to every compressed row.
        return Compressed(r, hd, window, idx if r == 4 else 0)

    main = [layer(i, r) for i, r in enumerate(ratios[:n])]
    extra = ratios[n : n + mtp_n] + [0] * max(0, mtp_n - len(ratios[n:]))
    return main, [layer(n + i, r) for i, r in enumerate(extra)]


# Model types whose config says nothing about layer kinds because every layer is full
# attention. An allow-list on purpose: an unknown type is an error, not a guess.
_GEMMA3_TYPES = {"gemma3", "gemma3_text"}
_LLAMA4_TYPES = {"llama4", "llama4_text"}
_DENSE_TYPES = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "minimax_m2",
    "minimax",
    "phi3",
    "phimoe",
    "gemma",
    "glm",
    "glm4",
    "glm4_moe",
    "olmo",
    "olmo2",
    "olmoe",
    "granite",
    "granitemoe",
    "ernie4_5",
    "ernie4_5_moe",
    "dots1",
    "hunyuan",
    "seed_oss",
    "deepseek",
    "internlm2",
    "internlm3",
    "starcoder2",
    "stablelm",
    "cohere",
    "dbrx",
    "exaone",
    "nemotron",
    "smollm3",
    "apertus",
    "gpt_neox",
    "gpt2",
    "hunyuan_v1_dense",
    "mimo",
    "helium",
    "bailing_moe",
    "telechat3",
    "Klear",
    "qwen3_vl",
    "qwen3_vl_moe",
}
_DSA_TYPES = {"deepseek_v32", "glm_moe_dsa"}


def _mtp_count(c: dict) -> int:
    for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if c.get(k):
            return int(c[k])
    if c.get("use_mtp") and c.get("num_mtp_modules"):
        # MiniMax-M2: num_mtp_modules blocks of mtp_transformer_layers each.
        return int(c["num_mtp_modules"]) * int(c.get("mtp_transformer_layers") or 1)
    return 0


def shape_from_config(config: dict) -> ModelShape:
    if not isinstance(config, dict):
        raise MacserveError("config is not a JSON object")
    mt = config.get("model_type")
    if not mt:
        raise MacserveError("config has no `model_type`")
    c = text_config(config)
    n = _int(c, "num_hidden_layers", mt)
    mtp_n = _mtp_count(c)
    mtp: list | None = None

    if c.get("compress_ratios") is not None:
        layers, mtp = _compressed(c, mt, n, mtp_n)
    elif "layer_types" in c:
        layers = _from_layer_types(c, mt, n)
    elif isinstance(c.get("linear_attn_config"), dict) and "kda_layers" in c["linear_attn_config"]:
        # Kimi-Linear hybrids (kimi_linear, kimi_k3): `kda_layers` and `full_attn_layers`
        # list 1-based layer numbers; the others are MLA (or full attention).
        layers = _kimi_hybrid(c, mt, n)
    elif isinstance(c.get("block_configs"), list):
        layers = _nas_blocks(c, mt, n)
    elif "full_attn_idxs" in c and "conv_L_cache" in c:
        idx = set(c["full_attn_idxs"] or [])
        layers = [_full(c, mt) if i in idx else _short_conv(c, mt) for i in range(n)]
    elif c.get("sliding_window") and (
        c.get("sliding_window_pattern") is not None or mt in _GEMMA3_TYPES
    ):
        layers = _sliding_pattern(c, mt, n)
    elif mt in _LLAMA4_TYPES and c.get("attention_chunk_size"):
        # mlx-lm's llama4.make_cache: ChunkedKVCache(attention_chunk_size) on layers with
        # (i + 1) % 4 != 0, a KVCache on every 4th; llama.cpp's llama4 loader marks the same
        # layers chunked (load_swa_pattern(ml, 4)), with n_swa = 8192 whatever the file says
        # (8,192 in every published Llama 4 config).
        chunk = _int(c, "attention_chunk_size", mt)
        f = _full(c, mt)
        layers = [
            f if (i + 1) % 4 == 0 else Sliding(chunk, f.kv_heads, f.k_dim, f.v_dim, chunked=True)
            for i in range(n)
        ]
    elif "hybrid_override_pattern" in c:
        layers = []
        for i, ch in enumerate(c["hybrid_override_pattern"]):
            if ch == "*":
                layers.append(_full(c, mt))
            elif ch == "M":
                layers.append(_mamba2(c, mt))
            elif ch in ("-", "E"):
                layers.append(NoCache())  # MLP / MoE blocks: no attention, no cache
            else:
                raise MacserveError(f"{mt}: unknown {ch!r} at hybrid_override_pattern[{i}]")
        n = len(layers)
    elif "full_attention_interval" in c:
        k = _int(c, "full_attention_interval", mt)
        if k < 1:
            raise MacserveError(f"{mt}: `full_attention_interval` must be >= 1")
        # Qwen3-Next / Qwen3.5: every k-th layer (1-based) is full attention.
        layers = [_full(c, mt) if (i + 1) % k == 0 else _linear_for(c, mt) for i in range(n)]
    elif "hybrid_layer_pattern" in c:
        # MiMo-V2: 0 = full attention, 1 = sliding window (with its own head counts).
        pattern = c["hybrid_layer_pattern"]
        layers = []
        for i, p in enumerate(pattern):
            if p not in (0, 1):
                raise MacserveError(f"{mt}: unknown {p!r} at hybrid_layer_pattern[{i}]")
            layers.append(_full(c, mt) if p == 0 else _sliding(c, mt))
    elif _has_mla(c) or mt in _DSA_TYPES:
        dsa = mt in _DSA_TYPES or "index_topk" in c
        shared = _indexer_types(c, mt, n) or [False] * n
        layers = [_mla(c, mt, indexer=dsa, shared=shared[i]) for i in range(n)]
        mtp = [_mla(c, mt) for _ in range(mtp_n)]
    elif mt in _DENSE_TYPES:
        if c.get("sliding_window") and c.get("use_sliding_window", True):
            raise MacserveError(
                f"{mt}: `sliding_window` is set but no `layer_types` says which layers use it"
            )
        layers = [_full(c, mt) for _ in range(n)]
    else:
        raise MacserveError(
            f"unknown model_type {mt!r}: no `layer_types`, `full_attention_interval`, "
            "`hybrid_override_pattern` or `kv_lora_rank` to classify its layers"
        )
    if len(layers) != n:
        raise MacserveError(f"{mt}: {len(layers)} layer kinds for num_hidden_layers={n}")
    shared_kv = int(c.get("num_kv_shared_layers") or 0)
    if 0 < shared_kv < n:
        # Gemma 3n / 4: the last layers reuse an earlier layer's K and V and cache nothing.
        layers = layers[: n - shared_kv] + [NoCache() for _ in range(shared_kv)]
    if mtp is None:
        # An MTP block is one decoder layer with full (or latent) attention.
        attn = next((l for l in layers if isinstance(l, (Full, MLA))), None)
        if mtp_n and attn is None:
            raise MacserveError(f"{mt}: MTP layers but no attention layer to model them on")
        mtp = [attn] * mtp_n
    max_pos = c.get("max_position_embeddings")
    notes = []
    if not max_pos and mt in DEFAULT_POSITIONS:
        max_pos, where = DEFAULT_POSITIONS[mt]
        notes.append(
            f"the config has no max_position_embeddings: {max_pos:,}, the default of {where}"
        )
    return ModelShape(mt, layers, mtp, int(max_pos) if max_pos else None, "config", notes)


def _kimi_hybrid(c: dict, mt: str, n: int) -> list:
    lc = c["linear_attn_config"]
    kda = lc.get("kda_layers")
    if not isinstance(kda, list) or any(not isinstance(x, int) or not 1 <= x <= n for x in kda):
        raise MacserveError(f"{mt}: `linear_attn_config.kda_layers` must list layers 1..{n}")
    full = lc.get("full_attn_layers")
    if isinstance(full, list) and sorted(set(full) | set(kda)) != list(range(1, n + 1)):
        raise MacserveError(
            f"{mt}: `kda_layers` and `full_attn_layers` must cover layers 1..{n} between them"
        )
    lin = _kimi_delta(c, mt)
    attn = _mla(c, mt) if _has_mla(c) else _full(c, mt)
    return [lin if i + 1 in kda else attn for i in range(n)]


def _nas_blocks(c: dict, mt: str, n: int) -> list:
    """Nemotron-NAS (DeciLM) `block_configs`: per layer, attention may be dropped (`no_op`),
    replaced by a linear map, or GQA with its own `n_heads_in_group`."""
    blocks = c["block_configs"]
    if len(blocks) != n:
        raise MacserveError(f"{mt}: `block_configs` must have one entry per layer ({n})")
    heads = _int(c, "num_attention_heads", mt)
    hd = _head_dim(c, mt)
    out = []
    for i, b in enumerate(blocks):
        a = b.get("attention") if isinstance(b, dict) else None
        if not isinstance(a, dict):
            raise MacserveError(f"{mt}: block_configs[{i}] has no `attention` object")
        if a.get("no_op") or a.get("replace_with_linear"):
            out.append(NoCache())
            continue
        g = a.get("n_heads_in_group")
        if not isinstance(g, int) or g <= 0 or heads % g:
            raise MacserveError(f"{mt}: bad `n_heads_in_group` {g!r} at block_configs[{i}]")
        if a.get("window_length"):
            raise MacserveError(f"{mt}: windowed attention at block_configs[{i}] is not sized")
        out.append(Full(heads // g, hd, hd))
    return out


def _sliding_pattern(c: dict, mt: str, n: int) -> list:
    """`sliding_window_pattern` k (Gemma 3, Cohere 2): layer i is full attention when
    i % k == k - 1, sliding otherwise (mlx-lm's gemma3_text.make_cache and llama.cpp's
    set_swa_pattern agree on this)."""
    # Gemma 3's published configs leave the pattern out: mlx-lm's gemma3_text.ModelArgs and
    # llama.cpp's gemma3 loader (load_swa_pattern(ml, 6)) both default it to 6.
    k = c.get("sliding_window_pattern")
    if k is None and mt in _GEMMA3_TYPES:
        k = 6
    if isinstance(k, str) and k and set(k) <= {"L", "G"}:
        # EXAONE 4: a string of L (local, sliding) and G (global), repeated over the layers.
        return [_full(c, mt) if k[i % len(k)] == "G" else _sliding(c, mt) for i in range(n)]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise MacserveError(f"{mt}: `sliding_window_pattern` = {k!r} is not a positive integer")
    return [_full(c, mt) if i % k == k - 1 else _sliding(c, mt) for i in range(n)]


# ---------------------------------------------------------------------------------------
# GGUF header (llama.cpp's own description of the model)

# llama.cpp's built-in GLM-5.2 indexer pattern, used when a glm-dsa GGUF with a 1M context
# carries no `attention.indexer.types` (src/models/glm-dsa.cpp): 1 = owns its indexer.
_GLM52_INDEXERS = [1, 1] + [1, 0, 0, 0] * 19


def shape_from_gguf(meta: dict) -> ModelShape:
    """Classify from `{arch}.*` keys, following llama.cpp's loaders (src/models/*.cpp).

    `block_count` includes the nextn (MTP) layers; they are reported apart because
    llama.cpp filters them out of the main context's KV cache.
    """
    arch = meta.get("general.architecture")
    if not arch:
        raise MacserveError("GGUF has no general.architecture")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key):
        v = g(key)
        if v is None:
            raise MacserveError(f"GGUF ({arch}) has no `{arch}.{key}`")
        return v

    blocks = int(need("block_count"))
    nextn = int(g("nextn_predict_layers", 0) or 0)
    n = blocks - nextn
    if n <= 0:
        raise MacserveError(
            f"GGUF ({arch}): `{arch}.block_count` {blocks} leaves no trunk "
            f"layers after {nextn} nextn layers"
        )

    def per_layer(key, default):
        v = g(key, default)
        if isinstance(v, dict):  # an array too long to keep: the reader only noted its size
            raise MacserveError(f"GGUF ({arch}): `{arch}.{key}` is too long to read")
        vals = v if isinstance(v, list) else [v] * blocks
        if len(vals) < blocks:
            raise MacserveError(
                f"GGUF ({arch}): `{arch}.{key}` has {len(vals)} entries for {blocks} blocks"
            )
        return [int(x) for x in vals[:blocks]]

    need("attention.head_count")
    heads = per_layer("attention.head_count", None)
    kv_heads = (
        per_layer("attention.head_count_kv", None)
        if g("attention.head_count_kv") is not None
        else heads
    )
    n_embd = int(need("embedding_length"))
    k_len = int(g("attention.key_length") or n_embd // max(heads[0], 1))
    v_len = int(g("attention.value_length") or k_len)
    ctx = g("context_length")
    notes: list[str] = []

    def done(layers):
        trunk, mtp = layers[:n], layers[n:]
        return ModelShape(arch, trunk, mtp, int(ctx) if ctx else None, "gguf", notes)

    # llama.cpp treats a model as MLA (K-only cache of key_length per head_count_kv) only
    # when both *_length_mla keys exist; older deepseek2 GGUFs cache full K and V per head.
    is_mla = bool(g("attention.key_length_mla")) and bool(g("attention.value_length_mla"))

    if arch == "deepseek4":
        need("attention.compress_ratios")
        ratios = per_layer("attention.compress_ratios", None)
        window = int(need("attention.sliding_window"))
        idx = int(need("attention.indexer.key_length"))
        return done([Compressed(r, k_len, window, idx if r == 4 else 0) for r in ratios])

    if g("attention.kv_lora_rank") and arch in (
        "deepseek2",
        "deepseek2-ocr",
        "deepseek32",
        "glm-dsa",
        "glm5-next",
        "mistral4",
        "hy-v4",
        "kimi-k3",
    ):
        if not is_mla:
            notes.append("pre-MLA GGUF (no key_length_mla): llama.cpp caches K and V per head")
            return done([Full(h, k_len, v_len) for h in kv_heads])
        latent = int(need("attention.kv_lora_rank"))
        rope = int(g("rope.dimension_count", 0) or 0)
        if k_len != latent + rope:
            raise MacserveError(
                f"GGUF ({arch}): `{arch}.attention.key_length` {k_len} != "
                f"kv_lora_rank {latent} + rope {rope}"
            )
        idx = int(g("attention.indexer.key_length", 0) or 0)
        pool = int(g("attention.indexer.kpool", 1) or 1)
        if arch == "deepseek32" or (arch == "glm-dsa" and idx):
            full = [1] * n
            if arch == "glm-dsa" and int(ctx or 0) >= 1048576:
                full = _GLM52_INDEXERS[:n]
        elif arch == "glm5-next":
            full = [1] * n
        else:
            full, idx = [0] * n, 0
        types = g("attention.indexer.types")
        if isinstance(types, list) and idx:
            full = [int(bool(t)) for t in types[:n]]
        k_mla = int(need("attention.key_length_mla"))
        v_mla = int(need("attention.value_length_mla"))
        layers = []
        for i in range(blocks):
            if arch == "glm5-next" and kv_heads[i] == 0:
                layers.append(_gguf_linear(g, need, arch, heads[i], "kimi_delta"))
                continue
            owned = i < n and full[i] if idx else False
            layers.append(
                MLA(
                    latent,
                    rope,
                    heads[i],
                    k_mla,
                    v_mla,
                    indexer=idx if (idx and i < n) else 0,
                    indexer_shared=bool(idx and i < n and not owned),
                    indexer_pool=pool,
                )
            )
        return done(layers)

    if arch in ("qwen3next", "qwen35", "qwen35moe"):
        recr = g("attention.recurrent_layers")
        if isinstance(recr, list):
            is_recr = [bool(x) for x in recr[:blocks]]
        else:
            k = int(g("full_attention_interval", 4))
            is_recr = [i < n and (i + 1) % k != 0 for i in range(blocks)]
        lin = _gguf_linear(g, need, arch, heads[0], "gated_deltanet")
        return done([lin if is_recr[i] else Full(kv_heads[i], k_len, v_len) for i in range(blocks)])

    if arch in ("lfm2", "lfm2moe"):
        # src/models/lfm2.cpp: a layer without KV heads is a short conv, whose recurrent
        # state is (l_cache - 1) x n_embd values (llama_hparams::n_embd_r); no s state.
        conv = Linear("short_conv", (int(need("shortconv.l_cache")) - 1) * n_embd, 0)
        return done([Full(h, k_len, v_len) if h else conv for h in kv_heads])

    if g("ssm.state_size") is not None or g("ssm.conv_kernel") is not None:
        raise MacserveError(
            f"GGUF ({arch}): recurrent layout (`{arch}.ssm.*`) of this "
            "architecture is not read from GGUF; inspect its config.json"
        )

    window = g("attention.sliding_window")
    pattern = g("attention.sliding_window_pattern")
    if arch == "llama4":
        # src/models/llama4.cpp, llama_model_llama4::load_arch_hparams: a sliding_window of 0
        # (the converter writes one only when every layer is full attention) turns chunking
        # off; otherwise the layers load_swa_pattern(ml, 4) marks (il % 4 < 3: 3 chunked, 1
        # full) attend within chunks of n_swa = 8192, hard-coded whatever the file says.
        # llama_kv_cache_iswa sizes the chunked cache as a sliding one: min(n_ctx, n_swa +
        # n_ubatch) cells, padded to 256 (checked by tests/test_llama_truth.py).
        if window is not None and int(window) == 0:
            return done([Full(h, k_len, v_len) for h in kv_heads])
        window, pattern = 8192, 4 if pattern is None else pattern
    if window:
        if pattern is None and arch in ("gpt-oss",):
            pattern = 2  # llama.cpp's openai-moe loader: load_swa_pattern(ml, 2)
        if pattern is None and arch == "gemma3":
            # src/models/gemma3.cpp, llama_model_gemma3::load_arch_hparams: load_swa_pattern(
            # ml, 6) when the file has none (convert_hf_to_gguf's Gemma3Model writes none).
            pattern = 6
        if isinstance(pattern, list):
            swa = [bool(x) for x in pattern[:blocks]] + [False] * (blocks - len(pattern))
        elif isinstance(pattern, int):
            # set_swa_pattern(n): layer il is SWA when il % n < n - 1 (n = 0: all SWA).
            swa = [
                pattern == 0 or (i % pattern < pattern - 1) if i < n else False
                for i in range(blocks)
            ]
        else:
            raise MacserveError(
                f"GGUF ({arch}): `{arch}.attention.sliding_window` without "
                f"`{arch}.attention.sliding_window_pattern`; cannot tell "
                "which layers slide"
            )
        k_swa = int(g("attention.key_length_swa") or k_len)
        v_swa = int(g("attention.value_length_swa") or v_len)
        return done(
            [
                Sliding(int(window), kv_heads[i], k_swa, v_swa, chunked=arch == "llama4")
                if swa[i]
                else Full(kv_heads[i], k_len, v_len)
                for i in range(blocks)
            ]
        )

    return done([Full(h, k_len, v_len) if h else NoCache() for h in kv_heads])


def _gguf_linear(g, need, arch: str, n_head: int, flavour: str) -> Linear:
    """Recurrent state sizes as llama.cpp computes them (llama_hparams::n_embd_r/s)."""
    d_conv = int(need("ssm.conv_kernel"))
    if flavour == "kimi_delta":
        hd = int(need("kda.head_dim"))
        return Linear(flavour, 3 * (d_conv - 1) * n_head * hd, hd * hd * n_head)
    d_inner, d_state = int(need("ssm.inner_size")), int(need("ssm.state_size"))
    groups = int(need("ssm.group_count"))
    return Linear(flavour, (d_conv - 1) * (d_inner + 2 * groups * d_state), d_state * d_inner)
