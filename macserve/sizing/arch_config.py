"""config.json -> ModelShape: which layer is which kind, per model family.

Every layer is classified from explicit fields: `layer_types`, `full_attention_interval`,
`hybrid_override_pattern`, `hybrid_layer_pattern`, `compress_ratios`, `indexer_types`,
`linear_attn_config`, `block_configs`, `sliding_window_pattern`, MLA dims, or an allow-list
of dense model types. What cannot be classified raises MacserveError naming the field: a
silent fall-back to full attention is how other estimators end up 5-50x wrong on hybrid
models. The dimensions of each kind are read by arch_fields.py.
"""

from __future__ import annotations

from ..errors import MacserveError
from ..hf_config import text_config
from .arch import MLA, Compressed, Full, ModelShape, NoCache, Sliding
from .arch_fields import (
    full_layer,
    has_mla,
    head_dim,
    kimi_delta_layer,
    linear_layer,
    mamba2_layer,
    mla_layer,
    shared_indexers,
    short_conv_layer,
    sliding_layer,
    uint,
)

# The model's limit where a published config leaves it out and the loaders fall back to
# their config class's default (transformers' configuration_<model>.py; mlx-lm reads no limit).
DEFAULT_POSITIONS = {
    "gemma3_text": (131_072, "transformers' Gemma3TextConfig"),
    "gemma3": (131_072, "transformers' Gemma3TextConfig"),
}

_ATTN = ("full_attention", "attention", "global_attention")
_CONV = ("conv", "short_conv")
_SLIDING = ("sliding_attention", "sliding_window_attention", "local_attention")
_LINEAR = ("linear_attention", "gated_deltanet", "kimi_delta_attention", "mamba")
_DSA = ("deepseek_sparse_attention", "sparse_attention")


def _from_layer_types(c: dict, mt: str, n: int) -> list:
    types = c["layer_types"]
    if not isinstance(types, list) or len(types) != n:
        raise MacserveError(f"{mt}: `layer_types` must list one entry per layer ({n})")
    shared = shared_indexers(c, mt, n) or [False] * n
    lfm2 = "conv_L_cache" in c  # LFM2: any entry but full attention is a short conv
    out = []
    for i, t in enumerate(types):
        if t in _ATTN:
            out.append(mla_layer(c, mt) if has_mla(c) else full_layer(c, mt, global_layer=True))
        elif t in _CONV or lfm2:
            out.append(short_conv_layer(c, mt))
        elif t in _SLIDING:
            out.append(sliding_layer(c, mt))
        elif t in _LINEAR:
            out.append(linear_layer(c, mt))
        elif t in _DSA:
            out.append(mla_layer(c, mt, indexer=True, shared=shared[i]))
        else:
            raise MacserveError(f"{mt}: unknown entry {t!r} at layer_types[{i}]")
    return out


def _compressed(c: dict, mt: str, n: int, mtp_n: int) -> tuple[list, list]:
    ratios = c["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < n:
        raise MacserveError(f"{mt}: `compress_ratios` must have an entry for each of {n} layers")
    hd = uint(c, "head_dim", mt)
    window = uint(c, "sliding_window", mt)
    idx = uint(c, "index_head_dim", mt)
    if uint(c, "num_key_value_heads", mt) != 1:
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
    n = uint(c, "num_hidden_layers", mt)
    mtp_n = _mtp_count(c)
    mtp: list | None = None

    if c.get("compress_ratios") is not None:
        layers, mtp = _compressed(c, mt, n, mtp_n)
    elif isinstance(c.get("sparse_attention_config"), dict):
        # Before `layer_types`: MiniMax-M3's (full_attention / minimax_m3_sparse) would not say
        # which layers llama.cpp gives an indexer cache; moe_layer_freq does (_msa_layers).
        layers = _msa_layers(c, mt, n)
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
        layers = [full_layer(c, mt) if i in idx else short_conv_layer(c, mt) for i in range(n)]
    elif c.get("sliding_window") and (
        c.get("sliding_window_pattern") is not None or mt in _GEMMA3_TYPES
    ):
        layers = _sliding_pattern(c, mt, n)
    elif mt in _LLAMA4_TYPES and c.get("attention_chunk_size"):
        # mlx-lm's llama4.make_cache: ChunkedKVCache(attention_chunk_size) on layers with
        # (i + 1) % 4 != 0, a KVCache on every 4th; llama.cpp's llama4 loader marks the same
        # layers chunked (load_swa_pattern(ml, 4)), with n_swa = 8192 whatever the file says
        # (8,192 in every published Llama 4 config).
        chunk = uint(c, "attention_chunk_size", mt)
        f = full_layer(c, mt)
        layers = [
            f if (i + 1) % 4 == 0 else Sliding(chunk, f.kv_heads, f.k_dim, f.v_dim, chunked=True)
            for i in range(n)
        ]
    elif "hybrid_override_pattern" in c:
        layers = []
        for i, ch in enumerate(c["hybrid_override_pattern"]):
            if ch == "*":
                layers.append(full_layer(c, mt))
            elif ch == "M":
                layers.append(mamba2_layer(c, mt))
            elif ch in ("-", "E"):
                layers.append(NoCache())  # MLP / MoE blocks: no attention, no cache
            else:
                raise MacserveError(f"{mt}: unknown {ch!r} at hybrid_override_pattern[{i}]")
        n = len(layers)
    elif "full_attention_interval" in c:
        k = uint(c, "full_attention_interval", mt)
        if k < 1:
            raise MacserveError(f"{mt}: `full_attention_interval` must be >= 1")
        # Qwen3-Next / Qwen3.5: every k-th layer (1-based) is full attention.
        layers = [full_layer(c, mt) if (i + 1) % k == 0 else linear_layer(c, mt) for i in range(n)]
    elif "hybrid_layer_pattern" in c:
        # MiMo-V2: 0 = full attention, 1 = sliding window (with its own head counts).
        pattern = c["hybrid_layer_pattern"]
        layers = []
        for i, p in enumerate(pattern):
            if p not in (0, 1):
                raise MacserveError(f"{mt}: unknown {p!r} at hybrid_layer_pattern[{i}]")
            layers.append(full_layer(c, mt) if p == 0 else sliding_layer(c, mt))
    elif isinstance(c.get("attn_type_list"), list):
        # MiniMax-01 / M1 remote code: 0 = lightning attention (a state per sequence), 1 =
        # softmax attention. All 1: MiniMax-M2's configs, plain GQA.
        layers = []
        for i, t in enumerate(c["attn_type_list"]):
            if t not in (0, 1):
                raise MacserveError(f"{mt}: unknown {t!r} at attn_type_list[{i}]")
            layers.append(full_layer(c, mt) if t == 1 else linear_layer(c, mt))
    elif has_mla(c) or mt in _DSA_TYPES:
        dsa = mt in _DSA_TYPES or "index_topk" in c
        shared = shared_indexers(c, mt, n) or [False] * n
        layers = [mla_layer(c, mt, indexer=dsa, shared=shared[i]) for i in range(n)]
        mtp = [mla_layer(c, mt) for _ in range(mtp_n)]
    elif mt in _DENSE_TYPES:
        if c.get("sliding_window") and c.get("use_sliding_window", True):
            raise MacserveError(
                f"{mt}: `sliding_window` is set but no `layer_types` says which layers use it"
            )
        layers = [full_layer(c, mt) for _ in range(n)]
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


def _msa_layers(c: dict, mt: str, n: int) -> list:
    """MiniMax-M3: GQA on every layer; the layers past the leading dense blocks (the leading
    zeros of `moe_layer_freq`, which convert_hf_to_gguf writes as leading_dense_block_count
    and llama.cpp's llama_kv_cache_msa reads as the layers with an indexer) also cache a
    `sparse_index_dim`-wide indexer key per token."""
    idx = uint(c["sparse_attention_config"], "sparse_index_dim", mt)
    freq = c.get("moe_layer_freq")
    if not isinstance(freq, list) or len(freq) != n:
        raise MacserveError(f"{mt}: `moe_layer_freq` must list one entry per layer ({n})")
    dense = next((i for i, v in enumerate(freq) if v != 0), n)
    f = full_layer(c, mt)
    return [f if i < dense else Full(f.kv_heads, f.k_dim, f.v_dim, indexer=idx) for i in range(n)]


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
    lin = kimi_delta_layer(c, mt)
    attn = mla_layer(c, mt) if has_mla(c) else full_layer(c, mt)
    return [lin if i + 1 in kda else attn for i in range(n)]


def _nas_blocks(c: dict, mt: str, n: int) -> list:
    """Nemotron-NAS (DeciLM) `block_configs`: per layer, attention may be dropped (`no_op`),
    replaced by a linear map, or GQA with its own `n_heads_in_group`."""
    blocks = c["block_configs"]
    if len(blocks) != n:
        raise MacserveError(f"{mt}: `block_configs` must have one entry per layer ({n})")
    heads = uint(c, "num_attention_heads", mt)
    hd = head_dim(c, mt)
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
        return [
            full_layer(c, mt) if k[i % len(k)] == "G" else sliding_layer(c, mt) for i in range(n)
        ]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise MacserveError(f"{mt}: `sliding_window_pattern` = {k!r} is not a positive integer")
    return [full_layer(c, mt) if i % k == k - 1 else sliding_layer(c, mt) for i in range(n)]
