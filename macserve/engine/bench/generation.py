"""`bench kv`'s free generations: each cache generates greedily from held-out prompts until an
end-of-turn token or a generous limit, and is set against the bf16 latent cache's generation.

Teacher-forced ΔPPL and KL score every position with the true history, so they cannot see
what windows cost on long outputs: a cache that drifts the argmax makes the generation run on
(or stop) elsewhere. Published results on reasoning models saw exactly that: smaller recent
windows lost accuracy by truncating longer generations, not by wrong answers. So, per cache:

- first divergence: the first generated position where its token differs from bf16's (one
  generation ending where the other goes on counts as a difference); a prompt whose whole
  generation equals bf16's counts as its length (so the median is a lower bound then);
- generated length: tokens generated, the end-of-turn token included;
- end-of-turn rate: the share of prompts that ended with an end-of-turn token before the limit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import mlx.core as mx


class TooLong(ValueError):
    """Prompt + generation would run past the model's context."""


def generate(model, caches, prompt: Sequence[int], max_tokens: int, eos, chunk: int = 64):
    """Greedy tokens after `prompt` (prefilled through `caches` in chunks, as serve does), up
    to `max_tokens`, stopping after the first token in `eos`."""
    logits = None
    for s in range(0, len(prompt), chunk):
        logits = model(mx.array([list(prompt[s : s + chunk])]), cache=caches)
        mx.eval(logits)
    out = []
    while len(out) < max_tokens:
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        if tok in eos:
            break
        logits = model(mx.array([[tok]]), cache=caches)
    return out


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """The first position where `got` differs from `ref` (an end counts); None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def summary(ref: list[list[int]] | None, gens: list[list[int]], max_tokens: int, eos) -> dict:
    """The generation columns of one cache against the bf16 generations `ref` (None: this is
    bf16's own)."""
    ref = gens if ref is None else ref
    divs = [first_divergence(r, g) for r, g in zip(ref, gens)]
    ended = [bool(g) and g[-1] in eos for g in gens]
    return {
        "gen_prompts": len(gens),
        "gen_max_tokens": max_tokens,
        "gen_first_divergence": statistics.median(
            len(g) if d is None else d for d, g in zip(divs, gens)
        ),
        "gen_first_divergence_per_prompt": divs,
        "gen_identical": sum(d is None for d in divs) / len(gens),
        "gen_length": sum(len(g) for g in gens) / len(gens),
        "gen_end_of_turn": sum(ended) / len(gens),
    }


def run(
    model,
    make_caches: dict[str, Callable[[], list]],
    prompts: list[list[int]],
    max_tokens: int,
    eos,
    progress=None,
) -> dict[str, dict]:
    """Per name (the first of `make_caches` is the bf16 reference): its generation columns."""
    limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    longest = max(len(p) for p in prompts) + max_tokens
    if limit and longest > limit:
        raise TooLong(
            f"prompts of up to {longest - max_tokens} tokens + {max_tokens} generated exceed the "
            f"model's context ({limit})"
        )
    names = list(make_caches)
    gens = {n: [] for n in names}
    done = 0
    for p in prompts:
        for n in names:
            gens[n].append(generate(model, make_caches[n](), p, max_tokens, eos))
            done += 1
            if progress:
                progress(done, len(prompts) * len(names))
    ref = gens[names[0]]
    return {
        n: summary(None if i == 0 else ref, gens[n], max_tokens, eos) for i, n in enumerate(names)
    }
