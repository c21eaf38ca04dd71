"""`macserve bench mtp`: MTP drafting against plain decoding, same prompts, same process.

Plain decoding is mlx-lm's own `generate_step` (the baseline a user would otherwise run);
drafting is `MTPDecoder`. Each prompt is run plain, then drafted, then plain again, and the
best of the plain runs is kept, so a noisy machine cannot flatter the ratio.
Optionally the same prompts go to a llama-server running the GGUF twin with
`--spec-type draft-mtp`, and its acceptance (timings.draft_n_accepted / draft_n) is reported.
"""

from __future__ import annotations

import time

import httpx
import mlx.core as mx
from mlx_lm.generate import generate_step

from ..mtp_auto import AutoMTP
from ..mtp_decode import MTPDecoder


def _plain(model, ids, n, make_cache):
    cache = make_cache()
    t = None
    out = []
    for (tok, _), _i in zip(
        generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache), range(n)
    ):
        if t is None:
            t = time.perf_counter()  # decode time starts after the first token (prefill)
        out.append(int(tok))
    return out, (len(out) - 1) / (time.perf_counter() - t)


def _drafted(dec, ids, n, make_cache):
    t = None
    out = []
    for tok in dec.generate(ids, n, caches=make_cache()):
        if t is None:
            t = time.perf_counter()
        out.append(tok)
    return out, (len(out) - 1) / (time.perf_counter() - t), dec.stats


def run(model, mtp, prompts: list[list[int]], k: int, n_tokens: int, make_cache) -> dict:
    dec = MTPDecoder(model, mtp, k=k, probe_rounds=10**9)  # measure drafting, never switch off
    # --mtp auto on the same prompts: its own figures, its decision, and the speed it got.
    auto = AutoMTP(k)
    adec = MTPDecoder(model, mtp, k=k, auto=auto)
    proposed, accepted = [0] * k, [0] * k
    t_plain = t_mtp = t_auto = 0.0
    identical = identical_auto = 0
    for ids in prompts:
        ref, tps1 = _plain(model, ids, n_tokens, make_cache)
        out, tps_m, st = _drafted(dec, ids, n_tokens, make_cache)
        out_a, tps_a, _ = _drafted(adec, ids, n_tokens, make_cache)
        _, tps2 = _plain(model, ids, n_tokens, make_cache)
        identical += out == ref
        identical_auto += out_a == ref
        t_plain += (len(ref) - 1) / max(tps1, tps2)
        t_mtp += (len(out) - 1) / tps_m
        t_auto += (len(out_a) - 1) / tps_a
        for j in range(k):
            proposed[j] += st.proposed[j]
            accepted[j] += st.accepted[j]
    toks = len(prompts) * (n_tokens - 1)
    plain, drafted = toks / t_plain, toks / t_mtp
    return {
        "k": k,
        "prompts": len(prompts),
        "tokens_per_prompt": n_tokens,
        "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)],
        "accepted_per_round": sum(accepted) / max(1, proposed[0]),
        "tokens_per_s_plain": plain,
        "tokens_per_s_mtp": drafted,
        "speedup": drafted / plain,
        "greedy_identical": identical == len(prompts),
        "greedy_identical_prompts": identical,
        "auto": {
            "drafting": auto.drafting,
            "figures": auto.last,  # what it decided on (its "speedup" is the estimate)
            "speedup": toks / t_auto / plain,  # what it got, against plain decoding
            "greedy_identical_prompts": identical_auto,
        },
    }


def llama_server_acceptance(url: str, prompts: list[str], n_tokens: int) -> dict:
    """Greedy raw completions against a llama-server started with --spec-type draft-mtp."""

    drafted = accepted = 0
    for p in prompts:
        r = httpx.post(
            f"{url}/completion",
            json={"prompt": p, "n_predict": n_tokens, "temperature": 0, "cache_prompt": False},
            timeout=300,
        )
        r.raise_for_status()
        t = r.json().get("timings", {})
        drafted += int(t.get("draft_n") or 0)
        accepted += int(t.get("draft_n_accepted") or 0)
    return {
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }
