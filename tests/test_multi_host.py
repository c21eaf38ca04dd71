"""`macserve inspect --hosts/--memory a,b,c`: the split of a model over several Macs.

Expected figures are rebuilt here from the configs' own fields and the Mac working-set rule
(3/4 of RAM above 36 GB), not read back from the code under test.
"""

import json

from click.testing import CliRunner

from macserve.cli import main

from .conftest import CONFIGS, REPO

GB = 2**30
V3 = CONFIGS / "deepseek-ai__DeepSeek-V3.json"
GLM5 = CONFIGS / "zai-org__GLM-5.json"
LLAMA = CONFIGS / "meta-llama__Meta-Llama-3.1-8B.json"
QWEN_MOE = CONFIGS / "Qwen__Qwen3-30B-A3B.json"
TINY = REPO / "macserve" / "models" / "tiny-mla"


def cfg(path):
    return json.loads(path.read_text())


def run(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


def plan(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["multi_host"]


def split(mh, mode):
    return next(s for s in mh["splits"] if s["mode"] == mode)


def budget(mem):
    return int(mem * 0.75)  # the documented working set of a Mac above 36 GB


def mla_row(c):
    return (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2  # bf16 latent + rope key


def test_pipeline_layers_are_contiguous_and_cover_the_trunk():
    mh = plan(V3, "--hosts", 3, "--memory", "256GB", "--weights", "400GB")
    ranges = [h["layers"] for h in split(mh, "pipeline")["hosts"]]
    # mlx-lm's order: the first host (rank 0) runs the last layers
    assert ranges[-1][0] == 0 and ranges[0][1] == cfg(V3)["num_hidden_layers"]
    assert all(b[1] == a[0] for a, b in zip(ranges, ranges[1:]))
    counts = [z - a for a, z in ranges]
    assert max(counts) - min(counts) <= 1  # equal hosts, near-equal shares


def test_unequal_budgets_get_proportional_layers():
    mems = [256, 256, 128]
    mh = plan(V3, "--memory", ",".join(f"{m}GB" for m in mems), "--weights", "4bit")
    hosts = split(mh, "pipeline")["hosts"]
    n = cfg(V3)["num_hidden_layers"]
    assert sum(z - a for a, z in (h["layers"] for h in hosts)) == n
    for m, h in zip(mems, hosts):
        a, z = h["layers"]
        assert abs((z - a) - n * m / sum(mems)) < 1
        assert h["budget_bytes"] == budget(m * GB)
    counts = ",".join(str(z - a) for a, z in (h["layers"] for h in hosts))
    assert any(
        f"set SPLIT={counts} in the profile" in note for note in split(mh, "pipeline")["notes"]
    )


def test_group_context_is_the_minimum_over_hosts():
    c = cfg(V3)
    par = 64  # enough sequences that no host reaches the model's limit
    mh = plan(V3, "--memory", "256GB,256GB,192GB", "--weights", "4bit", "--parallel", par)
    s = split(mh, "pipeline")
    own = []
    for h in s["hosts"]:
        a, z = h["layers"]
        per = (z - a) * mla_row(c)
        assert h["kv_bytes_per_token"]["mlx/bf16"] == per
        free = h["budget_bytes"] - h["weights_bytes"]
        ctx = h["max_context"]["mlx/bf16"]
        assert ctx < c["max_position_embeddings"]
        # mlx-lm's KVCache grows in steps of 256 tokens: within one step of the exact share
        assert free // (par * per) - 256 <= ctx <= free // (par * per)
        own.append(ctx)
    assert s["group_context"]["mlx/bf16"] == min(own)


def test_pipeline_weights_are_the_total_plus_embeddings_on_every_host():
    c = cfg(V3)
    mh = plan(V3, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")
    hosts = split(mh, "pipeline")["hosts"]
    embed_head = 2 * c["vocab_size"] * c["hidden_size"] * 4.5 / 8
    extra = sum(h["weights_bytes"] for h in hosts) - mh["weights_bytes"]
    assert abs(extra - embed_head) / embed_head < 0.01


def test_four_bit_weights_count_the_published_parameters():
    mh = plan(V3, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")
    assert 660e9 < mh["params"] < 680e9  # DeepSeek-V3: 671B without the MTP module
    assert abs(mh["weights_bytes"] - mh["params"] * 4.5 / 8) < 1e6
    glm = plan(GLM5, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")
    assert 735e9 < glm["params"] < 755e9  # GLM-5: 744B


def test_tensor_parallel_keeps_the_whole_mla_latent_on_every_host():
    c = cfg(V3)
    mh = plan(V3, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")
    tp = split(mh, "tensor")
    assert tp["possible"]
    whole = c["num_hidden_layers"] * mla_row(c)
    for h in tp["hosts"]:
        assert h["kv_bytes_per_token"]["mlx/bf16"] == whole
        assert mh["weights_bytes"] / 2 < h["weights_bytes"] < mh["weights_bytes"]
    assert any("latent cache is not split" in n for n in tp["notes"])


def test_tensor_parallel_divides_gqa_kv_heads_when_it_can():
    c = cfg(LLAMA)
    hd = c["hidden_size"] // c["num_attention_heads"]
    mh = plan(LLAMA, "--hosts", 2, "--memory", "64GB", "--weights", "16GB")
    per = split(mh, "tensor")["hosts"][0]["kv_bytes_per_token"]["mlx/bf16"]
    assert per == c["num_hidden_layers"] * c["num_key_value_heads"] // 2 * hd * 2 * 2

    q = cfg(QWEN_MOE)
    n = 8  # divides the 32 query heads and the expert width, not the 4 KV heads
    mh = plan(QWEN_MOE, "--hosts", n, "--memory", "64GB", "--weights", "4bit")
    tp = split(mh, "tensor")
    assert tp["possible"], tp["reason"]
    per = tp["hosts"][0]["kv_bytes_per_token"]["mlx/bf16"]
    assert per == q["num_hidden_layers"] * q["num_key_value_heads"] * q["head_dim"] * 2 * 2
    assert any("not divisible" in note for note in tp["notes"])


def test_tensor_parallel_refused_when_heads_do_not_divide():
    assert cfg(V3)["num_attention_heads"] % 3
    tp = split(plan(V3, "--hosts", 3, "--memory", "256GB", "--weights", "4bit"), "tensor")
    assert not tp["possible"] and "attention heads" in tp["reason"]


def test_one_host_enough_says_no_split_needed():
    r = run(TINY, "--hosts", 2)
    assert r.exit_code == 0, r.output
    assert "fits on one Mac: no split needed" in r.output
    mh = plan(TINY, "--hosts", 2)
    assert mh["one_host"]["enough"]


def test_too_big_for_one_host_says_split_needed():
    r = run(V3, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")
    assert r.exit_code == 0, r.output
    assert "split needed" in r.output and "no split needed" not in r.output
    # 4.5 bits x 671B does not fit one 256 GB Mac's budget: the premise of the split
    assert plan(V3, "--hosts", 2, "--memory", "256GB", "--weights", "4bit")[
        "weights_bytes"
    ] > budget(256 * GB)


def test_bad_memory_list_is_a_one_line_error():
    for bad in ("256GB,,192GB", "256GB,lots", "256GB,-1GB"):
        r = run(V3, "--memory", bad, "--weights", "4bit")
        assert r.exit_code == 2, (bad, r.output)
        assert r.output.strip().count("\n") == 0 and r.output.startswith("error:")
        assert "Traceback" not in r.output


def test_hosts_and_list_must_agree():
    r = run(V3, "--hosts", 3, "--memory", "256GB,256GB", "--weights", "4bit")
    assert r.exit_code == 2 and "3" in r.output and "2" in r.output


def test_bare_config_without_weights_asks_for_them():
    r = run(V3, "--hosts", 2, "--memory", "256GB")
    assert r.exit_code == 2
    assert "--weights" in r.output and r.output.strip().count("\n") == 0


def test_explicit_weights_reach_the_one_host_table():
    r = run(V3, "--memory", "256GB", "--weights", "100GB", "--json")
    d = json.loads(r.stdout)
    assert d["weights_bytes"] == 100 * GB
    assert not any("weights unknown" in n for n in d["notes"])
