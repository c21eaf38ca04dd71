"""`--mtp auto`'s decoding loop: plain steps or draft rounds as the AutoMTP (mtp_auto.py)
decides, probing whenever it asks (timed plain steps and rounds, alternated, so a change in
the machine's load weighs on both figures alike). Plain steps keep their trunk hiddens pending
(a list, joined once), so the MTP layer catches up on them when drafting resumes.
MTPDecoder.generate runs this loop when it is given an `auto`.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .mtp_accept import pick, trim_all
from .mtp_auto import PROBE_STEPS


def auto_decode(dec, t, pend_h, pend_tok, caches, mtp_cache, max_tokens, eos, temperature, rng):
    """Yield the tokens of `dec` (an MTPDecoder with an `auto`) from last token t."""
    auto = dec.auto
    produced = 0

    def emit(tok: int) -> bool:
        """Count a token about to be yielded; True when the generation ends with it."""
        nonlocal produced
        produced += 1
        auto.tokens(1)
        return produced >= max_tokens or tok in eos

    pend = [pend_h]
    pend_tok = list(pend_tok)
    ended = emit(t)
    yield t
    if ended:
        return
    while True:
        probe = auto.probe_due()
        if not probe and not auto.drafting and temperature <= 0:
            state = yield from _plain_greedy(dec, t, caches, pend, pend_tok, emit)
            if state is None:
                return
            t = state
            continue
        phases = [(False, 1), (True, 1)] * PROBE_STEPS if probe else [(bool(auto.drafting), None)]
        for drafting, steps in phases:
            done = 0
            while (done < steps) if steps is not None else not auto.probe_due():
                done += 1
                if drafting:
                    pend_h = pend[0] if len(pend) == 1 else mx.concatenate(pend, axis=1)
                    a, drafts, bonus, h = dec.draft_round(
                        t, pend_h, pend_tok, caches, mtp_cache, temperature, rng,
                        auto if probe else None,
                    )  # fmt: skip
                    auto.round(a)
                    out, pend_h, pend_tok = dec.settle(a, drafts, bonus, h, caches, mtp_cache)
                    pend = [pend_h]
                else:
                    t0 = time.perf_counter()
                    h = dec.model.model(mx.array([[t]]), caches)
                    out = [pick(dec.model.lm_head(h[:, -1])[0], temperature, rng)]
                    if probe:
                        auto.plain(time.perf_counter() - t0)
                    pend.append(h)
                    pend_tok.append(out[0])
                t = out[-1]  # the next token to feed
                for tok in out:
                    ended = emit(tok)
                    yield tok
                    if ended:
                        return
        if probe:
            auto.decide()


def _plain_greedy(dec, t, caches, pend, pend_tok, emit):
    """Greedy plain decoding until a probe is due, pipelined as mlx-lm's loop is (step
    n+1 is built before step n is read). Returns the next token to feed, or None when
    the generation ended; the step built ahead is trimmed from the caches."""
    h = dec.model.model(mx.array([[t]]), caches)
    y = mx.argmax(dec.model.lm_head(h[:, -1])[0])
    mx.async_eval(y)
    while True:
        h2 = dec.model.model(y.reshape(1, 1), caches)
        y2 = mx.argmax(dec.model.lm_head(h2[:, -1])[0])
        mx.async_eval(y2)
        tok = int(y.item())
        pend.append(h)
        pend_tok.append(tok)
        ended = emit(tok)
        yield tok
        if ended or dec.auto.probe_due():
            trim_all(caches, 1)  # the step built ahead
            return None if ended else tok
        h, y = h2, y2
