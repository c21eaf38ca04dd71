"""Greedy k = 1 MTP decoding with the next round built before this one is read.

mlx-lm's plain loop overlaps building step n+1 with computing step n (async_eval); a draft
round that waited for its own result would pay the graph building that plain decoding hides.
So round n+1 is built assuming round n's draft is accepted; when it is not, round n+1's cache
rows are trimmed away, unread. `K1Rounds` steps such rounds and can leave them mid-generation
(the round in flight trimmed away) for plain steps: `greedy_k1` (`--mtp on`) and `--mtp
auto`'s drafting spans (mtp_auto_decode.py) run the same rounds.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .mtp_accept import trim_all


class Round:
    """One k = 1 round, built lazily: MTP draft d from the pending rows, trunk over [t, d]."""

    def __init__(self, dec, t, pend_h, pend_tok, caches, mtp_cache):
        m_logits, _ = dec.mtp_forward(pend_h, pend_tok, mtp_cache)
        self.pend_h, self.pend_tok = pend_h, pend_tok
        self.mtp_rows = pend_h.shape[1]
        d = mx.argmax(m_logits[0, -1:], axis=-1)
        self.seq = mx.concatenate([t, d])
        self.h = dec.model.model(self.seq[None], caches)
        self.target = mx.argmax(dec.model.lm_head(self.h)[0], axis=-1)
        mx.async_eval(self.seq, self.target)

    def speculate(self, dec, caches, mtp_cache) -> Round:
        """The next round, as if the draft is accepted: built while this one computes."""
        bonus = self.target[1:2]
        return Round(
            dec, bonus, self.h, mx.concatenate([self.seq[1:], bonus])[None], caches, mtp_cache
        )


class K1Rounds:
    """Pipelined greedy k = 1 rounds from last token t (not yet fed) and the MTP layer's
    pending rows (trunk hiddens `pend_h`, their next tokens `pend_tok`)."""

    def __init__(self, dec, t: int, pend_h, pend_tok: list[int], caches, mtp_cache):
        self.dec, self.caches, self.mtp_cache = dec, caches, mtp_cache
        self.cur = Round(dec, mx.array([t]), pend_h, mx.array([pend_tok]), caches, mtp_cache)

    def next(self) -> list[int]:
        """Read the round in flight (the next one is built first); the tokens it emits."""
        dec, cur, stats = self.dec, self.cur, self.dec.stats
        nxt = cur.speculate(dec, self.caches, self.mtp_cache)
        seq, target = np.array(cur.seq), np.array(cur.target)
        d = int(seq[1])
        accepted = d == int(target[0])
        stats.rounds += 1
        stats.proposed[0] += 1
        stats.accepted[0] += accepted
        if accepted:
            self.cur = nxt
            return [d, int(target[1])]
        # Round n+1 was built on the rejected draft: drop its rows, then the draft's.
        trim_all(self.caches, 2 + 1)
        trim_all([self.mtp_cache], nxt.mtp_rows)
        b = int(target[0])
        self.cur = Round(
            dec, mx.array([b]), cur.h[:, :1], mx.array([[b]]), self.caches, self.mtp_cache
        )
        return [b]

    def leave(self) -> tuple[int, list, list[int]]:
        """Drop the round in flight: (the next token to feed, pending hiddens, their tokens)."""
        cur = self.cur
        trim_all(self.caches, 2)
        trim_all([self.mtp_cache], cur.mtp_rows)
        return int(np.array(cur.seq)[0]), [cur.pend_h], np.array(cur.pend_tok)[0].tolist()


def greedy_k1(dec, t, pend_h, caches, mtp_cache, max_tokens, eos, t0):
    """Yield the tokens of `dec` (an MTPDecoder) from last token t, greedy, one draft a round,
    pipelined; `dec.stats` and `dec.timings` are kept as MTPDecoder.generate keeps them."""
    stats = dec.stats
    yield t
    produced = 1
    if produced >= max_tokens or t in eos:
        return
    rounds = K1Rounds(dec, t, pend_h, [t], caches, mtp_cache)
    while True:
        for tok in rounds.next():
            yield tok
            produced += 1
            if produced >= max_tokens or tok in eos:
                dec.timings["decode_s"] = time.perf_counter() - t0
                return
        if (
            stats.rounds >= dec.probe_rounds
            and stats.accepted_tokens / stats.rounds < dec.min_accept
        ):
            stats.disabled_after = stats.rounds
            # The round in flight is dropped; plain decoding continues from its first token.
            # (The MTP cache is left behind: drafting does not resume in this generation.)
            nxt_t, _, _ = rounds.leave()
            while True:
                logits = dec.model(mx.array([[nxt_t]]), cache=caches)
                nxt_t = int(mx.argmax(logits[0, -1]).item())
                yield nxt_t
                produced += 1
                if produced >= max_tokens or nxt_t in eos:
                    dec.timings["decode_s"] = time.perf_counter() - t0
                    return
