"""A hard case for the latent-cache gate: a DeepSeek-V3-style model with random weights whose
latent is near full rank, unlike the demo's (nearly rank 10).

    macserve dev hard-mla OUT     # then: macserve calibrate OUT --out ... --report

The demo model's config (latent 128, rope 32, the demo's tokenizer, so the same calibration
text runs) with 16 heads instead of 4 and random weights: a random projection of the hidden
state gives a latent whose variance is spread over all 128 directions, the case where INT2
is reported to fail (Kimi-K3's latent in OSCAR's MLA results). So that one model shows the
gate deciding per layer, the latent projection of the layers in `low_rank` is replaced by a
random rank-8 one (its spectrum then looks like the demo's). Random weights: no quality
figure (perplexity, KL) from it means anything for a trained model; only the latent's shape
does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3

DEMO = Path(__file__).resolve().parents[1] / "models" / "tiny-mla"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LOW_RANK = (0, 1)
RANK = 8


def build(out: str | Path, low_rank=LOW_RANK, rank: int = RANK, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((DEMO / "config.json").read_text())
    # More heads than the demo: the absorbed queries and W_UV then see the latent through
    # many independent random maps, as a real model's 64-128 heads do.
    cfg.update(num_attention_heads=16, num_key_value_heads=16, num_nextn_predict_layers=0)
    mx.random.seed(seed)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    r = cfg["kv_lora_rank"]
    for i in low_rank:
        proj = model.model.layers[i].self_attn.kv_a_proj_with_mqa
        w = proj.weight.astype(mx.float32)
        a = mx.random.normal((r, rank)) @ mx.random.normal((rank, w.shape[1]))
        # Same overall scale as the full-rank rows it replaces; kv_a_layernorm renormalizes.
        a = a * (mx.linalg.norm(w[:r]) / mx.linalg.norm(a))
        proj.weight = mx.concatenate([a, w[r:]], axis=0).astype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    cfg["macserve_note"] = (
        f"random weights (seed {seed}); layers {list(low_rank)}: rank-{rank} latent projection"
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO / f, out / f)
    return out
