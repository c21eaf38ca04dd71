"""`bench kv`'s free-generation columns (engine/bench/generation.py) on the demo model: what
they count, that bf16 against itself diverges nowhere, and that a window setting moves them."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.cli.engine import held_out_chats
from macserve.engine.bench import generation
from macserve.engine.bench.kv import NO_CODES, WINDOWS
from macserve.engine.caches import shipped_rotation
from macserve.engine.calibration import caches_for
from macserve.int2_format import BF16_LATENT, INT2

from .conftest import TINY_MODEL


def test_first_divergence_counts_an_early_end_and_summary_counts_ends():
    assert generation.first_divergence([3, 4, 5], [3, 4, 5]) is None
    assert generation.first_divergence([3, 4, 5], [3, 9, 5]) == 1
    assert generation.first_divergence([3, 4, 5], [3, 4]) == 2  # stopped where bf16 went on
    ref, gens = [[3, 4, 1], [3, 4, 5, 6]], [[3, 4, 1], [3, 7, 5, 6]]
    s = generation.summary(ref, gens, max_tokens=4, eos={1})
    assert s["gen_first_divergence_per_prompt"] == [None, 1]
    assert s["gen_identical"] == 0.5 and s["gen_end_of_turn"] == 0.5 and s["gen_length"] == 3.5
    assert s["gen_first_divergence"] == (3 + 1) / 2  # the identical prompt counts its length


@pytest.mark.model
def test_bf16_against_itself_diverges_nowhere_and_the_window_moves_the_divergence(bundle):
    """Prompts of 128 tokens, 32 generated: a sink 64 + recent 256 window holds every token in
    bf16, no window holds none. Bounds with margin: measured, the window-less cache diverges
    at 0-2 tokens, the windowed one not at all on 2 of 3 prompts (at 64 tokens)."""
    m, eos = bundle.model, bundle.eos_ids
    cal = bundle.calibration(shipped_rotation(TINY_MODEL))
    prompts = held_out_chats(bundle.tokenizer, None, 2, 128)
    assert [len(p) for p in prompts] == [128, 128]

    def int2(sink, recent):
        return lambda: caches_for(m, replace(INT2, sink=sink, recent=recent), cal, "upproj")

    makers = {
        "bf16": lambda: caches_for(m, BF16_LATENT),
        "bf16 again": lambda: caches_for(m, BF16_LATENT),
        "no windows": int2(0, 0),
        "windows": int2(64, 256),
    }
    res = generation.run(m, makers, prompts, 32, eos)
    for name in ("bf16", "bf16 again"):
        r = res[name]
        assert r["gen_first_divergence_per_prompt"] == [None, None] and r["gen_identical"] == 1.0
        assert r["gen_first_divergence"] == r["gen_length"] or r["gen_end_of_turn"] > 0
        assert 1 <= r["gen_length"] <= 32 and 0.0 <= r["gen_end_of_turn"] <= 1.0

    def divergences(name):
        return [32 if d is None else d for d in res[name]["gen_first_divergence_per_prompt"]]

    assert max(divergences("no windows")) < min(divergences("windows"))
    assert res["no windows"]["gen_identical"] < 1.0


@pytest.mark.model
def test_bench_kv_windows_set_has_the_generation_columns():
    args = ["bench", "kv", str(TINY_MODEL), "--variants", "windows", "--windows", "1"]
    args += ["--seq-len", "128", "--gen-tokens", "4", "--contexts", "512", "--gen-prompts", "1"]
    args += ["--gen-prompt-tokens", "64", "--gen-max-tokens", "8", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout[r.stdout.index("[") :])
    assert [(row["sink"], row["recent"]) for row in rows[1:]] == WINDOWS + [(64, NO_CODES)]
    assert [row["default"] for row in rows[1:-1]] == [
        w == (INT2.sink, INT2.recent) for w in WINDOWS
    ]
    for row in rows:
        assert row["gen_prompts"] == 1 and row["gen_max_tokens"] == 8
        assert 1 <= row["gen_length"] <= 8 and 0 <= row["gen_first_divergence"] <= 8
    assert rows[0]["variant"] == "bf16 latent" and rows[0]["gen_identical"] == 1.0


@pytest.mark.model
def test_bench_kv_refuses_generation_longer_than_the_context():
    args = ["bench", "kv", str(TINY_MODEL), "--windows", "1", "--seq-len", "64"]
    args += ["--gen-prompts", "1", "--gen-prompt-tokens", "512", "--gen-max-tokens", "700"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "exceed the model's context (1024)" in r.output
