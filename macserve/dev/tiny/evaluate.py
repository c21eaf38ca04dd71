"""Figures for the model card, measured on held-out plays: perplexity against a unigram
baseline on the same tokenizer, the MTP head's top-1 agreement with the trunk's own greedy
token after next, and each layer's latent covariance spectrum."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask

from ...engine.model import load
from . import data


def evaluate(model_dir: str | Path, seq_len: int = 1024, max_windows: int = 16) -> dict:
    model_dir = Path(model_dir)
    bundle = load(model_dir)  # the engine's loader: the same dtype rule as serving
    model, tok, mtp = bundle.model, bundle.tokenizer, bundle.mtp()
    plays = data.load_plays()
    train, held = data.split(plays)

    def enc(ps):
        texts = (f"{data.BOS}{p.text}{data.EOS}" for p in ps)
        return np.array(sum((tok.encode(t, add_special_tokens=False) for t in texts), []))

    held_ids, train_ids = enc(held), enc(train)
    counts = np.bincount(train_ids, minlength=model.args.vocab_size) + 1.0
    logp_uni = np.log(counts / counts.sum())
    nll = nll_uni = n = agree = n_agree = agree_text = n_text = 0.0
    # Tokens that are only line breaks: an undertrained model predicts them everywhere, so
    # agreement is also reported on the positions where the trunk predicts something else.
    breaks = mx.array(
        [i for t, i in tok._tokenizer.get_vocab().items() if t.strip("Ċ") == ""]
        if hasattr(tok, "_tokenizer")
        else []
    )
    latents = []

    windows = [
        held_ids[i : i + seq_len + 1] for i in range(0, len(held_ids) - seq_len - 1, seq_len)
    ]
    windows = windows[:max_windows]
    L = len(model.model.layers)
    sums = [None] * L
    count = 0
    for w in windows:
        x = mx.array(w[None, :-1])
        latents.clear()
        # The trunk's forward, layer by layer, to see each layer's latent on the way.
        h = model.model.embed_tokens(x)
        tmask = create_attention_mask(h, None, return_array=True)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            kv = attn.kv_a_proj_with_mqa(layer.input_layernorm(h))
            c = attn.kv_a_layernorm(kv[..., : attn.kv_lora_rank])
            latents.append((i, c.reshape(-1, c.shape[-1])))
            h = layer(h, tmask, None)
        h = model.model.norm(h)
        logits = model.lm_head(h).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = w[1:]
        nll += -float(mx.take_along_axis(lp[0], mx.array(y)[:, None], axis=-1).sum())
        nll_uni += -float(logp_uni[y].sum())
        n += len(y)
        # MTP at i (h_i, token i+1) vs the trunk's greedy choice at i+1.
        hm = h[:, :-1]
        mask = create_attention_mask(hm, None, return_array=True)
        mlog, _ = mtp(hm, x[:, 1:], mask, None)
        want = mx.argmax(logits[0, 1:], -1)
        hit = mx.argmax(mlog[0], -1) == want
        agree += float(hit.sum())
        n_agree += hm.shape[1]
        text = ~(want[:, None] == breaks[None, :]).any(-1) if breaks.size else mx.ones_like(hit)
        agree_text += float((hit & text).sum())
        n_text += float(text.sum())
        for i, c in latents:
            s = c.T @ c
            sums[i] = s if sums[i] is None else sums[i] + s
        count += x.shape[1]
    spectra = []
    for i in range(L):
        ev = np.linalg.eigvalsh(np.array(sums[i]) / count)[::-1]
        spectra.append(
            {
                "layer": i,
                "max": float(ev[0]),
                "min": float(ev[-1]),
                "top10_share": float(ev[:10].sum() / ev.sum()),
                "ratio_max_min": float(ev[0] / max(ev[-1], 1e-12)),
            }
        )
    return {
        "held_out_tokens": int(n),
        "ppl": math.exp(nll / n),
        "unigram_ppl": math.exp(nll_uni / n),
        "mtp_top1_agreement_with_trunk_greedy": agree / n_agree,
        "mtp_top1_agreement_where_trunk_predicts_text": agree_text / max(n_text, 1),
        "trunk_greedy_text_share": n_text / n_agree,
        "latent_spectra": spectra,
    }
