"""`--mtp auto`: drafting only where it pays.

The decision is a pure function of measured figures (acceptance, draft, verify and plain step
costs), tested here with chosen figures on both sides of 1.0x. On the demo model the engine
measures real figures on its own generations and decides as that function says; which way it
goes depends on this machine and its load, so that is not asserted (docs/engine.md has the
figures). A folder whose config declares an MTP layer its weights lack: one line, no drafting.
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

from macserve.cli import main
from macserve.engine.mtp_auto import (
    PROBE_STEPS,
    WINDOW,
    AutoMTP,
    should_draft,
    speedup,
    tokens_per_round,
)
from macserve.engine.mtp_decode import MTPDecoder

from .conftest import REPO, TINY_MODEL
from .serverproc import serve

PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "HAMLET.\nTo be, or not to be",
]


def _args(fig: dict) -> tuple:
    return fig["acceptance"], fig["draft_ms"], fig["verify_ms"], fig["plain_ms"]


# ---- the rule, from figures ----------------------------------------------------------------------


def test_speedup_is_tokens_per_round_over_the_round_cost_in_plain_steps():
    assert tokens_per_round([0.8]) == pytest.approx(1.8)
    assert tokens_per_round([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    # The demo on a CPU: a round (draft + 2-token verify) costs about 1.8 plain steps.
    assert speedup([0.77], 3.0, 15.4, 10.0) == pytest.approx(1.77 * 10 / 18.4)
    assert not should_draft([0.77], 3.0, 15.4, 10.0)
    # A memory-bound step: verifying 2 tokens costs about one step, the layer a little.
    assert should_draft([0.77], 0.5, 10.5, 10.0)
    # k = 2 pays for two drafts; exactly 1.0x counts as paying.
    assert speedup([0.8, 0.5], 1.0, 10.0, 10.0) == pytest.approx(2.2 * 10 / 12)
    assert should_draft([0.5], 2.5, 12.5, 10.0)
    with pytest.raises(ValueError):
        speedup([], 1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        speedup([0.5], 1.0, 1.0, 0.0)


def _feed(auto, plain_s, draft_s, verify_s, accepted):
    for i in range(WINDOW):
        auto.plain(plain_s)
        auto.draft(draft_s)
        auto.verify(verify_s)
        auto.round(accepted[i % len(accepted)])


def test_auto_turns_off_where_slower_and_on_where_faster_logging_each_switch_once(caplog):
    caplog.set_level(logging.INFO, logger="macserve.engine")
    auto = AutoMTP(k=1, probe_every=100)
    assert auto.probe_due() and auto.status()["why"] == "auto: not measured yet"
    _feed(auto, 0.010, 0.003, 0.0154, [1, 1, 1, 0])  # acceptance 0.75: 0.95x
    assert auto.decide() is False and not auto.probe_due()
    st = auto.status()
    assert st["drafting"] is False and st["speedup"] == pytest.approx(1.75 * 10 / 18.4)
    assert st["why"] == "auto: measured 0.95x < 1.0"
    auto.tokens(99)
    assert not auto.probe_due()
    auto.tokens(1)
    assert auto.probe_due()
    assert auto.decide() is False  # the same figures: no second line, and probes half as often
    assert auto.probe_every == 200
    _feed(auto, 0.010, 0.0005, 0.0105, [1, 1, 1, 0])  # the same acceptance, cheap rounds: 1.6x
    assert auto.decide() is True and auto.status()["drafting"] is True
    assert auto.probe_every == 100  # a switch: probed at the base rate again
    lines = [r.getMessage() for r in caplog.records if "MTP auto" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("MTP auto: drafting off, measured speedup 0.95x (acceptance 0.75")
    assert lines[1].startswith("MTP auto: drafting on, measured speedup 1.59x")


def test_a_probe_cut_short_keeps_the_decision():
    auto = AutoMTP(k=1)
    auto.plain(0.01)  # no rounds yet: no figures
    assert auto.decide() is False and auto.last is None and auto.probe_due()


# ---- on the demo model -------------------------------------------------------------------------


def _plain(b, ids, n):
    steps = generate_step(mx.array(ids), b.model, max_tokens=n, prompt_cache=b.caches())
    return [int(t) for (t, _), _ in zip(steps, range(n))]


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 2])
def test_the_demo_model_decides_by_its_own_measured_figures(bundle, k):
    """Probes from every 24 tokens, so one generation switches path several times: the greedy text
    stays the model's own, the figures are real timings, and the decision is the rule's."""
    auto = AutoMTP(k=k, probe_every=24)
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=k, auto=auto)
    for text in PROMPTS:
        ids = bundle.tokenizer.encode(text, add_special_tokens=False)
        assert list(dec.generate(ids, 90, caches=bundle.caches())) == _plain(bundle, ids, 90)
    assert auto.decisions >= 2  # probed again after its first decision
    fig = auto.last
    assert fig["rounds"] >= PROBE_STEPS and len(fig["acceptance"]) == k
    assert all(0 <= a <= 1 for a in fig["acceptance"])
    assert fig["draft_ms"] > 0 and fig["verify_ms"] > 0 and fig["plain_ms"] > 0
    assert auto.drafting == should_draft(*_args(fig))
    assert fig["speedup"] == pytest.approx(speedup(*_args(fig)))
    print(auto.status())


@pytest.mark.model
@pytest.mark.parametrize("drafting", [False, True])
def test_each_decided_path_gives_the_models_greedy_text(bundle, drafting):
    """A decision already taken and no probe due: the pipelined plain loop (off) or draft
    rounds (on) for the whole generation (the demo test above switches between them)."""
    auto = AutoMTP(k=1, probe_every=10**6)
    auto.drafting = drafting
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
    ids = bundle.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    assert list(dec.generate(ids, 80, caches=bundle.caches())) == _plain(bundle, ids, 80)
    assert (dec.stats.rounds > 0) == drafting and auto.decisions == 0


@pytest.mark.model
def test_sampled_generation_under_auto(bundle):
    auto = AutoMTP(k=1, probe_every=16)
    dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
    ids = bundle.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    out = list(dec.generate(ids, 60, caches=bundle.caches(), temperature=1.0, seed=3))
    assert len(out) == 60 or out[-1] in bundle.eos_ids
    assert auto.last is not None and auto.drafting == should_draft(*_args(auto.last))
    for drafting in (False, True):  # decided, no probe due: sampled plainly, or drafted
        auto = AutoMTP(k=1, probe_every=10**6)
        auto.drafting = drafting
        dec = MTPDecoder(bundle.model, bundle.mtp(), k=1, auto=auto)
        out = list(dec.generate(ids, 30, caches=bundle.caches(), temperature=1.0, seed=3))
        assert len(out) == 30 or out[-1] in bundle.eos_ids
        assert (dec.stats.rounds > 0) == drafting


# ---- served -------------------------------------------------------------------------------------


def _ask(s, n=48, **extra):
    r = httpx.post(
        s.url + "/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": "Tell me of the king."}],
            "max_tokens": n,
            "temperature": 0,
            **extra,
        },
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.e2e
def test_serve_defaults_to_auto_and_says_why_in_timings_metrics_and_chat(tmp_path):
    with serve(tmp_path, "--ctx", "512") as s:
        first = _ask(s)["timings"]
        assert first["mtp"]["mode"] == "auto" and first["draft_n"] > 0  # the first one probes
        m = first["mtp"]
        assert m["drafting"] == should_draft(*_args(m))
        assert (
            m["why"] == f"auto: measured {m['speedup']:.2f}x {'>=' if m['drafting'] else '<'} 1.0"
        )
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert "macserve_mtp_measured_speedup" in metrics
        assert f"macserve_mtp_drafting {float(m['drafting'])}" in metrics
        off = _ask(s, mtp="off")["timings"]
        assert off["draft_n"] == 0 and off["mtp"]["why"] == "the request asked for mtp off"
        on = _ask(s, mtp="on")["timings"]
        assert on["draft_n"] > 0 and on["mtp"]["drafting"] is True
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "mtp": "yes"},
        )
        assert r.status_code == 400 and "mtp" in r.text
        r = CliRunner().invoke(
            main, ["chat", s.url, "Good morrow.", "--max-tokens", "8", "--mtp", "off"]
        )
        assert r.exit_code == 0, r.output
        assert "MTP off (the request asked for mtp off)" in r.stderr
    log = s.log.read_text()
    switches = [line for line in log.splitlines() if "MTP auto: drafting" in line]
    assert 1 <= len(switches) and "measured speedup" in switches[0]


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
