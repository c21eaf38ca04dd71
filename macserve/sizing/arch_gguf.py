"""A GGUF header -> ModelShape: llama.cpp's own description of the model, its `{arch}.*`
keys read as llama.cpp's loaders (src/models/*.cpp) read them. What this cannot classify
(a recurrent layout not read from GGUF, a sliding window without its pattern) raises
MacserveError naming the key.
"""

from __future__ import annotations

from ..errors import MacserveError
from .arch import MLA, Compressed, Full, Linear, ModelShape, NoCache, Sliding

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

    if arch == "minimax-01":
        # src/models/minimax-01.cpp: lightning-attention layers are recurrent (from
        # `attention.recurrent_layers`, else every layer but each `full_attention_interval`-th,
        # 8 when absent: the converter writes neither); their state is n_embd_s =
        # key_length^2 x head_count f32 values per sequence, with no conv state (n_embd_r 0).
        recr = g("attention.recurrent_layers")
        if isinstance(recr, list):
            is_recr = [bool(x) for x in recr[:blocks]] + [False] * (blocks - len(recr))
        else:
            k = int(g("full_attention_interval", 8))
            is_recr = [i < n and (i + 1) % k != 0 for i in range(blocks)]
        lin = Linear("lightning", 0, k_len * k_len * heads[0])
        return done([lin if is_recr[i] else Full(kv_heads[i], k_len, v_len) for i in range(blocks)])

    if arch == "minimax-m3":
        # src/llama-model.cpp, llama_kv_cache_msa: K and V on every layer, and an indexer
        # cache (one head of `attention.indexer.key_length`) on the layers past the leading
        # dense blocks.
        idx = int(need("attention.indexer.key_length"))
        dense = int(g("leading_dense_block_count", 0) or 0)
        return done(
            [
                Full(kv_heads[i], k_len, v_len, indexer=idx if i >= dense else 0)
                for i in range(blocks)
            ]
        )

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

    if arch in ("nemotron_h", "nemotron_h_moe"):
        # src/models/nemotron-h.cpp, load_arch_hparams: a layer is Mamba-2 (recurrent) iff it
        # has neither KV heads nor an FFN (`recurrent_layer_arr`); one with KV heads is
        # attention, caching K and V; the rest (MLP, MoE) cache nothing. The Mamba-2 state is
        # per sequence, not per token (llama_memory_recurrent; n_embd_r/s as in _gguf_linear).
        ff = per_layer("feed_forward_length", 0)
        mamba = _gguf_linear(g, need, arch, heads[0], "mamba2")

        def kind(i):
            if kv_heads[i]:
                return Full(kv_heads[i], k_len, v_len)
            return NoCache() if ff[i] else mamba

        return done([kind(i) for i in range(blocks)])

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
