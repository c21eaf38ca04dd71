"""The mlx/bf16 row from mlx-lm itself (sizing/mlx_measure.py): each real config built in
mlx-lm with weights it never evaluates, its caches read, against the figures derived by hand
(tests/test_inspect_configs.py) and against inspect's own modelled layout.

mlx-lm 0.32.2 is what this runs against here; the figures are bytes of arrays whose shapes
mlx-lm computes, not timings, so they do not depend on the machine."""

import json

import pytest
from click.testing import CliRunner

from macserve.cli import main
from macserve.sizing import mlx_measure
from macserve.sizing.arch_config import shape_from_config
from macserve.sizing.kv_layout import as_number, layout
from macserve.sizing.report import inspect_source, mlx_check

from .conftest import CONFIGS
from .test_inspect_configs import ADDED, DERIVED, EXPECTED, STATE

MLX_TESTS = CONFIGS / "mlx-lm"  # mlx-lm's own test configs (tests/configs/README.md)
REAL = sorted(p.stem for p in CONFIGS.glob("*.json"))
# Where mlx-lm 0.32.2 has no module: the row stays modelled.
NO_MODULE = {
    "deepseek-ai__DeepSeek-V4-Flash",
    "zai-org__GLM-5.3-Flash.RECONSTRUCTED",
    "LiquidAI__LFM2.5-VL-1.6B",  # lfm2_vl: a VLM type mlx-lm leaves to mlx-vlm
    "MiniMaxAI__MiniMax-M1",  # minimax_m1 (remote code; mlx-lm's minimax is MiniMax-M2)
    "MiniMaxAI__MiniMax-M3.RECONSTRUCTED",  # minimax_m3
}
# Published abridged: mlx-lm's glm4_moe ModelArgs requires fields (rope_theta, rms_norm_eps,
# partial_rotary_factor, ...) the abridged copy leaves out, so it cannot build it; the row
# stays modelled. Its llama.cpp row is checked by tests/test_llama_truth.py.
NOT_BUILT = {"zai-org__GLM-4.7.ABRIDGED"}


def _cfg(path):
    return json.loads(path.read_text())


def _hand_figure(name):
    for table in (EXPECTED, ADDED, DERIVED):
        if name in table and table[name][0] is not None:
            return table[name][0]
    return None


@pytest.mark.parametrize("name", REAL)
def test_mlx_lm_allocates_what_inspect_says(name):
    cfg = _cfg(CONFIGS / f"{name}.json")
    m = mlx_measure.measure(cfg, use_cache=False)
    if name in NO_MODULE:
        assert not m.ok and "has no module" in m.reason
        return
    if name in NOT_BUILT:
        assert not m.ok and "could not build it" in m.reason
        return
    assert m.ok, m.reason
    want = _hand_figure(name)
    if want is not None:
        assert as_number(m.per_token) == want
    if (name, "mlx/bf16") in STATE:
        assert m.fixed == STATE[(name, "mlx/bf16")]
    c = mlx_check(cfg)
    assert c.agree, c


@pytest.mark.parametrize("path", sorted(MLX_TESTS.glob("*.json")), ids=lambda p: p.stem)
def test_mlx_lm_test_configs_agree_with_the_model(path):
    """lfm2, hunyuan, gemma3_text, gemma3n, kimi_linear, exaone4: small configs from mlx-lm's
    own tests (no published config of lfm2, lfm2_moe, hunyuan_v1_dense, gemma3n or kimi_linear
    was found verbatim in a public repository; gemma3, exaone4 and hunyuan are also above)."""
    c = mlx_check(_cfg(path))
    assert c.measured is not None, c.why
    assert c.agree, c


def test_the_dsa_indexer_values_array_is_counted():
    # deepseek_v32.Indexer: cache.values = mx.zeros_like(cache.keys), as large as the keys.
    m = mlx_measure.measure(_cfg(CONFIGS / "deepseek-ai__DeepSeek-V3.2.json"), use_cache=False)
    assert as_number(m.per_token) == 61 * (1152 + 256 + 256)
    modelled = layout(shape_from_config(_cfg(CONFIGS / "zai-org__GLM-5.2.json")), "mlx/bf16")
    assert sum(1 for b in modelled.buffers if "zeros" in b.what) == 78  # shared ones too


def test_ring_buffers_are_windows_not_growth():
    m = mlx_measure.measure(_cfg(CONFIGS / "google__gemma-4-26B-A4B.json"), use_cache=False)
    rings = [c for c in m.caches if c.window]
    assert len(rings) == 25 and {c.window for c in rings} == {1024}
    assert {c.cls for c in rings} == {"RotatingKVCache"}
    rep = inspect_source(str(CONFIGS / "google__gemma-4-26B-A4B.json"))
    lay = rep.layouts["mlx/bf16"]
    # 100 tokens: 5 growing layers padded to 256 tokens, rings of 256 (their first step).
    assert lay.bytes_at(100) == 256 * 20480 + 25 * 256 * 8192


def test_measurements_are_kept_and_reused(monkeypatch, macserve_home):
    cfg = _cfg(CONFIGS / "openai__gpt-oss-120b.json")
    first = mlx_measure.measure(cfg)
    assert list((macserve_home / "cache" / "mlx-layout").glob("*.json"))

    def no_mlx(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(mlx_measure, "_run", no_mlx)
    assert mlx_measure.measure(cfg) == first
    changed = dict(cfg, sliding_window=64)  # another config is another key
    with pytest.raises(AssertionError, match="measured again"):
        mlx_measure.measure(changed)


def test_rows_say_where_their_numbers_come_from():
    r = CliRunner().invoke(main, ["inspect", str(CONFIGS / "moonshotai__Kimi-K3.json"), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["row_source"]["mlx/bf16"] == "measured"
    assert d["measured_with"]["mlx/bf16"].startswith("mlx-lm ")
    assert d["row_source"]["llama.cpp/f16"] == "modelled"
    assert d["kv_bytes_per_token"]["mlx/bf16"] == 27648
    r = CliRunner().invoke(main, ["inspect", str(CONFIGS / "moonshotai__Kimi-K3.json")])
    row = next(l for l in r.output.splitlines() if l.startswith("mlx/bf16"))
    assert row.endswith("measured")
    # No module in mlx-lm: modelled, and said so.
    d = json.loads(
        CliRunner()
        .invoke(main, ["inspect", str(CONFIGS / "deepseek-ai__DeepSeek-V4-Flash.json"), "--json"])
        .stdout
    )
    assert d["row_source"]["mlx/bf16"] == "modelled"
    assert any("has no module" in n for n in d["notes"])


def test_a_config_only_mlx_lm_understands_gets_its_measured_row_only(tmp_path):
    # youtu_llm: a model type mlx-lm 0.32.2 has and inspect cannot classify (its config names
    # no layer kinds and it is not on the dense allow-list); Llama 3.1's fields build it.
    cfg = json.loads((CONFIGS / "meta-llama__Meta-Llama-3.1-8B.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "model_type": "youtu_llm"}))
    path = str(path)
    d = json.loads(CliRunner().invoke(main, ["inspect", path, "--json"]).stdout)
    assert d["row_source"]["mlx/bf16"] == "measured"
    assert d["kv_bytes_per_token"]["mlx/bf16"] > 0
    assert d["kv_bytes_per_token"]["llama.cpp/f16"] is None
    assert "cannot classify" in d["unsupported"]["llama.cpp/f16"]
    # Without the engine check it is the classification error: one line, exit 2.
    r = CliRunner().invoke(main, ["inspect", path, "--modelled"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1


def test_malformed_configs_are_still_one_line_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": "many"}))
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1
