"""A prefill chunk's scratch: the transient arrays a chunk of L prompt tokens at position P
holds beyond the weights and the caches, and the chunk that keeps it within a budget (the
server's share's reserve, server/capacity.py).

Attention over an MLA cache reads its keys in blocks (mla_attention: the INT2 segments and
mlx-lm's plain cache alike), so its scores take one block (heads x L x keys, float32) at a
time, whatever the context; the block's keys are expanded to per-head keys and values. What
still grows with L: the queries, the layer's activations and MLP rows, the merged softmax's
running state. What grows with P: the model's causal mask (L x P booleans) and one layer's
cache copied when it grows (mlx-lm's cache concatenates a new buffer). A model that is not
MLA is read by mlx-lm's attention whole: its scores are heads x L x (P + L).

The figures are an upper bound read off the code (every array a step may hold at once,
counted with the copies MLX makes: the scores, their masked and exponentiated forms); the
chunk is the largest power of two up to the server's own chunk whose bound fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import dsa_indexer, mla_attention

MIN_BLOCK_KEYS = 64  # mla_attention.blocks' and plain_blocks' least block
MIN_CHUNK = 32  # above mla_attention.ABSORBED_MAX_QUERIES: the blocked form
GROW_STEP = 256  # mlx-lm's KVCache.step: a plain cache grows by this many rows
SCORE_COPIES = 4  # a block's scores, masked, exponentiated, and cast back for p @ V
BLOCK_SHARE = 8  # a block's scores may take this fraction of the budget


@dataclass(frozen=True)
class Widths:
    """What a chunk's scratch depends on, read from the model (`widths`)."""

    heads: int
    q_head: int  # nope + rope (MLA) or the head dim
    v_head: int
    rank: int  # the latent's width (0: not MLA)
    rope: int
    hidden: int
    mlp: int  # the widest MLP row: dense intermediate, or routed experts x their width + shared
    itemsize: int  # bytes of the dtype the model computes in
    blocked: bool  # MLA: attention reads keys in blocks

    @property
    def row_bytes(self) -> int:
        """One layer's cache row, at most (a bf16 latent + rope row, or K and V)."""
        if self.rank:
            return (self.rank + self.rope) * max(2, self.itemsize)
        return self.heads * (self.q_head + self.v_head) * self.itemsize


def widths(args, itemsize: int, mla: bool) -> Widths:
    """From a model's `args` (mlx-lm's ModelArgs)."""
    g = lambda name, d=0: getattr(args, name, None) or d  # noqa: E731
    heads = g("num_attention_heads", 1)
    hidden = g("hidden_size", 1)
    dense = g("intermediate_size", 4 * hidden)
    experts = g("num_experts_per_tok") * g("moe_intermediate_size")
    experts += g("n_shared_experts") * g("moe_intermediate_size")
    if mla:
        q_head = g("qk_nope_head_dim") + g("qk_rope_head_dim")
        v_head = g("v_head_dim")
    else:
        q_head = v_head = g("head_dim", hidden // heads)
    return Widths(
        heads=heads,
        q_head=q_head,
        v_head=v_head,
        rank=g("kv_lora_rank") if mla else 0,
        rope=g("qk_rope_head_dim") if mla else 0,
        hidden=hidden,
        mlp=max(dense, experts),
        itemsize=itemsize,
        blocked=mla,
    )


def block_bytes(budget: int) -> int:
    """The bytes one block of scores may take within `budget`."""
    return max(1, budget // BLOCK_SHARE)


def block_keys(heads: int, L: int, block: int) -> int:
    """Keys per block for L queries (mla_attention's rule)."""
    return max(MIN_BLOCK_KEYS, block // max(1, heads * L * 4))


def chunk_scratch(w: Widths, L: int, pos: int, block: int) -> int:
    """Bytes a chunk of L tokens at position `pos` may hold beyond the weights and caches."""
    n = pos + L
    keys = min(n, block_keys(w.heads, L, block)) if w.blocked else n
    scores = SCORE_COPIES * w.heads * L * keys * 4
    kv = 2 * w.heads * keys * (w.q_head + w.v_head) * w.itemsize  # a block's expanded K, V
    merged = 3 * w.heads * L * (max(w.v_head, w.rank) + 2) * 4  # running acc, max, sum
    queries = 3 * w.heads * L * (w.q_head + w.rank + w.v_head) * w.itemsize
    layer = L * w.itemsize * (8 * w.hidden + 3 * w.mlp)
    mask = L * n  # the model's causal mask, booleans
    grow = (n + GROW_STEP) * w.row_bytes  # one layer's cache copied as it grows
    return scores + kv + merged + queries + layer + mask + grow


def chunk_for(w: Widths, pos: int, budget: int | None, most: int) -> int:
    """The largest power of two <= `most` (at least MIN_CHUNK, or `most` if smaller) whose
    scratch at `pos` fits `budget`; `most` when there is no budget."""
    if budget is None:
        return most
    block = block_bytes(budget)
    L = most
    while L > MIN_CHUNK and chunk_scratch(w, L, pos, block) > budget:
        L = max(MIN_CHUNK, 1 << ((L - 1).bit_length() - 1))  # the power of two below
    return L


_budget: int | None = None  # this process's: set once by the server (None: unbounded)


def set_budget(n: int | None) -> None:
    """Bound every prefill chunk's scratch in this process to `n` bytes: the attention's
    blocks of scores (mla_attention, dsa_indexer) and the chunks `chunk` picks."""
    global _budget
    _budget = n
    if n is not None:
        mla_attention.set_block_bytes(block_bytes(n))
        dsa_indexer.BLOCK_BYTES = block_bytes(n)


def budget() -> int | None:
    return _budget


def model_widths(model) -> Widths:
    """`widths` of a loaded model: the dtype its MLA norms compute in (float32, the widest,
    for a model that is not MLA)."""
    args = getattr(model, "args", None) or model.model.args
    attns = mla_attention.mla_attentions(model)
    itemsize = attns[0].kv_a_layernorm.weight.dtype.size if attns else 4
    return widths(args, itemsize, bool(attns))


def chunk(w: Widths, pos: int, most: int) -> int:
    """This process's chunk at `pos`: `chunk_for` under its budget."""
    return chunk_for(w, pos, _budget, most)
