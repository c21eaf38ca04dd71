"""A llama.cpp Llama GGUF -> its MLX twin: an mlx-lm Llama checkpoint folder.

MLX reads the GGUF itself (`mx.load(path, return_metadata=True)`): Q4_0/Q4_1/Q8_0 tensors come
back as MLX affine quantized arrays (`weight` packed in uint32, `scales`, `biases`; group 32),
the hyperparameters and the tokenizer as metadata. The twin keeps those 4-bit groups as they are
(mlx-lm's quantized Linear and Embedding take exactly this layout, named by a `quantization`
entry in config.json): Q4_1's d * q + m is MLX's scale * q + bias, so the twin computes with
the very numbers llama-server does, at the GGUF's size, with nothing requantized. Dequantizing
to bf16 would round the Q4_1 values again (bf16 has 8 bits of mantissa) and store 3.5 times the
bytes for no accuracy gained.

Two things of llama.cpp's layout are undone:
- the Q/K row permutation: llama.cpp's converter reorders the rows of `attn_q` and `attn_k`
  within each head so its RoPE can rotate adjacent pairs (x0, x1), (x2, x3) ... where a Hugging
  Face checkpoint rotates halves (x_i, x_{i + d/2}). mlx-lm's Llama rotates halves (nn.RoPE,
  traditional=False), so the rows go back. Quantization groups run along a row (the input
  dimension), so moving whole rows of `weight`, `scales` and `biases` is exact;
- the tokenizer: rebuilt from `tokenizer.ggml.*` with transformers' own GGUF tokenizer
  builders (transformers.integrations.gguf; its file reader needs torch, so the metadata comes
  from MLX's reader instead), the pre-tokenizer split of llama.cpp's `tokenizer.ggml.pre` where
  transformers has none, and the chat template, BOS/EOS/PAD/UNK and add-BOS flag from the
  metadata, so the end of turn (`<|im_end|>` for SmolLM2) is the EOS mlx-lm stops on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from ..errors import MacserveError
from ..fileio import atomic_path, atomic_write

# GGUF tensor name (after `blk.N.`) -> mlx-lm Llama module path (after `model.layers.N.`)
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp) that transformers' GGUF builders lack, as
# tokenizers' own pre-tokenizers. "smollm": every digit its own piece, then GPT-2's byte-level
# split (the Hugging Face SmolLM2 tokenizer.json says the same).
_PRE_SPLITS = {"smollm": "digits"}

_SUFFIXES = ("weight", "scales", "biases", "bias")

DTYPES = ("float32", "bfloat16", "float16")


def default_dtype() -> str | None:
    """Keep the 4-bit groups where MLX runs them fast (a GPU: Metal's quantized kernels); on
    MLX's CPU backend dequantize to float32. Measured on this project's 2-core Linux box,
    SmolLM2-135M: a 200-token prefill took 49 s through the CPU's quantized matmul and 4.8 s
    dequantized, and float16 compute (the GGUF's scales) took 30 s for a 5-token forward."""
    return None if mx.default_device() == mx.gpu else "float32"


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        return None
    return v.item() if hasattr(v, "item") else v


def _need(meta: dict, key: str):
    v = _scalar(meta, key)
    if v is None:
        raise MacserveError(f"the GGUF has no {key}: not a whole Llama header")
    return v


def read(gguf: Path) -> tuple[dict[str, mx.array], dict]:
    """The GGUF's tensors (quantized ones as MLX affine triples) and metadata, via MLX's reader."""
    try:
        return mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise MacserveError(f"{gguf}: MLX cannot read this GGUF ({e})") from None


def hf_config(meta: dict, tensors: dict[str, mx.array]) -> dict:
    """config.json for mlx-lm's (and transformers') Llama, from the GGUF's `llama.*` keys."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise MacserveError(
            f"the twin converter reads Llama GGUFs; this one is {arch!r} (general.architecture)"
        )
    heads = int(_need(meta, "llama.attention.head_count"))
    hidden = int(_need(meta, "llama.embedding_length"))
    if "tokenizer.ggml.tokens" not in meta:
        raise MacserveError("the GGUF carries no tokenizer (tokenizer.ggml.tokens)")
    vocab = _scalar(meta, "llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    head_dim = int(_scalar(meta, "llama.attention.key_length") or hidden // heads)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_need(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_need(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_need(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_need(meta, "llama.context_length")),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # no `output.weight`: llama.cpp (like the original) reads the embedding as the head
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _scalar(meta, "tokenizer.ggml.padding_token_id"),
    }
    rope_dims = _scalar(meta, "llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise MacserveError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not converted")
    if _scalar(meta, "llama.rope.scaling.type") not in (None, "none"):
        raise MacserveError("RoPE scaling in a GGUF is not converted yet")
    return cfg


def unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head row order for RoPE (convert_hf_to_gguf.py `permute`): rows
    (h, j, i) -> (h, i, j) for i in the two halves of a head and j within a half. Works on the
    packed weight, the scales and the biases alike (a whole row moves)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(rows, *w.shape[1:])


def mlx_weights(
    tensors: dict[str, mx.array], cfg: dict, dtype: str | None = None, undo_permutation: bool = True
) -> dict[str, mx.array]:
    """The GGUF's tensors under mlx-lm Llama names, Q/K rows in Hugging Face order. `dtype`
    None keeps the quantized groups (norms in the scales' dtype, what the quantized matmuls
    compute in); a dtype name dequantizes every matrix to it (scales and biases widened to
    float32 first, so each weight is exactly scale * q + bias before the one rounding)."""
    out = {}
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    if dtype is None:
        target = next((t.dtype for k, t in tensors.items() if k.endswith(".scales")), mx.float16)
    else:
        target = getattr(mx, dtype)
    for name, t in tensors.items():
        stem, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES:
            raise MacserveError(f"unexpected tensor {name!r} in the GGUF")
        if suffix in ("scales", "biases") and dtype is not None:
            continue  # folded into the weight below
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
            key = f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
        elif stem in _TOP:
            key = f"{_TOP[stem]}.{suffix}"
        elif stem == "rope_freqs":
            raise MacserveError("RoPE frequency factors (llama 3.1 scaling) are not converted yet")
        else:
            raise MacserveError(f"unexpected tensor {name!r} in the GGUF")
        if dtype is not None and f"{stem}.scales" in tensors:
            t = mx.dequantize(
                t,
                tensors[f"{stem}.scales"].astype(mx.float32),
                tensors[f"{stem}.biases"].astype(mx.float32),
                group_size=32,
                bits=t.shape[-1] // tensors[f"{stem}.scales"].shape[-1],
            )
        if undo_permutation and parts[0] == "blk" and parts[2] in heads:
            t = unpermute(t, heads[parts[2]])
        if mx.issubdtype(t.dtype, mx.floating) and suffix in ("weight", "bias"):
            t = t.astype(target)  # one compute dtype: the norms are float32 in a GGUF
        out[key] = t
    return out


def quantization(weights: dict[str, mx.array]) -> dict | None:
    """mlx-lm's `quantization` entry for the quantized tensors (mlx-lm names). MLX's GGUF
    reader makes groups of 32 (a ggml block): a row of n inputs is n / 32 scales and
    n * bits / 32 packed uint32, so bits = packed / scales. The most common width is the
    default; a module at another width (llama.cpp keeps a tied embedding at Q8_0) gets its own
    entry, which mlx-lm's loader reads per module path."""
    bits = {
        name[: -len(".scales")]: weights[name[: -len("scales")] + "weight"].shape[-1] // t.shape[-1]
        for name, t in weights.items()
        if name.endswith(".scales")
    }
    if not bits:
        return None
    widths = list(bits.values())
    default = max(set(widths), key=widths.count)
    q: dict = {"group_size": 32, "bits": default, "mode": "affine"}
    for path, b in sorted(bits.items()):
        if b != default:
            q[path] = {"group_size": 32, "bits": b, "mode": "affine"}
    return q


def tokenizer_files(meta: dict) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json rebuilt from the GGUF's tokenizer metadata."""
    # transformers' GGUF tokenizer builders (that module imports no torch; its GGUF reader does):
    from tokenizers import pre_tokenizers  # only a conversion needs tokenizers, transformers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as hf_gguf  # 1-2 s import

    g = "tokenizer.ggml."
    d = {
        "tokenizer_type": _scalar(meta, g + "model"),
        "pre_tokenizer_type": _scalar(meta, g + "pre"),
        "tokens": list(meta[g + "tokens"]),
        "token_type": [int(x) for x in _list(meta.get(g + "token_type"))],
    }
    if g + "merges" in meta:
        d["merges"] = list(meta[g + "merges"])
    if g + "scores" in meta:
        d["scores"] = [float(x) for x in _list(meta[g + "scores"])]
    try:
        tok = hf_gguf.select_tokenizer_builder(
            _scalar(meta, "general.architecture"), d["tokenizer_type"]
        )(d)
    except ValueError as e:
        raise MacserveError(f"the GGUF's tokenizer: {e}") from None
    tok = hf_gguf.add_gguf_special_tokens(tok, d)
    tok = hf_gguf.set_split_regex(tok, d)
    if _PRE_SPLITS.get(d["pre_tokenizer_type"]) == "digits":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens = d["tokens"]

    def special(key):
        i = _scalar(meta, g + key)
        return None if i is None else tokens[int(i)]

    template = _scalar(meta, "tokenizer.chat_template")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special("bos_token_id"),
        "eos_token": special("eos_token_id"),
        "pad_token": special("padding_token_id"),
        "unk_token": special("unknown_token_id"),
        "add_bos_token": bool(_scalar(meta, g + "add_bos_token", False)),
        "add_eos_token": bool(_scalar(meta, g + "add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_need(meta, "llama.context_length")),
    }
    if template:
        config["chat_template"] = template
    return {
        "tokenizer.json": tok.backend_tokenizer.to_str(pretty=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }


def _list(v) -> list:
    if v is None:
        return []
    return v.tolist() if hasattr(v, "tolist") else list(v)


def convert(gguf: Path, out: Path, dtype: str | None = None, undo_permutation: bool = True) -> Path:
    """Write the MLX twin of a Llama GGUF into `out` (config.json, model.safetensors, the
    tokenizer files); each file atomically. `dtype`: None keeps the 4-bit groups, else the
    float dtype to dequantize to (see `default_dtype`). Returns `out`."""
    if dtype is not None and dtype not in DTYPES:
        raise MacserveError(f"dtype {dtype!r}: one of {', '.join(DTYPES)} (or keep the groups)")
    gguf, out = Path(gguf), Path(out)
    tensors, meta = read(gguf)
    cfg = hf_config(meta, tensors)
    weights = mlx_weights(tensors, cfg, dtype, undo_permutation)
    q = quantization(weights)
    if q:
        cfg["quantization"] = q
    files = tokenizer_files(meta)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp, open(tmp, "wb") as f:
        mx.save_safetensors(f, weights, metadata={"format": "mlx"})
        os.chmod(tmp, 0o644)
    for name, text in files.items():
        atomic_write(out / name, text)
    # config.json last: a folder that has one is a whole checkpoint
    cfg["macserve_twin_of"] = gguf.name
    atomic_write(out / "config.json", json.dumps(cfg, indent=2) + "\n")
    return out
