import json

from click.testing import CliRunner

from macserve.cli import main

from .conftest import SHARED_CONFIGS

V3 = str(SHARED_CONFIGS / "deepseek-ai__DeepSeek-V3.json")


def run(*args):
    return CliRunner().invoke(main, ["inspect", *args])


def test_json_keys_and_budget_arithmetic():
    r = run(V3, "--memory", "256GB", "--parallel", "2", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    for k in ("model_type", "layers", "kv_bytes_per_token", "state_bytes_per_sequence",
              "max_context", "weights_bytes", "budget_bytes"):
        assert k in d
    assert d["budget_bytes"] == int(256 * 2**30 * 0.75)
    per = d["kv_bytes_per_token"]["llama.cpp/f16"]
    assert d["max_context"]["llama.cpp/f16"] == min(163840, d["budget_bytes"] // (per * 2))


def test_ctx_over_budget_warns_loudly():
    r = run(V3, "--memory", "8GB", "--ctx", "150000")
    assert r.exit_code == 0
    assert "WARNING" in r.output


def test_bad_inputs_are_one_line_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    unknown = tmp_path / "u.json"
    unknown.write_text(json.dumps({"model_type": "frob", "num_hidden_layers": 2}))
    for args in ([str(bad)], [str(unknown)], [str(tmp_path / "missing.json")],
                 [str(tmp_path)], [V3, "--memory", "lots"]):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith("error:") and r.output.count("\n") == 1, r.output


def test_unreachable_repo_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("some-org/some-model")
    assert r.exit_code == 2 and "error:" in r.output
