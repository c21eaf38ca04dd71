"""`--mtp auto`: draft with the MTP layer only while it is measured to pay.

What is compared is what a user gets: tokens per wall-clock second of plain decoding and of
drafting, each timed over whole steps or rounds as the engine runs them at full speed (a
round's draft, verify, rollback and bookkeeping, pipelined as `--mtp on` runs it; a plain
step pipelined as mlx-lm's loop), from one token handed to the caller to the next
(mtp_auto_decode.py). Not a sum of per-step costs: those miss what pipelining hides and what
bookkeeping adds, and once said 1.01x where the server delivered 0.75x.

The figures are pairs: SPAN measured tokens of one mode next to SPAN of the other, so both
see the same load on the machine (on this 2-core machine shared by eight processes, 200-token
runs of the same mode vary 2x from one to the next; a pair lasts a tenth of a second). The
decision reads the last PAIRS_KEPT pairs `pooled`: each pair's drafting time in plain steps
of its own moment, all drafted tokens over all those steps (a span holds a few rounds, whose
refusals alone would swing its own ratio). A span may run over generations: short answers
add up (12- to 20-token answers: the fourth decides, after MEASURE pairs). The first step or round after a switch of mode is not counted (it pays the
switch: the MTP layer catching up on plain steps' rows, a pipelined step built ahead and
dropped); a measuring generation continues in its current mode while that mode's span is
short, so a pair costs two switches at most.

The decision, with hysteresis (`decide_on`): the pooled ratio must reach 1 + MARGIN to turn
drafting on, and fall below 1 - MARGIN to turn it off, so noise smaller than the margin cannot
flip it, and where it holds the wrong side it is wrong by less than the margin. Once decided,
a generation runs the chosen mode alone, at full speed; every `probe_every` tokens
(RECHECK_EVERY, doubling while the decision holds, up to RECHECK_EVERY_MAX) a re-check
measures one more pair and decides again.

AutoMTP keeps the figures per model, per process; with a `store` (mtp_auto_store.py) they are
saved beside the prompt cache after each decision and read back at start, so a restart does
not start over. A switch is logged once, with its figures; `status()` says what the engine
does and why, and `generation_status()` what one generation did (drafting is true exactly
when it drafted rounds).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

log = logging.getLogger("macserve.engine")

MODES = ("auto", "on", "off")
SPAN = 6  # measured tokens of one mode in a pair
MEASURE = 3  # pairs measured before the first decision
RECHECK_PAIRS = 1  # pairs measured by a re-check
PAIRS_KEPT = 9  # the decision reads the last this many pairs
MARGIN = 0.05  # drafting turns on at >= 1 + MARGIN x plain, off below 1 - MARGIN
RECHECK_EVERY = 256  # tokens between re-checks (the figures drift with context and load)
RECHECK_EVERY_MAX = 4096  # ... doubled after each re-check that confirms, up to this
ROUNDS_KEPT = 256  # draft rounds whose acceptance is kept
PROBE_EVERY = RECHECK_EVERY  # the name callers used


def tokens_per_round(acceptance: Sequence[float]) -> float:
    """Expected tokens a round emits: the trunk's own token plus each draft that survives."""
    out, p = 1.0, 1.0
    for a in acceptance:
        p *= a
        out += p
    return out


def ratio(pair: Sequence[float]) -> float:
    """Drafting's tokens per second over plain decoding's, from a pair
    (plain tokens, plain seconds, drafted tokens, drafting seconds)."""
    pn, ps, dn, ds = pair
    if pn <= 0 or dn <= 0 or ps <= 0 or ds <= 0:
        raise ValueError("a ratio needs tokens and time measured for both modes")
    return (dn / ds) / (pn / ps)


def pooled(pairs: Sequence[Sequence[float]]) -> float:
    """Drafting's tokens per second over plain's from several pairs: each pair's drafting
    time counted in plain steps of its own moment (so a pair measured under more load weighs
    as one under less), then all drafted tokens over all those steps (so a span's few rounds,
    refused or accepted by chance, weigh as the tokens they are, not as a ratio of their own)."""
    for p in pairs:
        ratio(p)
    return sum(p[2] for p in pairs) / sum(p[3] * p[0] / p[1] for p in pairs)


def decide_on(r: float, drafting: bool | None, margin: float = MARGIN) -> bool:
    """The auto rule, with hysteresis: turn on at r >= 1 + margin; once on, stay on while
    r >= 1 - margin. Undecided counts as off (plain decoding batches with other requests)."""
    return r >= (1 - margin if drafting else 1 + margin)


class AutoMTP:
    """The figures and the decision of `--mtp auto`, kept across requests (one per server).

    A decoder asks `plan()` what to run next, reports what it measured (`measured`, `round`,
    `tokens`); the scheduler asks `drafting` and `probe_due()` before it starts a drafter.
    `clock`: seconds, monotonic (a test passes its own, to make the costs what it wants)."""

    def __init__(
        self,
        k: int = 1,
        probe_every: int = RECHECK_EVERY,
        clock: Callable[[], float] = time.perf_counter,
        store=None,
    ):
        self.k = k
        self.clock = clock
        self.store = store
        self.probe_base = self.probe_every = probe_every
        self.pairs: deque[tuple[float, float, float, float]] = deque(maxlen=PAIRS_KEPT)
        self.span = {False: [0, 0.0], True: [0, 0.0]}  # the pair being measured
        self.rounds: deque[int] = deque(maxlen=ROUNDS_KEPT)  # drafts accepted per round
        self.drafting: bool | None = None  # None: not decided yet
        self.need = MEASURE  # pairs left to measure before deciding (0: none wanted)
        self.since_probe = 0  # tokens produced since the last decision
        self.decisions = 0
        self.last: dict | None = None  # the figures of the last decision
        if store is not None:
            self._restore(store.load())

    # -- what decoders report ------------------------------------------------------------------

    def measured(self, drafting: bool, tokens: int, seconds: float) -> None:
        """One step (plain) or round (drafting) of a measuring span: tokens and wall time."""
        span = self.span[drafting]
        span[0] += tokens
        span[1] += seconds
        (pn, ps), (dn, ds) = self.span[False], self.span[True]
        if pn >= SPAN and dn >= SPAN:
            self.span = {False: [0, 0.0], True: [0, 0.0]}
            if ps > 0 and ds > 0:
                self.pairs.append((pn, ps, dn, ds))
                if self.need > 0:
                    self.need -= 1
                    if self.need == 0:
                        self.decide()

    def round(self, accepted: int) -> None:
        self.rounds.append(accepted)

    def tokens(self, n: int) -> None:
        self.since_probe += n

    # -- the plan ------------------------------------------------------------------------------

    def probe_due(self) -> bool:
        """Whether the next generation measures (undecided, or a re-check is due)."""
        return self.need > 0 or self.since_probe >= self.probe_every

    def plan(self, current: bool | None = None) -> tuple[bool, int | None, bool]:
        """The next span: (drafting?, at most this many tokens (None: no bound), measured?).
        `current`: the mode the generation is in (a measuring span goes on in it while its
        part of the pair is short, saving a switch)."""
        if self.need == 0 and self.since_probe >= self.probe_every:
            self.need = RECHECK_PAIRS
        if self.need > 0:
            short = {m: SPAN - n for m, (n, _) in self.span.items()}
            if current is not None and short[current] > 0:
                mode = current
            else:
                mode = short[True] > short[False]
            return mode, short[mode], True
        return bool(self.drafting), max(1, self.probe_every - self.since_probe), False

    # -- the decision ----------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """Per draft position, accepted / checked over the kept rounds (position j is checked
        only when drafts 1..j-1 were accepted)."""
        out = []
        for j in range(self.k):
            checked = sum(1 for a in self.rounds if a >= j)
            out.append(sum(1 for a in self.rounds if a > j) / checked if checked else 0.0)
        return out

    def figures(self) -> dict | None:
        if not self.pairs:
            return None
        pn, ps, dn, ds = (sum(p[i] for p in self.pairs) for i in range(4))
        return {
            "speedup": pooled(self.pairs),
            "pairs": len(self.pairs),
            "plain_tps": pn / ps,
            "draft_tps": dn / ds,
            "acceptance": self.acceptance(),
            "rounds": len(self.rounds),
        }

    def decide(self) -> bool:
        """After a measurement: drafting on or off from the figures; a switch is logged once,
        and the figures are saved (when there is a store)."""
        self.since_probe = 0
        self.need = 0
        fig = self.figures()
        if fig is None:  # nothing measured (cannot happen through plan())
            return bool(self.drafting)
        on = decide_on(fig["speedup"], self.drafting)
        self.decisions += 1
        self.last = fig
        if on != self.drafting:
            log.info("MTP auto: drafting %s, %s", "on" if on else "off", describe(fig))
            self.probe_every = self.probe_base
        else:  # a settled decision is re-checked less often: a re-check runs the slower mode
            self.probe_every = min(2 * self.probe_every, max(RECHECK_EVERY_MAX, self.probe_base))
        self.drafting = on
        if self.store is not None:
            self.store.save(self.state())
        return on

    # -- what it says ------------------------------------------------------------------------------

    def why(self) -> str:
        if self.last is None:
            return f"auto: measuring ({len(self.pairs)} of {MEASURE} pairs of spans)"
        on = bool(self.drafting)
        rule = f"off below {1 - MARGIN:.2f}x" if on else f"on at >= {1 + MARGIN:.2f}x"
        return f"auto: drafting measured {self.last['speedup']:.2f}x plain ({rule})"

    def status(self) -> dict:
        """What /metrics says: the decision (drafting: whether it drafts now), why, figures."""
        st = {"mode": "auto", "drafting": bool(self.drafting), "why": self.why()}
        return {**st, **(self.last or {})}

    def generation_status(self, drafted_rounds: int, measured: bool) -> dict:
        """What one generation did: drafting is true exactly when it drafted rounds;
        `measured`: it ran measuring spans (both modes, or part of a pair)."""
        why = self.why()
        if measured and self.last is not None:
            why = why.replace("auto: ", "auto, measuring in this answer: ", 1)
        return {**self.status(), "drafting": drafted_rounds > 0, "why": why}

    # -- kept across restarts ------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "k": self.k,
            "drafting": self.drafting,
            "pairs": [list(p) for p in self.pairs],
            "rounds": list(self.rounds),
            "probe_every": self.probe_every,
            "saved_at": time.time(),
        }

    def _restore(self, st: dict | None) -> None:
        """Figures saved by an earlier process: the decision stands, re-checked on schedule.
        Anything malformed starts over (a wrong figure would be worse than none)."""
        if not st or st.get("k") != self.k or st.get("drafting") not in (True, False):
            return
        try:
            pairs = [tuple(float(x) for x in p) for p in st["pairs"]][-PAIRS_KEPT:]
            rounds = [int(a) for a in st["rounds"]][-ROUNDS_KEPT:]
            every = int(st["probe_every"])
            if not pairs or any(len(p) != 4 for p in pairs):
                raise ValueError("no pairs")
            for p in pairs:
                ratio(p)
        except (KeyError, TypeError, ValueError):
            log.warning("MTP auto: saved figures unreadable, measuring afresh")
            return
        self.pairs.extend(pairs)  # type: ignore[arg-type]
        self.rounds.extend(rounds)
        self.drafting, self.need = st["drafting"], 0
        self.probe_every = max(self.probe_base, min(every, max(RECHECK_EVERY_MAX, self.probe_base)))
        self.last = self.figures()
        log.info(
            "MTP auto: drafting %s, as measured before (%s)",
            "on" if self.drafting else "off",
            describe(self.last or {}),
        )


def describe(fig: dict) -> str:
    acc = ", ".join(f"{a:.2f}" for a in fig["acceptance"])
    return (
        f"measured {fig['speedup']:.2f}x plain ({fig['pairs']} pairs; drafting "
        f"{fig['draft_tps']:.1f} tok/s, plain {fig['plain_tps']:.1f} tok/s; acceptance {acc} "
        f"over {fig['rounds']} rounds)"
    )


def drafting_mode(bundle, options) -> tuple[str, str]:
    """(on | auto | off, why) for a model and its EngineOptions."""
    if options.mtp == "off" or options.mtp_k == 0:
        return "off", "--mtp off" if options.mtp == "off" else "--mtp-k 0"
    if bundle.mtp_problem() is not None:  # the whole reason is said once, at load (load_note)
        declared = bool(bundle.config.get("num_nextn_predict_layers"))
        return "off", "the model's MTP weights are missing" if declared else "no MTP layer"
    return options.mtp, f"--mtp {options.mtp}"


def may_draft_with(top_p: float, plain_only: bool, temperature: float, seeded: bool) -> bool:
    """Whether a request may draft at all. `seeded`: a sampled request with the client's own
    seed under --mtp auto decodes plainly: drafting draws its samples differently and auto's
    choice follows timings, so the same seed would not give the same answer. (--mtp on drafts
    it when it runs alone: the same seed gives the same answer alone, not batched.)"""
    return (top_p >= 1.0 or top_p <= 0) and not plain_only and not (temperature > 0 and seeded)


def mtp_status(mode: tuple[str, str], may_draft: bool) -> dict:
    """A request's MTP status when no AutoMTP speaks for it (on, off, or not draftable)."""
    kind, why = mode
    if kind == "off":
        return {"mode": kind, "drafting": False, "why": why}
    if not may_draft:
        why = "this request decodes plainly (top_p < 1, top_k, a grammar, logprobs or a seed)"
        return {"mode": kind, "drafting": False, "why": why}
    return {"mode": kind, "drafting": kind == "on", "why": why}


def load_note(bundle, options) -> str | None:
    """The one line to say at load when drafting was asked for (--mtp on, or auto on a model
    whose config declares MTP layers) and cannot happen; loads the MTP layer otherwise."""
    if not options.drafts:
        return None
    problem = bundle.mtp_problem()
    declared = bool(bundle.config.get("num_nextn_predict_layers"))
    if problem is not None and (declared or options.mtp == "on"):
        return f"{problem}; running without MTP drafting"
    return None
