"""llama.cpp's caches for a ModelShape (src/llama-kv-cache*.cpp, llama-memory-recurrent.cpp,
llama-kv-cache-msa.cpp, llama-kv-cache-dsv4.cpp): `llama_layout`. The rules are listed in
kv_layout.py's docstring.
"""

from __future__ import annotations

from .arch import MLA, Compressed, Full, Linear, NoCache, Sliding
from .kv_buffers import Buffer, Layout, Unsupported, unsupported

DSV4_RATIOS = (4, 128)  # llama.cpp's DSV4_CSA_RATIO / DSV4_HCA_RATIO: the only ones it caches


def _ggml_row(values: int, t: str) -> int:
    if t == "f16":
        return 2 * values
    if values % 32:
        raise Unsupported(f"llama.cpp {t} needs rows divisible by 32 ({values} is not)")
    return values // 32 * {"q8_0": 34, "q4_0": 18}[t]


def _llama_layer(i: int, l, t: str, ubatch: int, swa_full: bool) -> list[Buffer]:
    if isinstance(l, NoCache):
        return []
    if isinstance(l, (Full, Sliding)):
        k, v = _ggml_row(l.kv_heads * l.k_dim, t), _ggml_row(l.kv_heads * l.v_dim, t)
        if isinstance(l, Full) and l.indexer:
            # llama_kv_cache_msa: its indexer cache is a second llama_kv_cache with one KV head
            # of the indexer's key width, which also allocates one V head of the model's width.
            return [
                Buffer(i, "K", k, "token"),
                Buffer(i, "V", v, "token"),
                Buffer(i, "indexer key", _ggml_row(l.indexer, t), "token"),
                Buffer(i, "indexer V (1 head)", _ggml_row(l.v_dim, t), "token"),
            ]
        if isinstance(l, Full) or swa_full:
            return [Buffer(i, "K", k, "token"), Buffer(i, "V", v, "token")]
        # llama_kv_cache_iswa: SWA cache of min(n_ctx_seq, n_swa + n_ubatch) cells, padded.
        w = l.window + ubatch
        return [
            Buffer(i, "K (window)", k, "window", rows=w),
            Buffer(i, "V (window)", v, "window", rows=w),
        ]
    if isinstance(l, Linear):
        # llama_memory_recurrent: r and s rows in GGML_TYPE_F32, one per sequence.
        return [
            Buffer(i, "conv state (f32)", 4 * l.conv_elems, "fixed", rows=1),
            Buffer(i, "recurrent state (f32)", 4 * l.state_elems, "fixed", rows=1),
        ]
    if isinstance(l, MLA):
        out = [Buffer(i, "latent + rope K", _ggml_row(l.latent + l.rope, t), "token")]
        if l.indexer and not l.indexer_shared:
            # llama_memory_hybrid_idx keeps key | gate | pooled per token for a k-pool indexer.
            width = l.indexer * (3 if l.indexer_pool > 1 else 1)
            out.append(Buffer(i, "indexer key", _ggml_row(width, t), "token"))
        return out
    if isinstance(l, Compressed):
        if l.ratio and l.ratio not in DSV4_RATIOS:
            raise Unsupported(f"llama.cpp caches compress ratios {DSV4_RATIOS} only, not {l.ratio}")
        row = _ggml_row(l.head_dim, t)
        out = [Buffer(i, "K (window)", row, "window", rows=l.window + ubatch)]
        if l.ratio:
            out.append(Buffer(i, f"compressed K (1/{l.ratio})", row, "token", every=l.ratio))
            # llama_dsv4_comp_state: f32 kv and score, state_size x n_embd_state each.
            if l.ratio == 4:
                out.append(
                    Buffer(i, "compressor state (f32)", 2 * 4 * 8 * 2 * l.head_dim, "fixed", rows=1)
                )
            else:
                out.append(
                    Buffer(
                        i, "compressor state (f32)", 2 * 4 * l.ratio * l.head_dim, "fixed", rows=1
                    )
                )
        if l.indexer:
            out.append(Buffer(i, "indexer key (1/4)", _ggml_row(l.indexer, t), "token", every=4))
            out.append(
                Buffer(
                    i, "indexer compressor state (f32)", 2 * 4 * 8 * 2 * l.indexer, "fixed", rows=1
                )
            )
        return out
    raise TypeError(l)


def llama_layout(layers: list, key: str, t: str, ubatch: int, swa_full: bool) -> Layout:
    try:
        bufs = [b for i, l in enumerate(layers) for b in _llama_layer(i, l, t, ubatch, swa_full)]
    except Unsupported as e:
        return unsupported(key, str(e))
    return Layout(key, bufs, pad_compressed=True, pad_window=True)
