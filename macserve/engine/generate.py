"""The decode loop: stream tokens for one prompt at a time from a loaded model (model.py).

Sampling, the KV cache and prefill chunking are mlx-lm's (`generate_step`, `make_sampler`);
this module adds what a server needs around them: a stop callback checked before every token
(and between prefill chunks), EOS handling, streaming detokenization and per-request stats.

Not thread-safe: one generation at a time per Bundle, from one thread (the server's worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, wired_limit
from mlx_lm.sample_utils import make_sampler

from . import scratch
from .caches import EngineOptions
from .model import Bundle
from .mtp_auto import AutoMTP, drafting_mode, may_draft_with, mtp_status
from .mtp_decode import MTPDecoder


@dataclass
class Step:
    """One streamed token. The last Step of a finished generation has finish_reason "stop"
    (the model emitted EOS: `token` is that EOS id, not counted in stats, `text` only the
    detokenizer's flush) or "length" (max_tokens reached: `token` is the last real token).
    A generation cancelled by `stop` simply ends without a finishing Step."""

    token: int
    text: str
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    # With `top_logprobs` set: this token's log-probability and the n most likely (id, logprob).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class Counters:
    """Speculative-decoding counts a token source updates as it goes (plain decoding: 0)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    mtp: dict = field(default_factory=dict)  # drafting or not, and why (mtp_auto.status)


class _Cancelled(Exception):
    pass


def cut_text(detok) -> str:
    """The detokenizer's last text when max_tokens ends an answer. A character whose bytes the
    cut left incomplete (an emoji is 3 of SmolLM2's tokens) is left out: mlx-lm's `finalize`
    decodes those bytes as U+FFFD, which a client would show as a broken character; llama-server's
    stream leaves them out too. An answer that ends at the end of its turn keeps whatever the
    model wrote."""
    detok.finalize()
    return detok.last_segment.rstrip("\ufffd")


def _plain_tokens(
    bundle: Bundle,
    prompt,
    max_tokens: int,
    sampler,
    counters: Counters,
    progress,
    cache=None,
    logits_processors=None,
    logprobs_out: list | None = None,
) -> Iterator[int]:
    """The token source: mlx-lm's own loop. An MTP source yields tokens the same way and
    bumps `counters` for each drafted / accepted token. `logprobs_out`, when given, receives
    each token's log-probability vector just before the token is yielded."""
    for token, logprobs in generate_step(
        prompt,
        bundle.model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_progress_callback=progress,
        prompt_cache=cache,
        # mlx-lm's chunk is fixed for the prompt: the one that fits at its end (scratch.py)
        prefill_step_size=scratch.chunk(scratch.model_widths(bundle.model), len(prompt), 2048),
    ):
        if logprobs_out is not None:
            logprobs_out.append(logprobs)
        yield int(token)


def _top(logprobs: mx.array, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A token's log-probability and the n most likely tokens, most likely first."""
    if n <= 0:
        return float(logprobs[token].item()), ()
    ids = mx.argpartition(-logprobs, n - 1)[:n]
    vals = logprobs[ids].tolist()
    top = sorted(zip(ids.tolist(), vals), key=lambda x: -x[1])
    return float(logprobs[token].item()), tuple((int(i), float(v)) for i, v in top)


def _mtp_tokens(
    bundle: Bundle,
    prompt_ids,
    max_tokens,
    temperature,
    counters,
    options,
    cache,
    seed,
    progress,
    auto=None,
) -> Iterator[int]:
    dec = MTPDecoder(
        bundle.model,
        bundle.mtp(),
        k=options.mtp_k,
        mtp_cache=bundle.mtp_cache_factory(options.cache),
        auto=auto,
    )
    for token in dec.generate(
        list(prompt_ids),
        max_tokens,
        caches=cache,
        temperature=temperature,
        eos=bundle.eos_ids,
        seed=seed,
        progress=progress,
    ):
        counters.draft_tokens = dec.stats.draft_tokens
        counters.accepted_tokens = dec.stats.accepted_tokens
        if auto is not None:
            counters.mtp = dec.auto_status()
        yield token


def stream(
    bundle: Bundle,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Callable[[], bool] | None = None,
    options: EngineOptions = EngineOptions(),
    seed: int = 0,
    logits_processors: list | None = None,
    top_logprobs: int | None = None,
    auto: AutoMTP | None = None,
    seeded: bool = False,
) -> Iterator[Step]:
    """Stream one generation with `options`: its cache (bf16, or the rotated INT2 latent
    cache) and MTP drafting (mtp_k > 0; top_p < 1 is not supported with drafting, so it
    decodes plainly then).

    `logits_processors` (mlx-lm's: f(tokens, logits) -> logits, e.g. a grammar's token mask)
    and `top_logprobs` (n >= 0: each Step carries its logprob and the n most likely tokens)
    also decode plainly: MTP drafts are neither masked nor scored, so a constrained request
    stays exactly as correct with --mtp-k as without.

    `options.mtp` auto drafts while `auto` (an AutoMTP kept by the caller across requests;
    a fresh one when None) measures that it pays. Under mlx.launch auto drafts as on: every
    rank must take the same path, and each would time its own share differently."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if not prompt_ids:
        raise ValueError("empty prompt")
    # make_sampler applies top-p only for 0 < top_p < 1, so 1.0 means "off", as in OpenAI's API.
    sampler = make_sampler(temp=temperature, top_p=top_p)
    detok = bundle.tokenizer.detokenizer
    eos = bundle.eos_ids
    counters = Counters()
    stop = stop or (lambda: False)

    def progress(done, total):
        # Raising is the only way out of mlx-lm's prefill; it lets a long prompt be cancelled.
        if stop():
            raise _Cancelled

    t0 = time.perf_counter()
    t_first = None
    n = 0

    def stats() -> dict:
        now = time.perf_counter()
        prompt_s = (t_first or now) - t0
        gen_s = now - t_first if t_first else 0.0
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
            "prompt_tps": len(prompt_ids) / prompt_s if prompt_s > 0 else 0.0,
            "generation_tps": n / gen_s if gen_s > 0 else 0.0,
            "prompt_seconds": prompt_s,
            "generation_seconds": gen_s,
            "draft_tokens": counters.draft_tokens,
            "accepted_tokens": counters.accepted_tokens,
            "mtp": counters.mtp,
        }

    cache = bundle.caches(options.cache)
    plain_only = bool(logits_processors) or top_logprobs is not None
    logprobs_out = [] if top_logprobs is not None else None
    mode = drafting_mode(bundle, options)
    if mode[0] == "auto" and mx.distributed.init().size() > 1:
        mode = ("on", "--mtp auto drafts as on under mlx.launch")
    may_draft = may_draft_with(top_p, plain_only, temperature, seeded and mode[0] == "auto")
    counters.mtp = mtp_status(mode, may_draft)
    if mode[0] != "off" and may_draft:
        if mode[0] == "auto":
            auto = auto or AutoMTP(options.mtp_k)
            counters.mtp = auto.status()
        tokens = _mtp_tokens(
            bundle,
            prompt_ids,
            max_tokens,
            temperature,
            counters,
            options,
            cache,
            seed,
            progress,
            auto if mode[0] == "auto" else None,
        )
    else:
        tokens = _plain_tokens(
            bundle,
            mx.array(prompt_ids),
            max_tokens,
            sampler,
            counters,
            progress,
            cache,
            logits_processors,
            logprobs_out,
        )
    with wired_limit(bundle.model, [generation_stream]):
        try:
            for token in tokens:
                if t_first is None:
                    t_first = time.perf_counter()
                if stop():
                    return
                lp, top = (None, ())
                if logprobs_out:
                    lp, top = _top(logprobs_out.pop(), token, top_logprobs)
                if token in eos:
                    detok.finalize()
                    yield Step(token, detok.last_segment, "stop", stats())
                    return
                n += 1
                detok.add_token(token)
                if n >= max_tokens:
                    yield Step(token, cut_text(detok), "length", stats(), lp, top)
                    return
                yield Step(token, detok.last_segment, None, stats(), lp, top)
        except _Cancelled:
            return
        finally:
            tokens.close()
