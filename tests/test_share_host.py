"""The engine's dtype on this host (sizing/host.py): on MLX's CPU the engine's loader computes
in float32, so a profile's share (and inspect's line for a local folder) counts its weights'
half-precision tensors and the caches held in the model's dtype at twice inspect's bf16
rows; on a GPU (a Mac) the figures stay what inspect counts. mlx_lm.server and llama-server
keep their own dtypes on either. Each host asked for by `device`, so both are checked here;
the detection itself is checked against MLX's own default device (marked `model`).

The served side (the server's measured sequence and prompt cache against the share's) is
tests/test_memory_real.py's engine test."""

import json
from pathlib import Path

import pytest

from macserve.services import share
from macserve.services.profiles import Profile
from macserve.sizing import host
from macserve.sizing.arch_config import shape_from_config
from macserve.sizing.kv_layout import layout
from macserve.sizing.model_source import read_local
from macserve.sizing.report import inspect_source, report_of

from .fixtures import TINY_MODEL

CONFIGS = Path(__file__).parent / "configs"


def _profile(provider="macserve", model=TINY_MODEL, **keys) -> Profile:
    values = {"PROVIDER": provider, "MODEL": str(model), "PORT": "9000", "CTX": "512"}
    return Profile("p", {**values, **keys})


def test_the_engine_counts_float32_on_a_cpu_host_and_bf16_on_a_gpu():
    rep = inspect_source(str(TINY_MODEL))
    half = host.half_weight_bytes(TINY_MODEL)
    assert 0 < half < rep.weights_bytes  # the demo ships bf16 (and a few float32 tensors)
    p = _profile(KV="bf16")  # mlx-lm's own cache: its rows in the model's dtype
    gpu, cpu = share.share_of(p, device=host.GPU), share.share_of(p, device=host.CPU)
    bf16 = rep.layouts["mlx/bf16"].bytes_at(512)
    assert (gpu.weights_bytes, gpu.kv_bytes) == (rep.weights_bytes, bf16)
    assert (cpu.weights_bytes, cpu.kv_bytes) == (rep.weights_bytes + half, 2 * bf16)
    assert cpu.prompt_cache_bytes == share.prompt_cache_bound(2 * bf16)  # one float32 sequence
    assert host.LABEL in cpu.note and host.LABEL not in gpu.note
    assert cpu.share_bytes > gpu.share_bytes
    # the INT2 latent cache stores its rows from bf16 on either host: only the weights move
    p = _profile(KV="int2")
    gpu, cpu = share.share_of(p, device=host.GPU), share.share_of(p, device=host.CPU)
    assert cpu.kv_bytes == gpu.kv_bytes == rep.layouts["macserve/int2"].bytes_at(512)
    assert cpu.weights_bytes == gpu.weights_bytes + half
    # mlx_lm.server computes in the checkpoint's dtype wherever it runs: its share is one
    p = _profile("mlx")
    assert share.share_of(p, device=host.CPU) == share.share_of(p, device=host.GPU)


def test_only_buffers_in_the_model_dtype_widen():
    # a hybrid: conv tails in the activations' dtype, recurrent states in float32 already
    cfg = json.loads((CONFIGS / "Qwen__Qwen3-Next-80B-A3B-Thinking.json").read_text())
    lay = layout(shape_from_config(cfg), "mlx/bf16")
    cpu = host.host_layout(lay, host.CPU)
    assert host.host_layout(lay, host.GPU) is lay
    assert cpu.per_token == 2 * lay.per_token  # K/V rows: all in the model's dtype
    kinds = {(b.what, b.model_dtype) for b in lay.buffers}
    assert ("recurrent state (f32)", False) in kinds and ("conv state (bf16)", True) in kinds
    for a, b in zip(lay.buffers, cpu.buffers, strict=True):
        assert b.row == (2 * a.row if a.model_dtype else a.row), a
    assert lay.state < cpu.state < 2 * lay.state


def test_inspect_says_what_the_engine_holds_on_this_host_for_a_local_folder():
    rep = inspect_source(str(TINY_MODEL))
    eh = host.engine_on_host(rep.layouts, rep.weights_bytes, str(TINY_MODEL), host.CPU)
    assert eh is not None and eh["label"] == host.LABEL
    assert eh["kv_bytes_per_token"]["mlx/bf16"] == 2 * rep.layouts["mlx/bf16"].per_token
    assert eh["kv_bytes_per_token"]["macserve/int2"] == rep.layouts["macserve/int2"].per_token
    assert eh["weights_bytes"] == rep.weights_bytes + host.half_weight_bytes(TINY_MODEL)
    assert host.engine_on_host(rep.layouts, rep.weights_bytes, str(TINY_MODEL), host.GPU) is None
    # a bare config (no weights, nothing the engine serves): the rows alone
    src = read_local(CONFIGS / "deepseek-ai__DeepSeek-V3.json", None)
    assert host.engine_on_host(rep.layouts, src.weights_bytes, src.local_path, host.CPU) is None
    # `inspect --json` carries this host's: float32 here only if MLX computes on the CPU
    got = report_of(rep)["engine_host"]
    assert (got is not None) == host.engine_float32()


@pytest.mark.model
def test_the_host_rule_reads_mlx_own_default_device_without_mlx():
    import mlx.core as mx

    from macserve.engine.model import computes_float32

    cpu = mx.default_device().type == mx.DeviceType.cpu
    assert host.mlx_device() == (host.CPU if cpu else host.GPU)
    # the loader's own rule (the engine imports no sizing) and its mirror agree on this host
    assert host.engine_float32() == computes_float32() == cpu
