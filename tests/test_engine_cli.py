"""The engine's commands as a user runs them, on the project's model, small settings."""

import functools
import json

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.engine import mla_attention
from macserve.engine.bench import setup as bench_setup
from macserve.engine.bench.kv import GATED
from macserve.engine.calibration import METHODS, Calibration
from macserve.engine.mtp_auto import decide_on

from .conftest import TINY_MODEL

KV_KEYS = {
    "variant",
    "default",
    "windows",
    "bytes_per_token_per_layer",
    "delta_ppl_pct",
    "kl",
    "top1_agreement",
    "decode_speed_ratio",
}
MTP_KEYS = {
    "k",
    "acceptance_per_position",
    "tokens_per_s_mtp",
    "tokens_per_s_plain",
    "speedup",
    "greedy_identical",
}


@pytest.mark.model
def test_calibrate_writes_a_loadable_file(tmp_path):
    out = tmp_path / "rot.safetensors"
    r = CliRunner().invoke(
        main,
        ["calibrate", str(TINY_MODEL), "--out", str(out), "--windows", "1", "--seq-len", "256"],
    )
    assert r.exit_code == 0, r.output
    cal = Calibration.load(out)
    assert set(cal.rotations) == set(METHODS) | {"gate"} and cal.meta["calibration_tokens"] == 256


@pytest.mark.model
def test_bench_kv_json_rows(tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "kv",
            str(TINY_MODEL),
            "--windows",
            "1",
            "--seq-len",
            "128",
            "--gen-tokens",
            "4",
            "--contexts",
            "512",
            "--gen-prompts",
            "1",
            "--gen-prompt-tokens",
            "64",
            "--gen-max-tokens",
            "4",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout[r.stdout.index("[") :])
    assert all(set(row) >= KV_KEYS for row in rows)
    # the demo ships the gate's plan: that is what --kv int2 serves, the default row
    assert [row["variant"] for row in rows if row["default"]] == [GATED]
    # free generation: bf16 and the default row only in the full set (it is long)
    assert [row["variant"] for row in rows if "gen_length" in row] == ["bf16 latent", GATED]
    assert {row["windows"] for row in rows} == {True, False}
    bf16 = rows[0]
    assert bf16["variant"] == "bf16 latent" and bf16["kl"] == 0.0
    # KL is >= 0; computed in float64, rounding may leave a -1e-15 where the true value is 0
    assert all(row["kl"] >= -1e-12 for row in rows)


@pytest.mark.model
def test_bench_kv_refuses_bad_contexts():
    r = CliRunner().invoke(main, ["bench", "kv", str(TINY_MODEL), "--contexts", "1k,2k"])
    assert r.exit_code == 2 and "comma-separated integers" in r.output


@pytest.mark.model
def test_bench_mtp_json():
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "mtp",
            str(TINY_MODEL),
            "-k",
            "1",
            "-k",
            "2",
            "--prompts",
            "1",
            "--tokens",
            "40",  # past one --mtp auto probe (8 plain steps, 8 rounds)
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout[r.stdout.index("[") :])
    assert [row["k"] for row in rows] == [1, 2]
    assert all(set(row) >= MTP_KEYS for row in rows)
    assert all(row["greedy_identical"] for row in rows)
    assert len(rows[1]["acceptance_per_position"]) == 2
    # --mtp auto beside them: what it got, and the decision its figures give
    for row in rows:
        a = row["auto"]
        assert a["speedup"] > 0 and a["vs_best"] > 0 and a["greedy_identical_prompts"] == 1
        fig = a["figures"]
        assert fig is None or a["drafting"] == decide_on(fig["speedup"], a["drafting"])


@pytest.mark.model
def test_generate_with_int2_and_mtp():
    r = CliRunner().invoke(
        main,
        [
            "generate",
            str(TINY_MODEL),
            "ROMEO.\n",
            "--max-tokens",
            "8",
            "--kv",
            "int2",
            "--mtp",
            "on",
            "--mtp-k",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "drafts accepted" in r.output


@pytest.mark.model
def test_bench_dsa_json():
    """Just past index_topk (2,048): both DSA decode paths run and are timed in one process."""
    r = CliRunner().invoke(main, ["bench", "dsa", "--contexts", "2304", "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.output)
    assert row["context"] == 2304 and row["index_topk"] == 2048
    assert row["tokens_per_s_sparse"] > 0 and row["tokens_per_s_masked"] > 0
    r = CliRunner().invoke(main, ["bench", "dsa", "--contexts", "4k"])
    assert r.exit_code == 2 and "comma-separated token counts" in r.output


@pytest.mark.model
def test_bench_engine_json_small_contexts(monkeypatch):
    """`bench engine` end to end on the synthetic DeepSeek-V3 layer, contexts cut to what a
    test affords: every key the report promises, and the relations that do not depend on this
    machine's timings (docs/int2-latent-cache.md has the full run)."""
    # Narrowed as test_engine_scale.py's model is (16 heads of 128, hidden 1024 of 7168: the
    # cache rows, dtypes and byte counts asserted here do not depend on them; its docstring
    # says why), and a prefill block's budget with the heads, so a block holds the keys it
    # holds at full width. The full width is the command itself, unpatched:
    # `macserve bench engine --synthetic deepseek-v3` (its defaults run to 32K).
    heads = 16
    narrow = functools.partial(bench_setup.setup_synthetic, heads=heads, hidden=1024)
    monkeypatch.setattr(bench_setup, "setup_synthetic", narrow)
    monkeypatch.setattr(mla_attention, "BLOCK_BYTES", mla_attention.BLOCK_BYTES * heads // 128)
    r = CliRunner().invoke(
        main,
        [
            "bench", "engine", "--synthetic", "deepseek-v3", "--layers", "1",
            "--prefill-contexts", "2048", "--held-contexts", "1024", "--decode-contexts", "512",
            "--projection-contexts", "2048", "--chunk-tokens", "16", "--bf16-chunk-tokens", "8",
            "--acceptance", "0.7", "--json",
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["model"] == "synthetic deepseek-v3 (1 layers, 16 heads, hidden 1024)"
    assert d["upcasts_per_decode_step"] == {"int2": 0, "bf16": 0}
    assert d["upcasts"]["logits_dtype"] == {"int2": "bfloat16", "bf16": "bfloat16"}
    # 1,024 tokens: past the INT2 cache's 592 bf16 rows (sink 64 + recent 512 + slack 16), so
    # it holds codes (at 512 it is all bf16 and holds exactly what the bf16 latent does)
    held, nb = d["held_bytes_per_token_per_layer"]["1024"], d["nbytes_per_token_per_layer"]["1024"]
    assert nb["bf16"] == nb["bf16_latent"] == 1152  # (512 + 64) x 2 B: the latent row
    for w in ("int2", "bf16_latent", "bf16"):  # the allocator's figure: 32 KB / 1,024 at most
        assert abs(held[w] - nb[w]) <= 32, (w, held[w], nb[w])
    assert held["int2"] < held["bf16"]
    assert d["rotation_bytes_per_layer"] == 512 * 512 * 2
    tr = d["prefill_transient_bytes"]["2048"]
    # both read keys in blocks (mla_attention.blocked_prefill for mlx-lm's cache): neither
    # materializes heads x chunk x context scores (test_engine_memory.py bounds them)
    assert tr["int2"] > 0 and tr["bf16"] > 0
    for key in ("chunk_vs_steps_max_logit_diff", "chunk_vs_steps_bf16_model"):
        diffs = d[key]
        assert all(0 <= diffs[w] < 0.1 for w in ("int2", "bf16", "bf16_latent")), diffs
    for v in d["decode_tok_s"].values():
        # medians of the rounds, and of the rounds' ratios (not the ratio of the medians)
        assert v["rounds"] >= 1 and min(v[w] for w in ("int2", "int2_previous", "bf16")) > 0
        assert v["int2_vs_bf16_latent"] > 0 and v["int2_vs_mlx_lm"] > 0
    assert set(d["attention_parts"]["ms"]) == {
        "mlx_lm_sdpa", "mlx_lm_folded", "bf16_latent", "int2", "int2_unpack"
    }  # fmt: skip
    assert d["attention_parts"]["folded_max_abs_diff"] < 1e-3  # the same product, refolded
    # 2,048 tokens: at 1,024 a step's INT2 read (592 bf16 rows, the codes and the 0.5 MB
    # rotation, read once per step) is still more than the bf16 latent's 1,024 rows
    proj = d["mac_projection"]["contexts"]["2048"]
    assert proj["int2"]["bytes_once"] < proj["bf16"]["bytes_once"]
    assert proj["int2"]["flops"] == proj["bf16"]["flops"]  # the same products: the roofline
    m = d["mtp"]
    assert m["acceptance"] == 0.7 and m["trunk_layers"] == 61
    assert m["verify_cost_ratio"] > 0 and m["projected_speedup_k1"] > 0
