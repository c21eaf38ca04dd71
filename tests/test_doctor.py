"""`macserve doctor` on this machine, with profiles from local folders and from the local fake
hub: each share's weights and KV are inspect's own figures for that model, cache and context,
the share is services/share.py's; a running one's resident memory now and peak are shown
beside it (services/resident.py); the profiles that start at login are summed by shares
against the budget; free memory now is said; the sysctl to raise it is printed. `inspect NAME`
and `ls --json` say the same ledger."""

import json

import pytest

from macserve.services.share import share

from .conftest import TINY_MODEL
from .fixtures import GGUF_REPO, MLX_REPO, cli, free_port, status

pytestmark = pytest.mark.e2e


def inspect_figures(source, ctx, key):
    r = cli("inspect", source, "--json", "--ctx", str(ctx))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    weights = d["weights_bytes"]
    total = d["memory_at_context"][key][str(ctx)]
    host = d.get("engine_host")
    if key.startswith("macserve/") and host:
        # the engine on this CPU host holds its weights in float32: inspect's engine line
        # (sizing/host.py); the INT2 cache's rows are the same on either host
        return host["weights_bytes"], total - weights, d["budget_bytes"]
    return weights, total - weights, d["budget_bytes"]


def test_doctor_sums_what_starts_at_login(hub, llama_server, services, macserve_home):  # noqa: F811
    port = free_port()
    r = cli("new", f"{GGUF_REPO}:F32", "--name", "g", "--port", str(port), "--extra-args", "-t 1")
    assert r.returncode == 0, r.stderr
    services.append(status("g")["pid"])
    for args in (
        # KV=int2 by hand: the calibrated folder's default, auto, counts bf16 (test_kv_auto.py)
        [str(TINY_MODEL), "--provider", "macserve", "--name", "e", "--ctx", "512", "--kv", "int2"],
        [MLX_REPO, "--name", "m"],
    ):
        r = cli("new", *args, "--no-start")
        assert r.returncode == 0, r.stderr
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rows = {p["name"]: p for p in d["profiles"]}
    assert {n: p["at_login"] for n, p in rows.items()} == {"e": False, "g": True, "m": False}
    # each share's weights and one sequence's KV are what inspect says for that source, cache
    # type and context; the share is services/share.py's
    expect = {
        "g": (f"{GGUF_REPO}:F32", 1024, "llama.cpp/f16"),  # -c 1024: new's choice
        "e": (str(TINY_MODEL), 512, "macserve/int2"),
        "m": (MLX_REPO, 1024, "mlx/bf16"),  # no context flag: up to the model's limit
    }
    for name, (source, ctx, key) in expect.items():
        weights, kv, budget = inspect_figures(source, ctx, key)
        p = rows[name]
        assert (p["ctx"], p["cache_key"]) == (ctx, key), name
        assert (p["weights_bytes"], p["kv_bytes"]) == (weights, kv), name
        assert p["share_bytes"] == share(name).share_bytes > weights + kv, name
        assert d["budget_bytes"] == budget  # this machine's budget, as inspect figures it
    assert "no context flag" in rows["m"]["note"]
    # g runs: what it holds now and at its peak, beside its share; the others hold nothing
    assert 0 < rows["g"]["resident_bytes"] <= rows["g"]["peak_bytes"]
    assert rows["e"]["resident_bytes"] is None and rows["e"]["peak_bytes"] is None
    assert 0 < d["free_bytes"] <= d["total_memory_bytes"]
    need = rows["g"]["share_bytes"]
    assert d["at_login_bytes"] == need and d["fits"]
    assert d["raise_command"] == f"sudo sysctl iogpu.wired_limit_mb={d['suggested_wired_limit_mb']}"
    # the same ledger in `ls --json` and `inspect NAME`
    listed = {x["name"]: x for x in json.loads(cli("ls", "--json").stdout)}
    assert (listed["g"]["share_bytes"], listed["g"]["share"]) == (need, rows["g"]["share"])
    assert listed["g"]["peak_bytes"] >= rows["g"]["resident_bytes"]
    mine = json.loads(cli("inspect", "g", "--json").stdout)
    assert (mine["share_bytes"], mine["budget_bytes"]) == (need, d["budget_bytes"])
    text = cli("inspect", "g").stdout
    assert "share:" in text and "resident:" in text and "free on this machine now" in text
    # a Mac whose default budget (2/3 of RAM this small) is below what starts at login
    small = json.loads(cli("doctor", "--json", "--memory", f"{need}B").stdout)
    assert small["budget_bytes"] < need and not small["fits"]
    roomy = json.loads(cli("doctor", "--json", "--memory", f"{2 * need}B").stdout)
    assert roomy["budget_bytes"] >= need and roomy["fits"]
    text = cli("doctor", "--memory", f"{need}B").stdout
    assert ": DOES NOT FIT" in text and "raise:    sudo sysctl iogpu.wired_limit_mb=" in text
    assert "free:" in text and "SHARE" in text and "PEAK" in text
    assert "docs/services.md#gpu-wired-limit" in text
    text = cli("doctor", "--memory", f"{2 * need}B").stdout  # everything fits: no sysctl line
    assert ": fits" in text and "raise:" not in text and "sudo sysctl" not in text
    assert cli("rm", "g").returncode == 0
