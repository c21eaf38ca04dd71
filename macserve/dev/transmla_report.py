"""How close a converted MLA checkpoint (`macserve dev transmla`) is to its original.

`compare` runs both models over held-out text windows (teacher-forced, one forward per
window, no cache: the weights are what is compared, not a cache) and gives next-token
agreement (argmax equal), each model's perplexity and the KL from the original;
`answers` gives greedy chat answers of both, side by side. The converted model is loaded by
the engine's loader (`engine.model.load`, which honours `qk_latent_layernorm: false`), the
original by mlx-lm's.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate
from mlx_lm.sample_utils import make_sampler

from ..engine import model as engine_model
from . import transmla

QUESTIONS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Name three colours.",
)


def load_original(path):
    model, tok = mlx_load(str(path))
    model.set_dtype(mx.float32)
    return model, tok


def _logprobs(model, ids: np.ndarray) -> mx.array:
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(original, converted, tokenizer, n_windows: int = 2, seq_len: int = 512) -> dict:
    """Next-token agreement, perplexities and KL(original || converted) over `n_windows`
    held-out windows of `seq_len` tokens; `original`/`converted`: mlx-lm models."""
    wins = transmla.windows(tokenizer, transmla.held_out_text(), n_windows, seq_len + 1)
    agree = kl = nll_o = nll_c = 0.0
    n = 0
    for w in wins:
        inp, tgt = w[:-1], mx.array(w[1:])
        lo, lc = _logprobs(original, inp), _logprobs(converted, inp)
        agree += float((lo.argmax(-1) == lc.argmax(-1)).sum())
        kl += float((mx.exp(lo) * (lo - lc)).sum())
        nll_o -= float(mx.take_along_axis(lo, tgt[:, None], axis=-1).sum())
        nll_c -= float(mx.take_along_axis(lc, tgt[:, None], axis=-1).sum())
        n += len(inp)
    return dict(
        tokens=n,
        agreement=agree / n,
        kl=kl / n,
        ppl_original=math.exp(nll_o / n),
        ppl_converted=math.exp(nll_c / n),
    )


def answer(model, tokenizer, question: str, max_tokens: int = 48) -> str:
    msgs = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    out = generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
    return " ".join(out.split())


def report(original_dir, converted_dirs, n_windows=2, seq_len=512, max_tokens=48) -> dict:
    """For each converted folder: `compare` figures and greedy answers beside the original's."""
    original, tok = load_original(original_dir)
    out = dict(
        windows=n_windows,
        seq_len=seq_len,
        questions=list(QUESTIONS),
        original_answers=[answer(original, tok, q, max_tokens) for q in QUESTIONS],
        models=[],
    )
    for d in converted_dirs:
        b = engine_model.load(d)
        row = dict(path=str(d), **b.config.get("macserve_transmla", {}))
        row.update(compare(original, b.model, tok, n_windows, seq_len))
        row["answers"] = [answer(b.model, b.tokenizer, q, max_tokens) for q in QUESTIONS]
        out["models"].append(row)
    return out
