"""The shipped tiny MLA + MTP model: loads in mlx-lm, greedy is deterministic, the MTP layer
loads by DeepSeek's names, and its GGUF twin runs in a real llama-server."""

import json

import httpx
import mlx.core as mx
import pytest

from .conftest import TINY_MODEL
from .fixtures import llama_serve as _serve


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm import load

    model, tok = load(str(TINY_MODEL))
    model.set_dtype(mx.float32)  # MLX's CPU gather_mm (MoE) runs in float32 only
    return model, tok


def _greedy(model, prompt_ids, n):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out = []
    for tok, _ in generate_step(
        mx.array(prompt_ids), model, max_tokens=n, sampler=make_sampler(0.0)
    ):
        out.append(int(tok))
    return out


def test_config_is_deepseek_v3_with_one_mtp_layer():
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 1
    assert cfg["kv_lora_rank"] >= 128 and 32 <= cfg["qk_rope_head_dim"] <= 64 and cfg["q_lora_rank"]
    size = sum(p.stat().st_size for p in TINY_MODEL.iterdir())
    assert size <= 20 * 2**20


@pytest.mark.model
def test_greedy_generation_is_deterministic(tiny):
    model, tok = tiny
    ids = tok.encode("ROMEO.\nBut soft, what light", add_special_tokens=False)
    assert _greedy(model, ids, 24) == _greedy(model, ids, 24)


@pytest.mark.model
def test_mtp_weights_load_by_name(tiny):
    from macserve.engine.mtp_layer import load_mtp_layers

    model, _ = tiny
    (mtp,) = load_mtp_layers(TINY_MODEL, trunk=model)
    names = set(json.loads((TINY_MODEL / "model.safetensors.index.json").read_text())["weight_map"])
    for n in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "mlp.gate.weight",
        "self_attn.kv_b_proj.weight",
    ):
        assert f"model.layers.4.{n}" in names
    mtp.set_dtype(mx.float32)
    h = model.model(mx.array([[1, 2, 3]]))
    logits, _ = mtp(h[:, -1:], mx.array([[4]]))
    assert logits.shape == (1, 1, model.args.vocab_size)


@pytest.mark.e2e
def test_llama_server_kv_size_matches_inspect(llama_server, tiny_gguf):
    from macserve.sizing.report import report

    per = report(str(tiny_gguf))["kv_bytes_per_token"]["llama.cpp/f16"]
    p = _serve(llama_server, tiny_gguf, 18431, "-c", "1024", "-v")
    p.terminate()
    p.wait(timeout=30)
    log = open(p.log_path).read()
    line = next(l for l in log.splitlines() if "llama_kv_cache: size =" in l)
    mib = float(line.split("size =")[1].split("MiB")[0])
    assert abs(mib * 2**20 - 1024 * per) < 0.01 * 2**20, line


@pytest.mark.e2e
def test_llama_server_greedy_matches_mlx(llama_server, tiny_gguf, tiny):
    model, tok = tiny
    prompts = [
        "HORATIO.\nWhat, has this thing appear'd again to-night?\n",
        "FERDINAND.\nThere be some sports are painful, and their labour\n",
    ]
    p = _serve(llama_server, tiny_gguf, 18432, "-c", "512")
    try:
        for text in prompts:
            ids = tok.encode(text, add_special_tokens=False)
            want = _greedy(model, ids, 32)
            r = httpx.post(
                "http://127.0.0.1:18432/completion",
                timeout=60,
                json={
                    "prompt": ids,
                    "n_predict": 32,
                    "temperature": 0,
                    "top_k": 1,
                    "return_tokens": True,
                    "cache_prompt": False,
                },
            )
            got = r.json()["tokens"]
            assert got == want, (text, got, want)
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.mark.model
def test_training_runs_every_expert_yet_computes_mlx_lm_moe():
    """train-tiny's all-experts MoE has mlx-lm's outputs and gradients (it only runs faster)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from macserve.dev.tiny.train import AllExpertsGLU

    mx.random.seed(1)
    m = SwitchGLU(16, 24, 4)
    x = mx.random.normal((2, 70, 16))  # >= 64 routed rows: mlx-lm's sorted gather path
    idx = mx.random.randint(0, 4, (2, 70, 2))
    w = mx.random.normal((2, 70, 2, 16))

    def loss(mod):
        return (mod(x, idx) * w).sum()

    ref_v, ref_g = nn.value_and_grad(m, loss)(m)
    m.__class__ = AllExpertsGLU
    v, g = nn.value_and_grad(m, loss)(m)
    assert abs(float(v - ref_v)) < 1e-3
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert mx.allclose(g[name]["weight"], ref_g[name]["weight"], atol=1e-4).item()


@pytest.mark.e2e
def test_llama_server_next_token_matches_mlx_along_held_out_text(llama_server, tiny_gguf, tiny):
    """Teacher-forced: at each of 48 positions of a held-out passage, llama-server's greedy
    next token equals mlx-lm's. Unlike free greedy decoding (which this undertrained model
    collapses into line breaks), the predictions here vary with the text."""
    model, tok = tiny
    text = (
        "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the "
        "mind to suffer\nThe slings and arrows of outrageous fortune,\n"
    )
    ids = tok.encode(text, add_special_tokens=False)[:49]
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    want = mx.argmax(logits, axis=-1).tolist()
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    gap = (top2[:, 1] - top2[:, 0]).tolist()
    # not one token everywhere (the undertrained model still favours "\n", " the" and ",")
    assert len(set(want)) >= 4 and max(want.count(t) for t in want) < 0.6 * len(want)
    p = _serve(llama_server, tiny_gguf, 18433, "-c", "512")
    try:
        for i in range(1, len(ids)):
            r = httpx.post(
                "http://127.0.0.1:18433/completion",
                timeout=60,
                json={
                    "prompt": ids[:i],
                    "n_predict": 1,
                    "temperature": 0,
                    "top_k": 1,
                    "return_tokens": True,
                    "cache_prompt": True,
                },
            )
            got = r.json()["tokens"][0]
            # f32 on both sides: only a near tie may go either way
            assert got == want[i - 1] or gap[i - 1] < 1e-3, (i, got, want[i - 1], gap[i - 1])
    finally:
        p.terminate()
        p.wait(timeout=30)
