"""Export a DeepSeek-V3-family checkpoint folder (with its MTP layer) to a llama.cpp GGUF.

llama.cpp's `deepseek2` architecture runs MLA as MQA over the latent: `kv_b_proj` is split
into `attn_k_b` (transposed, absorbed into the query) and `attn_v_b`, the key length is
kv_lora_rank + rope and the value length kv_lora_rank. The MTP layer keeps its block index
(`blk.{num_hidden_layers}`) with `nextn.*` tensors, and `block_count` counts it.
Tensors are written as F32 by default: the bf16 checkpoint values exactly, so llama-server
and MLX start from the same numbers.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

from ..errors import MacserveError

_NEXTN = {
    "eh_proj": "nextn.eh_proj",
    "enorm": "nextn.enorm",
    "hnorm": "nextn.hnorm",
    "embed_tokens": "nextn.embed_tokens",
    "shared_head.head": "nextn.shared_head_head",
    "shared_head.norm": "nextn.shared_head_norm",
}


def _load_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        # Only the weight files: a folder may also hold other safetensors (a latent calibration).
        files = sorted(
            {model_dir / f for f in json.loads(index.read_text())["weight_map"].values()}
        )
    else:
        files = sorted(model_dir.glob("model*.safetensors"))
    for f in files:
        for k, v in mx.load(str(f)).items():
            out[k] = np.array(v.astype(mx.float32))
    if not out:
        raise MacserveError(f"no safetensors files in {model_dir}")
    return out


def _gguf_name(name: str, cfg: dict, tmap) -> str | None:
    n = cfg["num_hidden_layers"]
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
    if m and int(m.group(1)) >= n and m.group(2) in _NEXTN:
        return f"blk.{m.group(1)}.{_NEXTN[m.group(2)]}.weight"
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return f"blk.{name.split('.')[2]}.exp_probs_b.bias"
    return tmap.get_name(name, try_suffixes=(".weight", ".bias"))


def _tensors(cfg: dict, w: dict[str, np.ndarray]):
    """(HF-style name, array) pairs in the layout llama.cpp expects."""
    heads, nope, vdim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    experts = cfg.get("n_routed_experts") or 0
    done = set()
    for name in sorted(w):
        if name in done:
            continue
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            base, proj = m.group(1), m.group(3)
            names = [f"{base}.{e}.{proj}.weight" for e in range(experts)]
            done.update(names)
            yield f"{base}.{proj}.weight", np.stack([w[k] for k in names])
        elif name.endswith("kv_b_proj.weight"):
            kv_b = w[name].reshape(heads, nope + vdim, -1)
            k_b = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
            v_b = np.ascontiguousarray(kv_b[:, nope:, :])
            yield name.replace("kv_b_proj", "k_b_proj"), k_b
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
        else:
            yield name, w[name]


def _add_tokenizer(writer, model_dir: Path) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    if tj["model"]["type"] != "BPE":
        raise MacserveError("only byte-level BPE tokenizers are exported")
    vocab = dict(tj["model"]["vocab"])
    added = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(added)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[tc["bos_token"]])
    writer.add_eos_token_id(vocab[tc["eos_token"]])
    if "<|end|>" in vocab:
        writer.add_eot_token_id(vocab["<|end|>"])
    writer.add_add_bos_token(False)
    if tc.get("chat_template"):
        writer.add_chat_template(tc["chat_template"])


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") not in ("deepseek_v3", "kimi_k2", "deepseek_v2"):
        raise MacserveError(
            f"GGUF export supports the deepseek_v3 family, not {cfg.get('model_type')!r}"
        )
    nextn = int(cfg.get("num_nextn_predict_layers") or 0)
    blocks = cfg["num_hidden_layers"] + nextn
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    tmap = gguf.get_tensor_name_map(arch, blocks)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_block_count(blocks)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA runs as MQA over the latent
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    kv, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    writer.add_kv_lora_rank(kv)
    writer.add_key_length(kv + rope)
    writer.add_value_length(kv)
    writer.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(cfg["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(cfg.get("routed_scaling_factor", 1.0))
    writer.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
    gating = {
        "sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
        "softmax": gguf.ExpertGatingFuncType.SOFTMAX,
    }[cfg.get("scoring_func", "softmax")]
    writer.add_expert_gating_func(gating)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
    )
    _add_tokenizer(writer, model_dir)
    for name, arr in _tensors(cfg, _load_tensors(model_dir)):
        gname = _gguf_name(name, cfg, tmap)
        if gname is None:
            raise MacserveError(f"no GGUF name for tensor {name}")
        if dtype == "f16" and arr.ndim >= 2:
            arr = arr.astype(np.float16)
        writer.add_tensor(gname, arr.astype(np.float32) if arr.dtype != np.float16 else arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out
