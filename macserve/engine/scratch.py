"""A prefill chunk's scratch: the transient arrays a chunk of L prompt tokens at position P
holds beyond the weights and the caches, and the chunk that keeps it within a budget (the
server's share's reserve, server/capacity.py).

Attention over an MLA cache reads its keys in blocks (mla_attention: the INT2 segments and
mlx-lm's plain cache alike), so its scores take one block (heads x L x keys, float32) at a
time, whatever the context; the block's keys are expanded to per-head keys and values. What
still grows with L: the queries, the layer's activations and MLP rows, the merged softmax's
running state. What grows with P: the model's causal mask (L x P booleans) and one layer's
cache copied when it grows (mlx-lm's cache concatenates a new buffer, then writes the
chunk's rows into it). A model that is not
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


def expanded(w: Widths, L: int) -> bool:
    """Whether L queries take the expanded form (mla_attention.expanded_from's rule)."""
    nope = w.q_head - w.rope
    r = w.rank
    return L >= max(2, -(-r * (nope + w.v_head) // max(1, 2 * r - nope - w.v_head)))


def row_bytes(w: Widths, L: int) -> int:
    """One key's rows once read, beside its scores (mla_attention.row_bytes)."""
    dense = 2 * (w.rank + w.rope) * 4
    if not expanded(w, L):
        return dense
    return dense + 2 * w.heads * (w.q_head - w.rope + w.v_head) * 4


def block_keys(w: Widths, L: int, block: int) -> int:
    """Keys per block for L queries (mla_attention.block_keys' rule)."""
    return max(MIN_BLOCK_KEYS, block // max(1, w.heads * L * 4 + row_bytes(w, L)))


def chunk_scratch(w: Widths, L: int, pos: int, block: int) -> int:
    """Bytes a chunk of L tokens at position `pos` may hold beyond the weights and caches."""
    n = pos + L
    if w.blocked:
        keys = min(n, block_keys(w, L, block))
        per_key = SCORE_COPIES * w.heads * L * 4 + row_bytes(w, L)
    else:  # mlx-lm's attention: every key at once, scores in the model's dtype and float32
        keys, per_key = n, SCORE_COPIES * w.heads * L * 4
    merged = 3 * w.heads * L * (max(w.v_head, w.rank) + 2) * 4  # running acc, max, sum
    queries = 3 * w.heads * L * (w.q_head + w.rank + w.v_head) * w.itemsize
    layer = L * w.itemsize * (8 * w.hidden + 3 * w.mlp)
    mask = L * n  # the model's causal mask, booleans
    # One layer's cache as it grows: mlx-lm's concatenation into a new buffer, and the
    # chunk's rows written into that (a copy unless MLX donates it).
    grow = 2 * (n + GROW_STEP) * w.row_bytes
    return keys * per_key + merged + queries + layer + mask + grow


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
    blocks of scores (mla_attention, dsa_indexer) and the chunks `chunk` picks. None: back
    to the defaults (2,048-token chunks, 256 MB blocks)."""
    global _budget
    _budget = n
    mla_attention.set_block_bytes(None if n is None else block_bytes(n))
    dsa_indexer.BLOCK_BYTES = dsa_indexer.DEFAULT_BLOCK_BYTES if n is None else block_bytes(n)


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
