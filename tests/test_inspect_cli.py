"""`macserve inspect` as a user meets it: JSON, budget options, one-line errors, cold start."""

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from macserve.cli import main

from .conftest import CONFIGS, REPO

V3 = str(CONFIGS / "deepseek-ai__DeepSeek-V3.json")
LLAMA = str(CONFIGS / "meta-llama__Meta-Llama-3.1-8B.json")


def run(*args):
    return CliRunner().invoke(main, ["inspect", *args])


def as_json(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_keys_keyed_by_engine_and_cache_type():
    d = as_json(V3, "--memory", "256GB")
    for k in (
        "model_type",
        "layers",
        "kv_bytes_per_token",
        "state_bytes_per_sequence",
        "max_context",
        "weights_bytes",
        "budget_bytes",
    ):
        assert k in d
    assert d["model_type"] == "deepseek_v3"
    assert d["layers"] == {"mla": 61, "mtp": 1}
    keys = {"mlx/bf16", "llama.cpp/f16", "llama.cpp/q8_0", "llama.cpp/q4_0", "macserve/int2"}
    for k in ("kv_bytes_per_token", "state_bytes_per_sequence", "max_context"):
        assert set(d[k]) == keys
    assert d["weights_bytes"] is None  # a bare config has no weight files
    assert d["budget_bytes"] == 192 * 2**30  # 3/4 of 256 GB, the default working set


def test_memory_parallel_and_ctx_change_the_plan():
    one = as_json(LLAMA, "--memory", "16GB")
    two = as_json(LLAMA, "--memory", "16GB", "--parallel", "2")
    budget = int(16 * 2**30 * 2 / 3)  # the default working set: 2/3 of RAM up to 36 GB
    assert one["budget_bytes"] == two["budget_bytes"] == budget
    # llama.cpp f16: 131,072 B per token, whole 256-token cells.
    assert one["max_context"]["llama.cpp/f16"] == budget // 131072 // 256 * 256
    assert two["max_context"]["llama.cpp/f16"] == budget // 2 // 131072 // 256 * 256
    d = as_json(LLAMA, "--memory", "16GB", "--ctx", "20000")
    assert d["memory_at_context"]["llama.cpp/f16"]["20000"] == 20224 * 131072
    assert d["over_budget"] == []


def test_ctx_over_the_wired_limit_warns_loudly_once():
    r = CliRunner().invoke(main, ["inspect", V3, "--memory", "8GB", "--ctx", "150000"])
    assert r.exit_code == 0
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, r.stderr  # one per situation, naming every row over
    assert "--ctx 150,000 x 1 is over the 5.3 GB GPU budget" in warnings[0]
    assert "mlx/bf16" in warnings[0] and "llama.cpp/f16" in warnings[0]
    assert "lower --ctx" in warnings[0]
    assert "macserve/int2" not in r.stderr  # 13,908 B/token x 150K fits in 6 GB
    d = as_json(V3, "--memory", "8GB", "--ctx", "150000")
    assert set(d["over_budget"]) == {"mlx/bf16", "llama.cpp/f16"}  # 70,272 B x 150,272 cells


KIMI = str(CONFIGS / "moonshotai__Kimi-K2-Instruct.json")


def test_weights_that_do_not_fit_get_one_verdict_with_the_options_that_help():
    """Kimi-K2 at 4-bit (~538 GB) on a 128 GB Mac: every row's max ctx is 0, so instead of
    advice to lower --ctx (which cannot help), one verdict naming what can: how many Macs
    (the pipeline plan's own count), a raised wired limit (not enough here), a smaller
    quantization (not enough here). On 512 GB: 2 Macs, or 2-bit weights."""
    r = CliRunner().invoke(
        main, ["inspect", KIMI, "--memory", "128GB", "--weights", "4bit", "--ctx", "32768"]
    )
    assert r.exit_code == 0, r.output
    verdict = [line for line in r.stdout.splitlines() if line.startswith(("verdict", "  - "))]
    assert verdict[0].startswith("verdict: does not fit: the weights alone (537.7 GB)")
    hosts = next(line for line in verdict if "inspect --hosts" in line)
    n = int(hosts.split("--hosts ")[1].split(")")[0])
    d = as_json(KIMI, "--memory", "128GB", "--weights", "4bit", "--hosts", str(n))
    assert d["multi_host"]["splits"][0]["group_context"]["mlx/bf16"] > 0
    d = as_json(KIMI, "--memory", "128GB", "--weights", "4bit", "--hosts", str(n - 1))
    assert d["multi_host"]["splits"][0]["group_context"]["mlx/bf16"] == 0
    assert any("not a raised wired limit" in line for line in verdict)
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "see the verdict" in warnings[0]
    big = as_json(KIMI, "--memory", "512GB", "--weights", "4bit")["verdict"]
    assert any("2 Macs" in line for line in big) and any("2-bit" in line for line in big)
    assert as_json(V3, "--memory", "512GB")["verdict"] == []


def test_quant_on_a_config_is_a_note_and_a_path_typo_is_not_a_hub_lookup(tmp_path, monkeypatch):
    r = run(V3, "--quant", "Q4_K_M", "--modelled")
    assert r.exit_code == 0 and "note: --quant Q4_K_M ignored" in r.output
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a hub look-up would fail loudly
    r = run("models/tiny-mal")
    _one_line_error(r)
    assert "no such file or folder" in r.output


def test_a_limit_the_config_leaves_out_is_the_loaders_default():
    gemma = str(CONFIGS / "google__gemma-3-27b-it.json")
    d = as_json(gemma, "--modelled")
    assert d["model_max_context"] == 131072
    assert any("Gemma3TextConfig" in n for n in d["notes"])


def test_human_output_has_the_table():
    r = run(V3, "--memory", "256GB")
    assert r.exit_code == 0, r.output
    assert "61 mla, 1 mtp" in r.output
    assert "@8K" in r.output and "@128K" in r.output and "@max" in r.output
    assert "macserve/int2         13,908" in r.output


def test_local_folder_counts_safetensors_as_weights(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "Qwen__Qwen3-30B-A3B.json").read_text())
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 24)
    d = as_json(str(tmp_path))
    assert d["weights_bytes"] == 1024 and d["kv_bytes_per_token"]["mlx/bf16"] == 98304


def _one_line_error(r):
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error:") and r.output.count("\n") == 1, r.output
    assert "Traceback" not in r.output


def test_bad_inputs_are_one_line_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    unknown = tmp_path / "u.json"
    unknown.write_text(json.dumps({"model_type": "frob", "num_hidden_layers": 2}))
    listy = tmp_path / "l.json"
    listy.write_text("[1, 2]")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    cases = [
        ([str(bad)], "malformed JSON"),
        ([str(unknown)], "unknown model_type 'frob'"),
        ([str(listy)], "not a JSON object"),
        ([str(tmp_path / "missing.json")], "no such file"),
        ([str(empty_dir)], "no config.json or .gguf"),
        (["not a repo"], "not a Hugging Face repo id"),
        ([V3, "--memory", "lots"], "not a size"),
        ([V3, "--memory", "-5GB"], "not a size"),
    ]
    for args, msg in cases:
        r = run(*args)
        _one_line_error(r)
        assert msg in r.output, (args, r.output)


def test_offline_hub_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("some-org/some-model")
    _one_line_error(r)
    assert "HF_HUB_OFFLINE" in r.output


def test_unreachable_hub_is_a_one_line_error_not_a_hang(monkeypatch, tmp_path):
    import socket

    from .test_inspect_gguf import isolate_hf_home

    isolate_hf_home(tmp_path, monkeypatch)

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.monotonic()
    r = run("some-org/some-model:Q4_K_M")
    _one_line_error(r)
    assert "cannot reach" in r.output
    assert time.monotonic() - t < 30  # a generous bound: a hang would be minutes


def _cold(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    code = (
        "import sys, time; t = time.perf_counter(); from macserve.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED', sorted(m for m in ('mlx', 'mlx_lm', 'huggingface_hub', 'httpx')"
        " if m in sys.modules), file=sys.stderr)"
    )
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    return p, time.perf_counter() - t


@pytest.mark.e2e
def test_cold_local_inspect_imports_neither_mlx_nor_the_hub(record_property):
    # --modelled: no measurement, so nothing of mlx either.
    p, seconds = _cold("inspect", V3, "--modelled")
    assert p.returncode == 0, p.stderr
    assert "IMPORTED []" in p.stderr, p.stderr
    record_property("cold_inspect_modelled_seconds", round(seconds, 3))  # measured, not asserted
    print(f"cold `macserve inspect --modelled` of a local config: {seconds:.2f} s")


@pytest.mark.e2e
def test_measured_inspect_imports_mlx_once_then_reads_its_cache(tmp_path, record_property):
    home = {"MACSERVE_HOME": str(tmp_path / "home")}
    first, t1 = _cold("inspect", V3, env_extra=home)
    assert first.returncode == 0, first.stderr
    # mlx_lm's package object is a stand-in while one model module loads (mlx_measure.py)
    assert "IMPORTED ['mlx']" in first.stderr, first.stderr
    assert "measured" in first.stdout
    assert len(list((tmp_path / "home" / "cache" / "mlx-layout").glob("*.json"))) == 1
    again, t2 = _cold("inspect", V3, env_extra=home)
    assert "IMPORTED []" in again.stderr, again.stderr
    assert again.stdout == first.stdout
    record_property("cold_inspect_measured_seconds", [round(t1, 3), round(t2, 3)])
    print(f"cold `macserve inspect` measuring: {t1:.2f} s; with its cache: {t2:.2f} s")


@pytest.mark.parametrize("args", [["inspect", "--help"]])
def test_help(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "REPO" in r.output.upper()
