"""`--mtp auto`'s decoding loop: spans of plain steps or draft rounds as the AutoMTP
(mtp_auto.py) plans them, each run as its own mode runs at full speed: draft rounds as
`--mtp on` runs them (greedy k = 1 pipelined, `K1Rounds`; else `draft_round` + `settle`),
plain steps pipelined as mlx-lm's loop (greedy) or one by one (sampled).

What a measuring span reports is what the caller got: the wall time from one step's or
round's last token handed over to the next's (the caller's own time per token included, as
both modes pay it), tokens and seconds per step or round, on `auto.clock`. The first round
after a switch of mode is not counted: it pays the switch. Plain steps keep their trunk
hiddens pending (a list, joined once), so the MTP layer catches up on them when drafting
resumes. The first step or round of a generation is not counted either (it fills the
pipeline). MTPDecoder.generate runs this loop when it is given an `auto`.
"""

from __future__ import annotations

import mlx.core as mx

from .mtp_accept import pick, trim_all
from .mtp_pipelined import K1Rounds


class _Plain:
    """Plain steps from last token t; greedy ones pipelined (step n+1 built before step n is
    read; `leave` trims the step built ahead)."""

    def __init__(self, dec, t, pend, pend_tok, caches, temperature, rng):
        self.dec, self.caches, self.pend, self.pend_tok = dec, caches, pend, pend_tok
        self.temperature, self.rng = temperature, rng
        self.t = t
        self.ahead = self._build(mx.array([t])) if temperature <= 0 else None

    def _build(self, tok):
        h = self.dec.model.model(tok.reshape(1, 1), self.caches)
        y = mx.argmax(self.dec.model.lm_head(h[:, -1])[0])
        mx.async_eval(y)
        return h, y

    def next(self) -> list[int]:
        if self.ahead is None:
            h = self.dec.model.model(mx.array([[self.t]]), self.caches)
            tok = pick(self.dec.model.lm_head(h[:, -1])[0], self.temperature, self.rng)
        else:
            h, y = self.ahead
            self.ahead = self._build(y)
            tok = int(y.item())
        self.pend.append(h)
        self.pend_tok.append(tok)
        self.t = tok
        return [tok]

    def leave(self):
        if self.ahead is not None:
            trim_all(self.caches, 1)  # the step built ahead
        return self.t, self.pend, self.pend_tok


class _Rounds:
    """Draft rounds one by one (sampled, or k > 1), as MTPDecoder.generate runs them."""

    def __init__(self, dec, t, pend, pend_tok, caches, mtp_cache, temperature, rng):
        self.dec, self.caches, self.mtp_cache = dec, caches, mtp_cache
        self.temperature, self.rng = temperature, rng
        self.t, self.pend, self.pend_tok = t, pend, pend_tok

    def next(self) -> list[int]:
        dec, pend = self.dec, self.pend
        pend_h = pend[0] if len(pend) == 1 else mx.concatenate(pend, axis=1)
        a, drafts, bonus, h = dec.draft_round(
            self.t, pend_h, self.pend_tok, self.caches, self.mtp_cache, self.temperature, self.rng
        )
        out, pend_h, self.pend_tok = dec.settle(a, drafts, bonus, h, self.caches, self.mtp_cache)
        self.pend, self.t = [pend_h], out[-1]
        return out

    def leave(self):
        return self.t, self.pend, list(self.pend_tok)


def _runner(dec, drafting, t, pend, pend_tok, caches, mtp_cache, temperature, rng):
    if not drafting:
        return _Plain(dec, t, pend, pend_tok, caches, temperature, rng)
    if temperature <= 0 and dec.k == 1 and dec.pipeline:
        pend_h = pend[0] if len(pend) == 1 else mx.concatenate(pend, axis=1)
        return K1Rounds(dec, t, pend_h, pend_tok, caches, mtp_cache)
    return _Rounds(dec, t, pend, pend_tok, caches, mtp_cache, temperature, rng)


def auto_decode(dec, t, pend_h, pend_tok, caches, mtp_cache, max_tokens, eos, temperature, rng):
    """Yield the tokens of `dec` (an MTPDecoder with an `auto`) from last token t; what the
    generation did is left in `dec.auto_measured` (it ran measuring spans)."""
    auto = dec.auto
    clock = auto.clock
    pend, pend_tok = [pend_h], list(pend_tok)
    dec.auto_measured = False
    produced = 1
    auto.tokens(1)
    yield t
    if produced >= max_tokens or t in eos:
        return
    mark = clock()  # when the last step's or round's last token was handed over
    # The first step or round of a generation fills the pipeline: like the first after a
    # switch, it is run but not counted (a short answer would weigh it as much as the rest).
    current = None  # the mode of the span before (None: none yet in this generation)
    run = None
    while True:
        drafting, limit, measured = auto.plan(current)
        switched = current != drafting
        if run is None or switched:  # the same mode goes on with the same steps in flight
            if run is not None:
                t, pend, pend_tok = run.leave()
            run = _runner(dec, drafting, t, pend, pend_tok, caches, mtp_cache, temperature, rng)
        current = drafting
        dec.auto_measured |= measured
        n = 0
        while limit is None or n < limit:
            out = run.next()
            if drafting:
                auto.round(len(out) - 1)  # drafts accepted: all but the trunk's own token
            for i, tok in enumerate(out):
                produced += 1
                ended = produced >= max_tokens or tok in eos
                if ended or i == len(out) - 1:
                    now = clock()
                    if measured and not switched:
                        auto.measured(drafting, i + 1, now - mark)
                    mark = now
                auto.tokens(1)
                yield tok
                if ended:
                    return
            n += len(out)
            switched = False
