"""`macserve bench serve` end to end, at its smallest: the three real servers (mlx_lm.server
and macserve twice) start, answer the chat and the concurrent clients, and the report has
every figure and ratio. Speed is the bench's to print, not this test's to judge."""

import json
import math
import os
import subprocess
import sys

import pytest

from .conftest import REPO, TINY_MODEL

pytestmark = pytest.mark.e2e


def test_bench_serve_runs_all_three_servers_and_reports_ratios(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    small = ["--turns", "2", "--rounds", "1", "--clients", "2", "--requests", "1"]
    small += ["--load-tokens", "4", "--answer-tokens", "4", "--logs", str(tmp_path / "logs")]
    small += ["--restart-rounds", "1", "--capacity-clients", "3", "--capacity-batch", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "macserve", "bench", "serve", str(TINY_MODEL), "--json", *small],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert list(res["servers"]) == ["mlx_lm.server", "macserve", "macserve int2 mtp1"]
    for s in res["servers"].values():
        chat = s["chat"]
        assert len(chat["ttft_per_turn_s"]) == 2 and chat["last_turn_prompt_tokens"] > 0
        assert chat["same_history_cold_ttft_s"] > 0
        for load in (s["load_1_client"], s["load_2_clients"]):
            assert load["refused"] == 0 and load["completion_tokens"] > 0
            assert load["latency_p50_s"] <= load["latency_p95_s"]
    for q in res["vs_mlx_lm_server"].values():
        assert all(math.isfinite(v) and v > 0 for v in q.values())
    # 3 servers, 2 per restart target (before and after the restart), 2 for capacity
    assert len(list((tmp_path / "logs").iterdir())) == 3 + 2 * 3 + 2  # every server's log kept
    assert (
        math.isfinite(res["restart_followup_ttft_ratio"]) and res["restart_followup_ttft_ratio"] > 0
    )
    assert list(res["restart"]) == ["macserve int2", "macserve", "mlx_lm.server"]
    base = res["restart"].pop("mlx_lm.server")  # memory only: measured, nothing reused
    assert base["tokens_reused_per_tier"] == {} and base["cold_ttft_s"] > 0
    assert res["restart_followup_ttft_ratio_mlx_lm"] == base["restart_followup_ttft_ratio"]
    for r in res["restart"].values():
        # The follow-up after the restart came from disk: all but the new message's tokens.
        (got,) = r["restart_cached_tokens"]
        assert r["first_turn_prompt_tokens"] <= got < r["followup_prompt_tokens"]
        assert r["tokens_reused_per_tier"]["disk"] >= got
        assert r["warm_cached_tokens"][0] >= got
        assert r["cold_cached_tokens"][0] <= 8  # the chat template's first tokens at most

    # Bytes on disk per token of the first turn's prefix, measured (INT2 under bf16: codes and
    # one window; the formula leaves the files' headers out) and projected, labelled so.
    disk = res["disk_bytes"]
    assert disk["macserve int2"]["bytes_per_token"] < disk["macserve"]["bytes_per_token"]
    assert disk["macserve int2"]["formula_bytes"] <= disk["macserve int2"]["bytes"]
    proj = res["disk_projection"]
    assert "projection" in proj["what"] and proj["int2_bytes"] < proj["int2_format3_bytes"]

    # Capacity: the default (sized from the memory budget) and --max-batch 1, three clients
    cap = res["capacity"]
    assert cap["servers"]["--max-batch 1"]["max_batch"] == 1
    assert cap["servers"]["default"]["max_batch"] >= 1 and cap["best_fixed"] == "--max-batch 1"
    for s in cap["servers"].values():
        assert s["refused"] == 0 and s["completion_tokens"] > 0 and s["requests"] == 3
    assert math.isfinite(cap["default_over_best"]) and cap["default_over_best"] > 0
