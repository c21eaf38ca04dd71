"""DeepSeek's MTP ("nextn") block on top of mlx-lm's own decoder layer, loaded by checkpoint name.

The block predicts token t+2 from the trunk's post-norm hidden state at position t and the
embedding of token t+1: x = eh_proj([enorm(emb), hnorm(h)]), then one ordinary decoder layer
(with its own cache), then `shared_head.norm` and `shared_head.head`. mlx-lm drops these
weights when it loads a checkpoint, so we read them ourselves from the tensors named
`model.layers.{num_hidden_layers + k}.*` (DeepSeek-V3's README_WEIGHTS.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer, ModelArgs


class SharedHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class MTPLayer(DeepseekV3DecoderLayer):
    """One nextn module. Subclasses the trunk's layer so the attention/MoE weights keep
    DeepSeek's names (`self_attn.*`, `mlp.*`) directly under `model.layers.{N}`."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.shared_head = SharedHead(args)

    def hidden(self, h: mx.array, next_tokens: mx.array, mask=None, cache=None) -> mx.array:
        """Post-`shared_head.norm` hidden state: what the head scores, and what a chained
        second draft step feeds back in as `h`."""
        e = self.enorm(self.embed_tokens(next_tokens))
        x = self.eh_proj(mx.concatenate([e, self.hnorm(h)], axis=-1))
        x = DeepseekV3DecoderLayer.__call__(self, x, mask, cache)
        return self.shared_head.norm(x)

    def __call__(self, h, next_tokens, mask=None, cache=None):
        out = self.hidden(h, next_tokens, mask, cache)
        return self.shared_head.head(out), out


class MissingMTPWeights(ValueError):
    """The config declares MTP layers the checkpoint's files do not hold."""


def mtp_layer_count(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


def mtp_prefix(config: dict, k: int = 0) -> str:
    return f"model.layers.{config['num_hidden_layers'] + k}."


def sanitize_mtp_weights(weights: dict, args: ModelArgs, prefix: str) -> dict:
    """Checkpoint names (kv_b_proj, experts.{e}.*) -> the module's (embed_q/unembed_out,
    switch_mlp), the same transformation mlx-lm applies to trunk layers."""
    w = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if "mlp.experts.0.gate_proj.weight" in w:
        for m in ("gate_proj", "down_proj", "up_proj"):
            w[f"mlp.switch_mlp.{m}.weight"] = mx.stack(
                [w.pop(f"mlp.experts.{e}.{m}.weight") for e in range(args.n_routed_experts)]
            )
    if "self_attn.kv_b_proj.weight" in w:
        v = w.pop("self_attn.kv_b_proj.weight")
        v = v.reshape(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, -1)
        w["self_attn.embed_q.weight"] = mx.contiguous(
            v[:, : args.qk_nope_head_dim, :].swapaxes(-1, -2)
        )
        w["self_attn.unembed_out.weight"] = mx.contiguous(v[:, args.qk_nope_head_dim :, :])
    return w


def load_mtp_layers(model_dir: str | Path, trunk=None) -> list[MTPLayer]:
    """The MTP layers of a checkpoint folder, by name, from any of its safetensors files.

    `trunk`: when the checkpoint ships no copy of the embedding or head for the MTP layer
    (DeepSeek says they are shared), the trunk's are used.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    n = mtp_layer_count(config)
    if n == 0:
        return []
    args = ModelArgs.from_dict(config)
    weights = {}
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(
            {model_dir / f for f in json.loads(index.read_text())["weight_map"].values()}
        )
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        if not f.exists():  # an index naming a file a conversion left out (mtp.safetensors)
            continue
        for k, v in mx.load(str(f)).items():
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= args.num_hidden_layers:
                weights[k] = v
    layers = []
    for k in range(n):
        prefix = mtp_prefix(config, k)
        w = sanitize_mtp_weights(weights, args, prefix)
        if not w:
            raise MissingMTPWeights(
                f"{model_dir.name}: config.json declares {n} MTP layer(s) "
                f"(num_nextn_predict_layers) but its safetensors hold no {prefix}* tensors "
                "(a conversion that dropped them?)"
            )
        layer = MTPLayer(args, args.num_hidden_layers + k)
        if trunk is not None:
            if "embed_tokens.weight" not in w:
                w["embed_tokens.weight"] = trunk.model.embed_tokens.weight
            if "shared_head.head.weight" not in w:
                w["shared_head.head.weight"] = trunk.lm_head.weight
        layer.load_weights(list(w.items()), strict=True)
        layers.append(layer)
    mx.eval([l.parameters() for l in layers])
    return layers
