"""Write a tiny, valid `llama`-architecture GGUF that a real llama-server loads in well under a second.

Random weights, 2 layers, 64-wide, an SPM-style vocabulary of the 256 byte tokens plus a few
words, and a chat template: enough for /health, /props and a chat completion that answers
(with nonsense). Used until the project's own model has a GGUF twin (the `tiny_gguf` fixture).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_gguf(path: Path, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                    n_ff: int = 128, n_ctx_train: int = 4096, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    words = ["\u2581", "\u2581the", "\u2581a", "\u2581hello", "\u2581world", "e", "t", "o", "n"]
    tokens += words
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("macserve-test-tiny")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(name, *shape, scale=0.02):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for nm in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{nm}.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
