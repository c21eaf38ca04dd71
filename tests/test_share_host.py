"""The engine's dtype on this host (sizing/host.py): on MLX's CPU the engine's loader computes
in float32, so a profile's share (and inspect's line for a local folder) counts its weights'
half-precision tensors and the caches held in the model's dtype at twice inspect's bf16
rows; on a GPU (a Mac) the figures stay what inspect counts. mlx_lm.server and llama-server
keep their own dtypes on either. Each host asked for by `device`, so both are checked here;
the detection itself is checked against MLX's own default device (marked `model`).

The served side (the server's measured sequence and prompt cache against the share's) is
tests/test_memory_real.py's engine test."""

import json
import struct
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


def _float32_copy(dst: Path) -> Path:
    """The demo as a float32 checkpoint (what the SmolLM2 twin is on MLX's CPU): its bf16
    tensors widened exactly (a bf16 value is a float32's upper 16 bits), in pure Python."""
    import numpy as np

    src = TINY_MODEL / "model.safetensors"
    with open(src, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header, data = json.loads(fh.read(n)), fh.read()
    out_header, chunks, at = {}, [], 0
    for name, t in header.items():
        if name == "__metadata__":
            out_header[name] = t
            continue
        raw = data[t["data_offsets"][0] : t["data_offsets"][1]]
        if t["dtype"] == "BF16":
            raw = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()
        chunks.append(raw)
        out_header[name] = {**t, "dtype": "F32" if t["dtype"] == "BF16" else t["dtype"]}
        out_header[name]["data_offsets"] = [at, at + len(raw)]
        at += len(raw)
    dst.mkdir()
    head = json.dumps(out_header).encode()
    head += b" " * (-len(head) % 8)
    payload = struct.pack("<Q", len(head)) + head + b"".join(chunks)
    (dst / "model.safetensors").write_bytes(payload)
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    for f in (*names, "latent-rotation.safetensors"):  # the calibration: the same int2 row
        (dst / f).write_bytes((TINY_MODEL / f).read_bytes())
    return dst


def test_mlx_lm_figures_follow_a_float32_checkpoint(tmp_path):
    f32 = _float32_copy(tmp_path / "f32")
    assert (host.checkpoint_bytes(f32), host.checkpoint_bytes(TINY_MODEL)) == (4, 2)
    bf16, wide = inspect_source(str(TINY_MODEL)), inspect_source(str(f32))
    lay = bf16.layouts["mlx/bf16"]
    assert wide.layouts["mlx/bf16"].per_token == 2 * lay.per_token
    assert wide.mtp_layouts["mlx/bf16"].per_token == 2 * bf16.mtp_layouts["mlx/bf16"].per_token
    for k in ("llama.cpp/f16", "macserve/int2"):  # their own types; INT2 codes from bf16
        assert wide.layouts[k].per_token == bf16.layouts[k].per_token, k
    assert any("float32" in n for n in wide.notes) and not any("float32" in n for n in bf16.notes)
    assert report_of(wide)["rows_dtype"] == "float32" and report_of(bf16)["rows_dtype"] == "bf16"
    # mlx_lm.server holds them so on either host; the engine too on a GPU (the checkpoint's
    # dtype), and on a CPU it is float32 already: counted once, not widened again
    at = 2 * lay.bytes_at(512)
    for dev in (host.CPU, host.GPU):
        assert share.share_of(_profile("mlx", f32), device=dev).kv_bytes == at
        s = share.share_of(_profile(model=f32, KV="bf16"), device=dev)
        assert (s.kv_bytes, s.weights_bytes) == (at, wide.weights_bytes)


def test_new_ctx_auto_fits_what_the_engine_holds_on_this_host():
    from macserve.services.plan import plan
    from macserve.sizing.budget import machine_budget
    from macserve.sizing.kv_layout import max_context

    rep = inspect_source(str(TINY_MODEL))
    lay = rep.layouts["mlx/bf16"]
    cpu_lay = host.host_layout(lay, host.CPU)
    cpu_weights = host.host_weights(rep.weights_bytes, TINY_MODEL, host.CPU)
    # a machine whose budget holds the float32 weights and 256 float32 tokens: all 1,024 in bf16
    memory = 3 * (cpu_weights + cpu_lay.bytes_at(256)) // 2 + 3
    budget = machine_budget(memory).budget_bytes
    args = dict(provider="macserve", kv="bf16", memory_bytes=memory)
    gpu, cpu = (plan(str(TINY_MODEL), **args, device=d) for d in (host.GPU, host.CPU))
    assert gpu.n_ctx == max_context(rep.shape, "mlx/bf16", budget, rep.weights_bytes, 1, lay)
    assert cpu.n_ctx == max_context(rep.shape, "mlx/bf16", budget, cpu_weights, 1, cpu_lay)
    assert 0 < cpu.n_ctx < gpu.n_ctx == rep.shape.max_position_embeddings
    # mlx_lm.server keeps the checkpoint's bf16 on either host: inspect's own figure
    mlx = [
        plan(str(TINY_MODEL), provider="mlx", memory_bytes=memory, device=d)
        for d in (host.CPU, host.GPU)
    ]
    assert mlx[0].n_ctx == mlx[1].n_ctx == gpu.n_ctx


@pytest.mark.model
def test_mlx_lm_caches_hold_the_checkpoint_dtype_and_the_log_says_the_engines(tmp_path, bundle):
    """The real thing: mlx-lm's caches after a prefill, in the dtype `checkpoint_bytes` reads
    (the demo's bf16, its float32 copy's float32); the engine's log line says what its own
    caches hold after its loader's cast."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from macserve.engine.model import computes_float32

    for folder in (TINY_MODEL, _float32_copy(tmp_path / "f32")):
        model, _ = load_model(Path(folder))
        caches = make_prompt_cache(model)
        model(mx.array([[1, 2, 3, 4]]), cache=caches)
        assert caches[0].state[0].dtype.size == host.checkpoint_bytes(folder), folder
    caches = bundle.caches()
    bundle.model(mx.array([[1, 2, 3, 4]]), cache=caches)
    held = str(caches[0].state[0].dtype).rsplit(".", 1)[-1]
    summary = bundle.kv_plan()["summary"]
    where = "on this CPU host" if computes_float32() else "(the checkpoint's dtype)"
    assert summary.endswith(f"(--kv bf16), held in {held} {where}"), summary
