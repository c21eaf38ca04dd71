"""MTP speculative decoding: the model's own next-n layer drafts, one trunk forward verifies.

Alignment (DeepSeek-V3): the MTP layer at position i reads the trunk's post-norm hidden h_i
and the embedding of token i+1, and predicts token i+2. Its cache is indexed like the trunk's.

One round, with t the last emitted token (at position n) and the MTP cache filled to n-1:
  1. MTP over the pending rows (h_j, token j+1) up to (h_{n-1}, t) -> draft d1; for k > 1 the
     MTP output hidden is fed back with d1 -> d2, ... (chained, DeepSeek's inference use).
  2. The trunk reads [t, d1..dk] in one forward: logits for positions n..n+k.
  3. Accept by the exact rule: greedy, the longest prefix equal to the trunk's argmax; sampled,
     lossless rejection sampling (accept d with min(1, p/q), else resample from (p-q)+).
  4. Emit the accepted drafts and one token from the trunk; trim the trunk cache of the
     rejected positions and the MTP cache of the chained rows (they used MTP hiddens, not
     trunk ones); the trunk hiddens of the accepted positions become the next pending rows.

Drafting switches itself off for the rest of a generation when, after `probe_rounds`, the
accepted drafts per round fall below `min_accept_per_round` (break-even; see docs). With an
`auto` (mtp_auto.AutoMTP, `--mtp auto`) it is instead on or off as drafting's measured
tokens per second over plain decoding's say, measured across generations and re-checked.

The prompt is prefilled in chunks (PREFILL_STEP tokens, as mlx-lm's generate_step does), the
trunk and the MTP layer chunk by chunk, each chunk evaluated before the next, with the
vocabulary head applied to the last row only. Rolling back rejected drafts uses each cache's
`trim`, whose count is checked: a cache that cannot roll back exactly is an error, never a
silent drift.

Here: the decoder (a round, its settlement, the prefill, `generate`). The acceptance rules,
statistics and exact rollback: mtp_accept.py; greedy k = 1's pipelined loop: mtp_pipelined.py;
`--mtp auto`'s loop: mtp_auto_decode.py.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from . import scratch
from .mtp_accept import DraftStats, pick, probs, trim_all, verify_sampled
from .mtp_auto_decode import auto_decode
from .mtp_pipelined import greedy_k1

PREFILL_STEP = 2048  # prompt tokens per chunk (mlx-lm's generate_step default)


class MTPDecoder:
    """Generates with trunk `model` (mlx-lm) and `mtp` (an MTPLayer) sharing one tokenizer."""

    def __init__(
        self,
        model,
        mtp,
        k: int = 1,
        min_accept_per_round: float = 0.25,
        probe_rounds: int = 16,
        mtp_cache=KVCache,
        prefill_step: int = PREFILL_STEP,
        auto=None,
    ):
        """`mtp_cache`: makes the MTP layer's cache (mlx-lm's KVCache; with --kv int2 a
        RotatedLatentCache, so the layer's cache is in the same format as the trunk's).
        `auto`: an AutoMTP (mtp_auto.py): drafting only while it is measured to pay, instead
        of the break-even rule below."""
        if not 1 <= k <= 3:
            raise ValueError(f"draft length k must be 1..3, not {k}")
        self.model, self.mtp, self.k = model, mtp, k
        self.mtp_cache = mtp_cache
        self.prefill_step = prefill_step
        self.min_accept, self.probe_rounds = min_accept_per_round, probe_rounds
        self.pipeline = True  # greedy k = 1: build the next round before reading this one
        self.auto = auto
        self.auto_measured = False  # the last generation ran --mtp auto's measuring spans

    def auto_status(self) -> dict:
        """--mtp auto's status for the current generation: drafting exactly when it drafted."""
        stats = getattr(self, "stats", None)
        return self.auto.generation_status(stats.rounds if stats else 0, self.auto_measured)

    def trunk(self, tokens: list[int], cache):
        h = self.model.model(mx.array([tokens]), cache)
        return h, self.model.lm_head(h)

    def mtp_forward(self, h: mx.array, tokens, cache):
        """The MTP layer over hidden rows `h` and their next tokens: (logits, its hidden)."""
        mask = create_attention_mask(h, cache, return_array=True)
        tokens = tokens if isinstance(tokens, mx.array) else mx.array([tokens])
        return self.mtp(h, tokens, mask, cache)

    def draft_round(self, t, pend_h, pend_tok, caches, mtp_cache, temperature, rng):
        """One draft round from last token t: (drafts accepted, drafts, the trunk's token,
        trunk hiddens of [t, drafts]). The caches are not trimmed here."""
        drafts, q_rows = [], []
        m_logits, z = self.mtp_forward(pend_h, pend_tok, mtp_cache)
        m_logits, z = m_logits[:, -1:], z[:, -1:]
        if temperature <= 0:
            # Drafts stay lazy arrays: drafting and verification evaluate together, one
            # synchronization per round instead of one per draft plus one to verify.
            d_arr = []
            for j in range(self.k):
                d_arr.append(mx.argmax(m_logits[0, -1:], axis=-1))
                if j + 1 < self.k:
                    m_logits, z = self.mtp_forward(z, d_arr[-1][None], mtp_cache)
            seq = mx.concatenate([mx.array([t])] + d_arr)[None]
            h = self.model.model(seq, caches)
            logits = self.model.lm_head(h)
            both = np.array(mx.concatenate([seq[0, 1:], mx.argmax(logits[0], axis=-1)]))
            drafts = [int(x) for x in both[: self.k]]
            target = [int(x) for x in both[self.k :]]
            a = 0
            while a < self.k and drafts[a] == target[a]:
                a += 1
            bonus = target[a]
        else:
            for j in range(self.k):
                q = probs(m_logits[0, -1], temperature)
                d = int(rng.choice(len(q), p=q))
                q_rows.append(q)
                drafts.append(d)
                if j + 1 < self.k:
                    m_logits, z = self.mtp_forward(z, [d], mtp_cache)
            h, logits = self.trunk([t] + drafts, caches)
            p_all = probs(logits[0], temperature)
            a, bonus = verify_sampled(list(p_all[: self.k]), q_rows, drafts, p_all[self.k], rng)
        return a, drafts, bonus, h

    def settle(self, a, drafts, bonus, h, caches, mtp_cache):
        """A round's counts and rollbacks: (tokens emitted, pending MTP rows, their tokens)."""
        stats = self.stats
        stats.rounds += 1
        for j in range(min(a + 1, self.k)):
            stats.proposed[j] += 1
        for j in range(a):
            stats.accepted[j] += 1
        trim_all(caches, self.k - a)
        if self.k > 1:
            trim_all([mtp_cache], self.k - 1)
        emitted = drafts[:a] + [bonus]
        return emitted, h[:, : a + 1], emitted

    def prefill(
        self, prompt: list[int], caches, mtp_cache, step: int = PREFILL_STEP, progress=None
    ) -> mx.array:
        """The prompt through the trunk and the MTP layer, chunk by chunk; returns the trunk's
        hidden state at the last position. The MTP rows (h_i, token i+1) for i < n - 1 are
        cached; the last one waits for the token sampled from it. `progress(done, total)` is
        called after each chunk (raising in it cancels)."""
        n = len(prompt)
        carry = None  # the previous chunk's last hidden row: its MTP row needs this chunk's token
        h = None
        w = scratch.model_widths(self.model)
        start = caches[0].offset if hasattr(caches[0], "offset") else 0
        s = 0
        while s < n:
            e = min(n, s + scratch.chunk(w, start + s, step))  # its scratch within the budget
            h = self.model.model(mx.array([prompt[s:e]]), caches)
            rows = h[:, :-1] if carry is None else mx.concatenate([carry, h[:, :-1]], axis=1)
            toks = prompt[s + 1 : e] if carry is None else prompt[s:e]
            carry = h[:, -1:]
            if toks:
                mask = create_attention_mask(rows, mtp_cache, return_array=True)
                z = self.mtp.hidden(rows, mx.array([toks]), mask, mtp_cache)
                mx.eval(carry, z[:, -1:], [c.state for c in caches], mtp_cache.state)
            else:
                mx.eval(carry, [c.state for c in caches])
            if progress is not None:
                progress(e, n)
            s = e
        return h[:, -1:]

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        caches=None,
        temperature: float = 0.0,
        eos: set[int] | frozenset = frozenset(),
        seed: int = 0,
        draft: bool = True,
        progress=None,
        mtp_cache=None,
        cached: int = 0,
        on_prefilled=None,
    ):
        """Yield tokens; `self.stats` holds the draft statistics of the current generation.

        A prompt cache may hand over `caches` and `mtp_cache` already holding the first
        `cached` prompt tokens and as many MTP rows (the row of the last of them included:
        its next token is known); only the rest of the prompt is prefilled.
        `on_prefilled(caches, mtp_cache)` is called once the prompt is in (to snapshot it)."""
        rng = np.random.default_rng(seed)
        greedy = temperature <= 0
        caches = caches if caches is not None else make_prompt_cache(self.model)
        mtp_cache = mtp_cache if mtp_cache is not None else self.mtp_cache()
        self.stats = stats = DraftStats(self.k)
        self.timings = {"prompt_s": 0.0, "decode_s": 0.0}

        t0 = time.perf_counter()
        h_last = self.prefill(prompt[cached:], caches, mtp_cache, self.prefill_step, progress)
        if on_prefilled is not None:
            on_prefilled(caches, mtp_cache)
        t = pick(self.model.lm_head(h_last)[0, -1], temperature, rng)
        self.timings["prompt_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pend_h, pend_tok = h_last, [t]
        if self.auto is not None and draft:
            yield from auto_decode(
                self, t, pend_h, pend_tok, caches, mtp_cache, max_tokens, eos, temperature, rng
            )
            self.timings["decode_s"] = time.perf_counter() - t0
            return
        if greedy and self.k == 1 and draft and self.pipeline:
            yield from greedy_k1(self, t, pend_h, caches, mtp_cache, max_tokens, eos, t0)
            return
        produced = 0
        while True:
            yield t
            produced += 1
            if produced >= max_tokens or t in eos:
                break
            if not draft or stats.disabled_after is not None:
                # Drafting does not resume within a generation, so the MTP cache is left behind.
                _, logits = self.trunk([t], caches)
                t = pick(logits[0, -1], temperature, rng)
                continue
            a, drafts, bonus, h = self.draft_round(
                t, pend_h, pend_tok, caches, mtp_cache, temperature, rng
            )
            emitted, pend_h, pend_tok = self.settle(a, drafts, bonus, h, caches, mtp_cache)
            for d in emitted[:-1]:
                yield d
                produced += 1
                if produced >= max_tokens or d in eos:
                    self.timings["decode_s"] = time.perf_counter() - t0
                    return
            t = bonus
            if (
                stats.rounds >= self.probe_rounds
                and stats.disabled_after is None
                and stats.accepted_tokens / stats.rounds < self.min_accept
            ):
                stats.disabled_after = stats.rounds
        self.timings["decode_s"] = time.perf_counter() - t0
