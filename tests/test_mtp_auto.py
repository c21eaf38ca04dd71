"""`--mtp auto`: drafting only where it pays, decided on what a user gets.

The rule is tested with chosen figures: pairs of measured spans (tokens and seconds of each
mode), their pooled ratio, the margin and hysteresis, and the figures kept beside the prompt
cache across a restart. On the demo model the engine's real decoding loops run with the costs
made what the test wants through AutoMTP's clock (each trunk or MTP-layer call advances it
by a chosen cost, whatever the machine's load): twenty answers of 12 to 20 tokens decide
within the first four, off where drafting is slow and on where it is fast, and each answer
says it drafted exactly when it did. Which way the real timings go depends on this machine
and its load, so that is not asserted (docs/engine.md has the figures). A folder whose config
declares an MTP layer its weights lack: one line, no drafting.
"""

import json
import logging
import shutil
import subprocess
import sys

import httpx
import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step

from macserve.chat import mtp_text
from macserve.cli import main
from macserve.engine import mtp_auto
from macserve.engine.mtp_auto import (
    MEASURE,
    SPAN,
    AutoMTP,
    decide_on,
    pooled,
    ratio,
    tokens_per_round,
)
from macserve.engine.mtp_auto_store import AutoStore, store_key
from macserve.engine.mtp_decode import MTPDecoder

from .conftest import REPO, TINY_MODEL
from .serverproc import serve

PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "HAMLET.\nTo be, or not to be",
]


# ---- the rule, from figures ----------------------------------------------------------------------


def _pair(auto, plain_tps, draft_tps, n=SPAN):
    """One measured pair: n tokens of each mode at the given tokens per second."""
    auto.measured(False, n, n / plain_tps)
    auto.measured(True, n, n / draft_tps)


def test_the_ratio_is_tokens_per_second_and_the_rule_has_a_margin_both_ways():
    assert tokens_per_round([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert ratio((10, 0.1, 12, 0.2)) == pytest.approx(0.6)  # 60 tok/s drafting, 100 plain
    with pytest.raises(ValueError):
        ratio((0, 0.1, 12, 0.2))
    m = mtp_auto.MARGIN
    # undecided or off: on only past 1 + margin; on: off only below 1 - margin
    assert not decide_on(1 + m / 2, None) and not decide_on(1 + m / 2, False)
    assert decide_on(1 + m, None) and decide_on(1 + m, False)
    assert decide_on(1 - m / 2, True) and not decide_on(1 - 2 * m, True)


def test_a_decision_after_measure_pairs_and_noise_does_not_flip_it(caplog):
    caplog.set_level(logging.INFO, logger="macserve.engine")
    auto = AutoMTP(k=1, probe_every=100)
    assert auto.probe_due() and auto.status()["why"].startswith("auto: measuring (0 of")
    for _ in range(MEASURE):
        assert auto.drafting is None
        _pair(auto, 100, 130)
    assert auto.drafting is True and not auto.probe_due() and auto.decisions == 1
    st = auto.status()
    assert st["speedup"] == pytest.approx(1.3) and st["pairs"] == MEASURE
    assert st["why"] == "auto: drafting measured 1.30x plain (off below 0.95x)"
    # Each pair's drafting time is counted in plain steps of its own moment: a pair measured
    # under twice the load (both modes at half speed) says what the others say.
    assert pooled([(6, 0.06, 6, 0.05), (6, 0.12, 6, 0.10)]) == pytest.approx(1.2)
    # A re-check is due after probe_every tokens; it measures one pair, in the mode in use.
    auto.tokens(100)
    assert auto.probe_due() and auto.plan(current=True) == (True, SPAN, True)
    _pair(auto, 100, 80)  # a burst of load on the drafting span: it moves the figure, no flip
    assert auto.drafting is True and 0.95 < auto.last["speedup"] < 1.3
    assert auto.probe_every == 200  # confirmed: re-checked half as often
    for _ in range(2):  # drafting really got slower: the figure follows, and it switches off
        auto.tokens(auto.probe_every)
        assert auto.plan(current=True)[2]
        _pair(auto, 100, 60)
    assert auto.drafting is False and auto.probe_every == 100  # a switch: the base rate again
    lines = [r.getMessage() for r in caplog.records if "MTP auto: drafting" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("MTP auto: drafting on, measured 1.30x")
    assert lines[1].startswith("MTP auto: drafting off, measured 0.87x plain (6 pairs")


def test_figures_are_kept_beside_the_prompt_cache_across_a_restart(tmp_path, caplog):
    store = AutoStore(tmp_path, store_key(TINY_MODEL, "bf16", 1))
    other = AutoStore(tmp_path, store_key(TINY_MODEL, "int2", 1))
    auto = AutoMTP(k=1, store=store)
    for _ in range(MEASURE):
        _pair(auto, 100, 70)
    AutoMTP(k=1, store=other).decide()  # nothing measured: nothing saved for it
    saved = json.loads((tmp_path / "mtp-auto.json").read_text())
    assert list(saved) == [store.key] and saved[store.key]["drafting"] is False
    again = AutoMTP(k=1, store=store)  # a restart: decided, no new measurement wanted
    assert again.drafting is False and not again.probe_due()
    assert again.status() == {**auto.status(), "why": auto.why()}
    assert AutoMTP(k=2, store=store).drafting is None  # another draft length: its own figures
    (tmp_path / "mtp-auto.json").write_text('{"' + store.key + '": {"k": 1, "drafting": tru')
    with caplog.at_level(logging.WARNING, logger="macserve.engine"):
        fresh = AutoMTP(k=1, store=store)
    assert fresh.drafting is None and fresh.probe_due()  # measured afresh, said once
    assert len([r for r in caplog.records if "unreadable" in r.getMessage()]) == 1


# ---- on the demo model ---------------------------------------------------------------------------


def _plain(b, ids, n):
    steps = generate_step(mx.array(ids), b.model, max_tokens=n, prompt_cache=b.caches())
    return [int(t) for (t, _), _ in zip(steps, range(n))]


class Clock:
    """AutoMTP's clock, advanced by the model calls the decoder makes, at chosen costs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Costed:
    """A module whose every call advances `clock` by `cost(tokens)` (ms); the rest delegates."""

    def __init__(self, inner, clock, cost, model=None):
        self.inner, self.clock, self.cost = inner, clock, cost
        if model is not None:
            self.model = model

    def __call__(self, *args, **kw):
        self.clock.now += self.cost(args[0].shape[1]) / 1e3
        return self.inner(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _costed(bundle, trunk_ms, mtp_ms, clock):
    """The demo model whose trunk forward costs trunk_ms(tokens) and MTP layer mtp_ms."""
    trunk = Costed(bundle.model.model, clock, trunk_ms)
    model = Costed(bundle.model, clock, trunk_ms, model=trunk)
    mtp = Costed(bundle.mtp(), clock, lambda n: mtp_ms)
    return model, mtp


@pytest.mark.model
@pytest.mark.parametrize(
    "trunk_ms, mtp_ms, on",
    [
        # A plain step costs 10 ms. A round, 23 ms (5 more to verify two tokens, 8 for the
        # MTP layer), twice that when its draft is refused (the next one, built ahead, is
        # dropped): about 0.5x plain at this text's acceptance (0.78).
        (lambda n: 10 + 5 * (n - 1), 8, False),
        # Verifying two tokens costs what one does, the MTP layer 0.5 ms: about 1.4x plain.
        (lambda n: 10, 0.5, True),
    ],
    ids=["slow-drafting", "fast-drafting"],
)
def test_twenty_short_answers_decide_within_the_first_few(bundle, trunk_ms, mtp_ms, on):
    clock = Clock()
    auto = AutoMTP(k=1, clock=clock)
    model, mtp = _costed(bundle, trunk_ms, mtp_ms, clock)
    dec = MTPDecoder(model, mtp, k=1, auto=auto)
    text = "HAMLET.\nTo be, or not to be, that is the question:\n"
    decided_at, seen = None, []
    for i in range(20):
        n = 12 + (i * 5) % 9  # 12 to 20 tokens
        prompt = bundle.tokenizer.encode(text * (1 + i % 4), add_special_tokens=False)
        out = list(dec.generate(prompt, n, caches=bundle.caches()))
        assert len(out) == n or out[-1] in bundle.eos_ids
        st = dec.auto_status()
        assert st["drafting"] == (dec.stats.rounds > 0)  # says what was done
        assert st["mode"] == "auto" and (auto.last is None) == ("measuring (" in st["why"])
        assert auto.drafting in (None, on)  # once decided, never the slower side
        if decided_at is None and auto.drafting is not None:
            decided_at = i
        elif decided_at is not None and not dec.auto_measured:
            seen.append(dec.stats.rounds > 0)  # a decided answer runs the chosen mode alone
    assert decided_at is not None and decided_at <= 3, decided_at
    assert seen and set(seen) == {on}
    assert (auto.last["speedup"] >= 1.05) == on and auto.decisions >= 1


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 2])
def test_switching_spans_keeps_the_models_greedy_text(bundle, k):
    """Re-checks every 24 tokens: one generation switches between plain steps and draft
    rounds (leaving pipelined ones mid-flight) many times; the text stays the model's own."""
    auto = AutoMTP(k=k, probe_every=24)
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=k, auto=auto)
    for text in PROMPTS:
        ids = bundle.tokenizer.encode(text, add_special_tokens=False)
        assert list(dec.generate(ids, 90, caches=bundle.caches())) == _plain(bundle, ids, 90)
    assert auto.decisions >= 2  # decided, then re-checked
    fig = auto.last
    assert fig["pairs"] >= MEASURE and len(fig["acceptance"]) == k
    assert all(0 <= a <= 1 for a in fig["acceptance"]) and fig["draft_tps"] > 0
    assert auto.drafting == decide_on(fig["speedup"], auto.drafting) or auto.decisions > 1
    print(auto.status())


@pytest.mark.model
@pytest.mark.parametrize("drafting", [False, True])
def test_each_decided_path_gives_the_models_greedy_text(bundle, drafting):
    """A decision already taken and no re-check due: plain steps (off) or draft rounds (on)
    for the whole generation."""
    auto = AutoMTP(k=1, probe_every=10**6)
    auto.drafting, auto.need = drafting, 0
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
    ids = bundle.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    assert list(dec.generate(ids, 80, caches=bundle.caches())) == _plain(bundle, ids, 80)
    assert (dec.stats.rounds > 0) == drafting and auto.decisions == 0
    assert dec.auto_status()["drafting"] == drafting


@pytest.mark.model
def test_sampled_generation_under_auto(bundle):
    auto = AutoMTP(k=1, probe_every=16)
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
    ids = bundle.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    out = list(dec.generate(ids, 60, caches=bundle.caches(), temperature=1.0, seed=3))
    assert len(out) == 60 or out[-1] in bundle.eos_ids
    assert auto.last is not None and auto.decisions >= 1
    for drafting in (False, True):  # decided, no re-check due: sampled plainly, or drafted
        auto = AutoMTP(k=1, probe_every=10**6)
        auto.drafting, auto.need = drafting, 0
        dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
        out = list(dec.generate(ids, 30, caches=bundle.caches(), temperature=1.0, seed=3))
        assert len(out) == 30 or out[-1] in bundle.eos_ids
        assert (dec.stats.rounds > 0) == drafting


# ---- served -------------------------------------------------------------------------------------


def _ask(s, n=48, content="Tell me of the king.", **extra):
    r = httpx.post(
        s.url + "/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": n,
            "temperature": 0,
            **extra,
        },
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.e2e
def test_serve_defaults_to_auto_and_says_what_it_did_in_timings_metrics_and_chat(tmp_path):
    """Short answers: each says it drafted exactly when it did (draft_n), auto decides within
    the first four, and the decision is kept beside the prompt cache for the next start."""
    pc = tmp_path / "pc"
    with serve(tmp_path, "--ctx", "512", "--prompt-cache-dir", str(pc)) as s:
        decided = None
        for i in range(6):
            t = _ask(s, n=16, content=f"Tell me of the king, {i}.")["timings"]
            m = t["mtp"]
            assert m["mode"] == "auto" and m["drafting"] == (t["draft_n"] > 0), t
            if decided is None and "measuring (" not in m["why"]:
                decided = i
        assert decided is not None and decided <= 3
        assert m["why"].startswith("auto") and f"{m['speedup']:.2f}x plain (" in m["why"]
        off = _ask(s, mtp="off")["timings"]
        assert off["draft_n"] == 0 and off["mtp"]["why"] == "the request asked for mtp off"
        on = _ask(s, mtp="on")["timings"]
        assert on["draft_n"] > 0 and on["mtp"]["drafting"] is True
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "mtp": "yes"},
        )
        assert r.status_code == 400 and "mtp" in r.text
        r = CliRunner().invoke(main, ["chat", s.url, "Good morrow.", "--max-tokens", "12"])
        assert r.exit_code == 0, r.output
        said = [line for line in r.stderr.splitlines() if "MTP " in line]
        drafted = "draft acceptance" in said[-1]
        assert ("MTP on (auto" in said[-1]) == drafted and ("MTP off (auto" in said[-1]) != drafted
        assert said[-1].count(mtp_text({"drafting": drafted, "why": "x"})[:7]) == 1
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert "macserve_mtp_measured_speedup" in metrics
    # The decision and its figures, beside the prompt cache for the next start.
    (saved,) = json.loads((pc / "mtp-auto.json").read_text()).values()
    assert f"macserve_mtp_drafting {float(saved['drafting'])}" in metrics
    assert len(saved["pairs"]) >= MEASURE
    log = s.log.read_text()
    switches = [line for line in log.splitlines() if "MTP auto: drafting" in line]
    assert 1 <= len(switches) and "measured" in switches[0]


@pytest.fixture
def no_mtp_weights(tmp_path):
    """The demo model as a conversion that dropped the MTP tensors (and their index rows)."""
    d = tmp_path / "no-mtp"
    d.mkdir()
    for f in TINY_MODEL.iterdir():
        if f.name not in ("mtp.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, d / f.name)
    index = json.loads((TINY_MODEL / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "mtp.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.e2e
def test_missing_mtp_weights_are_one_line_and_no_drafting(no_mtp_weights, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "macserve", "generate", str(no_mtp_weights), "ROMEO.\n"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.splitlines() if "declares 1 MTP layer" in line]
    assert said == [
        "no-mtp: config.json declares 1 MTP layer(s) (num_nextn_predict_layers) but its "
        "safetensors hold no model.layers.4.* tensors (a conversion that dropped them?); "
        "running without MTP drafting"
    ]
    assert "Traceback" not in p.stderr
    assert "64 tokens" in p.stderr and "MTP off (the model's MTP weights are missing)" in p.stderr
    with serve(tmp_path, "--ctx", "512", "--mtp", "on", model=no_mtp_weights) as s:
        t = _ask(s, n=16)["timings"]
        assert t["draft_n"] == 0 and t["mtp"]["drafting"] is False
        assert t["mtp"]["why"] == "the model's MTP weights are missing"
    log = s.log.read_text()
    assert log.count("declares 1 MTP layer") == 1 and "Traceback" not in log
