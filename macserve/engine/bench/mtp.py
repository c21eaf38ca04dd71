"""`macserve bench mtp`: MTP drafting against plain decoding, same prompts, same process.

Plain decoding is mlx-lm's own `generate_step` (the baseline a user would otherwise run);
drafting is `MTPDecoder` (`--mtp on`), and `--mtp auto` is `MTPDecoder` with one AutoMTP kept
across the prompts. Each prompt runs all three back to back, in a rotating order; the ratios
are taken per prompt and their medians reported, so a noisy machine cannot flatter one.
Optionally the same prompts go to a llama-server running the GGUF twin with
`--spec-type draft-mtp`, and its acceptance (timings.draft_n_accepted / draft_n) is reported.
"""

from __future__ import annotations

import statistics
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
    """Per prompt, plain (off), drafting (on) and `--mtp auto` run back to back, in an order
    that rotates from prompt to prompt (so a drift in the machine's load weighs on each
    alike); each ratio is taken within its prompt and the medians are reported. auto keeps
    one AutoMTP across the prompts, as a server does: its first prompts measure."""
    dec = MTPDecoder(model, mtp, k=k, probe_rounds=10**9)  # measure drafting, never switch off
    auto = AutoMTP(k)
    adec = MTPDecoder(model, mtp, k=k, auto=auto)
    proposed, accepted = [0] * k, [0] * k
    t_plain = t_mtp = t_auto = 0.0
    identical = identical_auto = 0
    on_off, auto_off, auto_best, auto_drafted = [], [], [], []
    for i, ids in enumerate(prompts):
        runs = {
            "off": lambda ids=ids: _plain(model, ids, n_tokens, make_cache),
            "on": lambda ids=ids: _drafted(dec, ids, n_tokens, make_cache),
            "auto": lambda ids=ids: _drafted(adec, ids, n_tokens, make_cache),
        }
        order = ["off", "on", "auto"]
        order = order[i % 3 :] + order[: i % 3]
        got = {name: runs[name]() for name in order}
        (ref, tps_p), (out, tps_m, st), (out_a, tps_a, st_a) = got["off"], got["on"], got["auto"]
        identical += out == ref
        identical_auto += out_a == ref
        t_plain += (len(ref) - 1) / tps_p
        t_mtp += (len(out) - 1) / tps_m
        t_auto += (len(out_a) - 1) / tps_a
        on_off.append(tps_m / tps_p)
        auto_off.append(tps_a / tps_p)
        auto_best.append(tps_a / max(tps_p, tps_m))
        auto_drafted.append(st_a.rounds > 0)
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
        "speedup": statistics.median(on_off),  # on / off, the median of the prompts' ratios
        "greedy_identical": identical == len(prompts),
        "greedy_identical_prompts": identical,
        "auto": {
            "drafting": auto.drafting,
            "figures": auto.last,  # what it decided on (its "speedup" is its own measure)
            "tokens_per_s": toks / t_auto,  # over all the prompts, as the two above
            "speedup": statistics.median(auto_off),  # what it got, against plain decoding
            "vs_best": statistics.median(auto_best),  # ... against the faster of on and off
            "drafted_prompts": sum(auto_drafted),
            "greedy_identical_prompts": identical_auto,
        },
        "per_prompt": {"on_vs_off": on_off, "auto_vs_off": auto_off, "auto_drafted": auto_drafted},
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
