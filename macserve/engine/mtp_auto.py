"""`--mtp auto`: draft with the MTP layer only while it is measured to pay.

Drafting pays when the tokens a round yields are worth more plain steps than the round costs:

    tokens per round = 1 + a1 + a1*a2 + ... + a1*...*ak   (a_j: acceptance of draft j, given
                                                           drafts 1..j-1 were accepted)
    speedup          = tokens per round * plain_s / (k * draft_s + verify_s)

with `draft_s` one MTP-layer step, `verify_s` one trunk forward over k + 1 tokens and
`plain_s` one plain decode step, all timed the same way (each evaluated on its own) on the
engine's own requests. `speedup` is a pure function of those figures (tested with figures);
`AutoMTP` keeps them: every PROBE_EVERY tokens (doubling while the decision holds, up to
PROBE_EVERY_MAX) a generation runs PROBE_STEPS timed plain steps
and as many timed draft rounds, alternated, then drafting is on while the median figures give a
speedup of at least 1.0 and off below. Acceptance is counted on every drafted round. A switch
is logged once, with its figures; `status()` says what the engine does and why.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence

log = logging.getLogger("macserve.engine")

MODES = ("auto", "on", "off")
PROBE_EVERY = 256  # tokens between probes (the figures drift with context and machine load)
PROBE_EVERY_MAX = 4096  # ... doubled after each probe that confirms the decision, up to this
PROBE_STEPS = 8  # timed plain steps, and as many timed draft rounds, per probe (alternated)
WINDOW = 48  # timings kept per figure (their median is used)
ROUNDS_KEPT = 256  # draft rounds whose acceptance is kept


def tokens_per_round(acceptance: Sequence[float]) -> float:
    """Expected tokens a round emits: the trunk's own token plus each draft that survives."""
    out, p = 1.0, 1.0
    for a in acceptance:
        p *= a
        out += p
    return out


def speedup(acceptance: Sequence[float], draft_s: float, verify_s: float, plain_s: float) -> float:
    """Drafting's tokens per second over plain decoding's, from measured figures."""
    k = len(acceptance)
    cost = k * draft_s + verify_s
    if k == 0 or cost <= 0 or plain_s <= 0:
        raise ValueError("speedup needs k >= 1 acceptances and positive costs")
    return tokens_per_round(acceptance) * plain_s / cost


def should_draft(
    acceptance: Sequence[float], draft_s: float, verify_s: float, plain_s: float
) -> bool:
    """The auto rule: draft while the measured speedup is at least 1.0."""
    return speedup(acceptance, draft_s, verify_s, plain_s) >= 1.0


class AutoMTP:
    """The figures and the decision of `--mtp auto`, kept across requests (one per server).

    A decoder reports into it (`plain`, `draft`, `verify`, `round`, `tokens`) and asks
    `probe_due()` and `drafting`; the scheduler asks the same before it starts a drafter."""

    def __init__(self, k: int = 1, probe_every: int = PROBE_EVERY):
        self.k = k
        self.probe_base = self.probe_every = probe_every
        self.plain_s: deque[float] = deque(maxlen=WINDOW)
        self.draft_s: deque[float] = deque(maxlen=WINDOW)
        self.verify_s: deque[float] = deque(maxlen=WINDOW)
        self.rounds: deque[int] = deque(maxlen=ROUNDS_KEPT)  # drafts accepted per round
        self.drafting: bool | None = None  # None: not measured yet (the first request probes)
        self.since_probe = 0  # tokens produced since the last decision
        self.decisions = 0
        self.last: dict | None = None  # the figures of the last decision

    # -- what decoders report ------------------------------------------------------------------

    def plain(self, seconds: float) -> None:
        self.plain_s.append(seconds)

    def draft(self, seconds: float) -> None:
        self.draft_s.append(seconds)

    def verify(self, seconds: float) -> None:
        self.verify_s.append(seconds)

    def round(self, accepted: int) -> None:
        self.rounds.append(accepted)

    def tokens(self, n: int) -> None:
        self.since_probe += n

    # -- the decision ----------------------------------------------------------------------------

    def probe_due(self) -> bool:
        return self.drafting is None or self.since_probe >= self.probe_every

    def acceptance(self) -> list[float]:
        """Per draft position, accepted / checked over the kept rounds (position j is checked
        only when drafts 1..j-1 were accepted)."""
        out = []
        for j in range(self.k):
            checked = sum(1 for a in self.rounds if a >= j)
            out.append(sum(1 for a in self.rounds if a > j) / checked if checked else 0.0)
        return out

    def figures(self) -> dict | None:
        if not (self.plain_s and self.draft_s and self.verify_s and self.rounds):
            return None
        acc = self.acceptance()
        fig = {
            "acceptance": acc,
            "draft_ms": statistics.median(self.draft_s) * 1e3,
            "verify_ms": statistics.median(self.verify_s) * 1e3,
            "plain_ms": statistics.median(self.plain_s) * 1e3,
            "rounds": len(self.rounds),
        }
        fig["speedup"] = speedup(acc, fig["draft_ms"], fig["verify_ms"], fig["plain_ms"])
        return fig

    def decide(self) -> bool:
        """After a probe: drafting on or off from the figures; a switch is logged once."""
        self.since_probe = 0
        fig = self.figures()
        if fig is None:  # a probe cut short (the generation ended): keep what we had
            return bool(self.drafting)
        on = fig["speedup"] >= 1.0
        self.decisions += 1
        self.last = fig
        if on != self.drafting:
            log.info("MTP auto: drafting %s, %s", "on" if on else "off", describe(fig))
            self.probe_every = self.probe_base
        else:  # a settled decision is probed less often: a probe costs its slower steps
            self.probe_every = min(2 * self.probe_every, max(PROBE_EVERY_MAX, self.probe_base))
        self.drafting = on
        return on

    def status(self) -> dict:
        """What a response or /metrics says: drafting or not, why, and the figures."""
        if self.last is None:
            return {"mode": "auto", "drafting": False, "why": "auto: not measured yet"}
        on = bool(self.drafting)
        why = f"auto: measured {self.last['speedup']:.2f}x {'>=' if on else '<'} 1.0"
        return {"mode": "auto", "drafting": on, "why": why, **self.last}


def describe(fig: dict) -> str:
    acc = ", ".join(f"{a:.2f}" for a in fig["acceptance"])
    return (
        f"measured speedup {fig['speedup']:.2f}x (acceptance {acc}; draft {fig['draft_ms']:.2f} "
        f"ms, verify {fig['verify_ms']:.2f} ms, plain step {fig['plain_ms']:.2f} ms; "
        f"{fig['rounds']} rounds)"
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
