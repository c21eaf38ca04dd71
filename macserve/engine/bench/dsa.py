"""DSA decode through the INT2 cache: scoring only the indexer's top-k rows of the quantized
segment (`gather_selected`) vs scoring every row under a mask, in the same process.

There is no trained DSA model here, and speed does not depend on the weights' values, so this
builds a random deepseek_v32 model with DeepSeek-V3.2's cache dims (latent 512, rope 64,
indexer key 128, top-2048) and few, narrow layers, fills its caches to each context, and
times decode steps with the two paths interleaved.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models import deepseek_v32

from ...int2_format import INT2
from .. import mla_attention
from ..caches import make_caches
from .kv import fill_latents

DIMS = dict(
    model_type="deepseek_v32",
    vocab_size=1024,
    hidden_size=512,
    index_head_dim=128,
    index_n_heads=16,
    index_topk=2048,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    kv_lora_rank=512,
    q_lora_rank=256,
    qk_rope_head_dim=64,
    v_head_dim=64,
    qk_nope_head_dim=64,
    max_position_embeddings=131072,
)


def random_dsa_model():
    mx.random.seed(0)
    model = deepseek_v32.Model(deepseek_v32.ModelArgs(**DIMS))
    model.set_dtype(mx.float32)
    mla_attention.install(model)
    return model


def run(contexts=(4096, 16384), steps: int = 16, rounds: int = 3) -> list[dict]:
    model = random_dsa_model()
    attn = model.layers[0].self_attn
    rows = []
    for ctx in contexts:
        caches = make_caches(model, INT2)
        fill_latents(
            caches, ctx, attn.kv_lora_rank, attn.qk_rope_head_dim, index_dims=attn.indexer.head_dim
        )
        best = {True: 0.0, False: 0.0}
        for _ in range(rounds):
            for sparse in (True, False):
                mla_attention.SPARSE_DECODE = sparse
                try:
                    tok = mx.array([[1]])
                    mx.eval(model(tok, cache=caches))  # warm-up
                    t = time.perf_counter()
                    for _ in range(steps):
                        mx.eval(model(tok, cache=caches))
                    best[sparse] = max(best[sparse], steps / (time.perf_counter() - t))
                finally:
                    mla_attention.SPARSE_DECODE = True
                for c in caches:
                    c.trim(steps + 1)
        rows.append(
            {
                "context": ctx,
                "index_topk": attn.indexer.index_topk,
                "tokens_per_s_sparse": best[True],
                "tokens_per_s_masked": best[False],
                "speedup": best[True] / best[False],
            }
        )
    return rows
