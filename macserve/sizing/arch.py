"""A model's shape: one layer kind per layer, MTP layers apart (`ModelShape`).

The kinds hold model dimensions only; what each engine stores for them (dtypes, padding,
which caches it keeps at all) is kv_layout.py's business. Every layer is classified from
explicit fields, by arch_config.py (a config.json) or arch_gguf.py (a GGUF header); what
cannot be classified raises MacserveError naming the field: a silent fall-back to full
attention is how other estimators end up 5-50x wrong on hybrid models.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Full:
    """Full attention (MHA/GQA/MQA): K and V per KV head, per token. `indexer`: the width
    of a MiniMax Sparse Attention (MSA) indexer key on this layer (0: none), one per token."""

    kv_heads: int
    k_dim: int
    v_dim: int
    kind: str = "full"
    indexer: int = 0


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

    flavour: str  # "gated_deltanet" | "kimi_delta" | "mamba2" | "short_conv" | "lightning"
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
