"""This host as the engine's bytes see it: the dtype macserve's engine computes in here.

The rule (engine/model.py's `computes_float32`, which `load`, the one loader, and
engine/bench/setup.py apply; `engine_float32` here mirrors it, since the engine imports no
sizing and sizing imports no mlx, and tests/test_share_host.py checks the two agree): when
MLX's default device is the CPU, the model is cast to float32, because MLX's CPU `gather_mm`
(MoE experts) runs only in float32; on a GPU it keeps the checkpoint's own dtype. So on a CPU
host the engine holds in float32 (4 B a value) what inspect counts at bf16's 2 B (a Mac's
figure, and a checkpoint's): the weights' half-precision tensors, and every cache array
that takes the activations' dtype (mlx-lm's K/V rows, conv tails: `Buffer.model_dtype`). The
INT2 latent cache stores its rows from bf16 whatever the model computes in (engine/rows.py),
and recurrent states are float32 anyway: those figures hold on both hosts.

The other servers keep their own dtypes, on either device: mlx_lm.server computes in the
checkpoint's dtype (mlx-lm's `load` casts nothing: its arrays keep the safetensors' dtypes,
and config.json's `torch_dtype` is read only by mlx-lm's convert), llama-server stores its
f16 (or quantized) cache. So a float32 checkpoint (the SmolLM2 twin on MLX's CPU) holds
float32 caches under mlx-lm wherever it runs: `checkpoint_bytes` reads that from the
safetensors headers, and inspect's mlx-lm rows (report.py) count it; the engine on a GPU
keeps it too. `held` is the one rule the share and `new --ctx auto` size a provider by.

`mlx_device()` says where MLX computes by default here without importing mlx (0.3 s: inspect
and `ls` never load it): Apple silicon runs Metal (a GPU); elsewhere only a CUDA build of MLX
(`mlx[cuda]`: an `mlx-cuda-*` package) has a GPU, and `mlx[cpu]` (this Linux box) is the CPU.
Every function takes `device` ("cpu" | "gpu") so a test can ask for either host; None: this
one. tests/test_share_host.py checks `mlx_device()` against MLX's own default device.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .kv_buffers import Layout

CPU, GPU = "cpu", "gpu"
# MLX's CUDA backends: what mlx's extras cuda, cuda12 and cuda13 install (its metadata)
CUDA_DISTS = ("mlx-cuda-12", "mlx-cuda-13")
HALF = ("BF16", "F16")  # safetensors dtypes the CPU rule widens to float32 (twice the bytes)
FLOAT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}  # safetensors' floating dtypes MLX computes in
FLOAT32 = 4
DTYPE_NAMES = {4: "float32", 2: "bf16"}  # what a count at these bytes is said as
LABEL = "float32 on this CPU host"  # where a user reads it: inspect, ls, the share's note


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@cache
def mlx_device() -> str:
    """Where MLX computes by default on this host: "gpu" (Metal on Apple silicon, or a CUDA
    build of MLX) or "cpu"."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return GPU
    return GPU if any(_installed(d) for d in CUDA_DISTS) else CPU


def engine_float32(device: str | None = None) -> bool:
    """The engine's loader's rule: float32 when MLX computes on the CPU, else the model's own."""
    return (device or mlx_device()) == CPU


def widen(lay: Layout, value_bytes: int) -> Layout:
    """`lay` with its buffers in the model's compute dtype counted at `value_bytes` a value
    (from the `model_bytes` they are counted at); the others (fp32 states, INT2 codes) as
    they are."""
    if not lay.supported or lay.model_bytes == value_bytes:
        return lay
    bufs = [
        replace(b, row=b.row * value_bytes // lay.model_bytes) if b.model_dtype else b
        for b in lay.buffers
    ]
    return replace(lay, buffers=bufs, model_bytes=value_bytes)


def host_layout(lay: Layout, device: str | None = None) -> Layout:
    """The engine's buffers on `device`: on a CPU those held in the model's compute dtype at
    float32's bytes; on a GPU `lay` as it is (in the checkpoint's dtype: report.py)."""
    if not engine_float32(device):
        return lay
    return widen(lay, FLOAT32)


def _tensors(folder: str | Path | None, pattern: str = "*.safetensors"):
    """(dtype, bytes) of each floating tensor in a local model folder's safetensors files
    matching `pattern`, from their headers; none without such files."""
    if folder is None:
        return
    path = Path(folder)
    if not path.is_dir():
        path = path.parent
    for f in sorted(path.glob(pattern)):
        try:
            st = f.stat()
        except OSError:
            continue
        yield from _file_tensors(str(f), st.st_mtime_ns, st.st_size)


@cache
def _file_tensors(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, int], ...]:
    """One file's floating tensors, read once per version of the file (inspect, the share and
    the router's ledger ask for the same folder many times; safetensors maps the file, and no
    weight is read). Not a readable safetensors file: none (counted as it is on disk)."""
    try:
        with safe_open(path, "numpy") as st:
            names = st.keys()  # a safe_open is not iterable
            shapes = [(st.get_slice(k).get_dtype(), st.get_slice(k).get_shape()) for k in names]
    except (OSError, ValueError, SafetensorError):
        return ()
    return tuple(
        (dtype, math.prod(shape) * FLOAT_BYTES[dtype])
        for dtype, shape in shapes
        if dtype in FLOAT_BYTES
    )


def half_weight_bytes(folder: str | Path | None) -> int:
    """Bytes of a local model folder's bf16/f16 tensors; 0 when there is no such folder or
    file."""
    return sum(n for dtype, n in _tensors(folder) if dtype in HALF)


def checkpoint_bytes(folder: str | Path | None) -> int | None:
    """Bytes a value of the dtype mlx-lm computes a local checkpoint in: that of most of the
    floating bytes in the `model*.safetensors` files mlx-lm's `load_model` reads (a quantized
    checkpoint's scales; a stray float32 tensor such as DeepSeek's router bias, which the
    activations never meet, does not decide it). None: no such files (not a local folder).
    A checkpoint mixing float32 norms into bf16 weights would compute in float32 (MLX
    promotes) and is counted at its bf16 here."""
    by: dict[int, int] = {}
    for dtype, n in _tensors(folder, "model*.safetensors"):
        by[FLOAT_BYTES[dtype]] = by.get(FLOAT_BYTES[dtype], 0) + n
    return max(by, key=lambda b: (by[b], b)) if by else None


def held(
    lay: Layout | None,
    weights: int | None,
    folder: str | None,
    float32_on_cpu: bool,
    device: str | None = None,
) -> tuple[Layout | None, int | None, str | None]:
    """What a server holds on `device` for a cache whose inspect figures (`lay`, the
    checkpoint's own dtype) and `weights` (the files) are given: (layout, weights bytes, the
    dtype said where it is the host's, else None). `float32_on_cpu`: the server casts the
    model to float32 on MLX's CPU (the engine: its providers' flag); the others hold the
    checkpoint's dtype anywhere. The share and `new --ctx auto` both size by this."""
    if not (float32_on_cpu and engine_float32(device)):
        return lay, weights, None
    return lay and host_layout(lay, device), host_weights(weights, folder, device), LABEL


def host_weights(weights: int | None, folder, device: str | None = None) -> int | None:
    """The engine's weights on `device`: on a CPU, the half-precision tensors widened to
    float32 (quantized codes stay as they are); on a GPU, the files' bytes."""
    if weights is None or not engine_float32(device):
        return weights
    return weights + half_weight_bytes(folder)


def engine_on_host(
    layouts: dict, weights: int | None, local_path: str | None, device: str | None = None
) -> dict | None:
    """What the engine holds on `device` for a local model folder (the only source it serves)
    where that differs from the figures counted in bf16: inspect's line and `--json`'s
    `engine_host`. None on a GPU, or for a source that is no local folder of weights."""
    if not engine_float32(device) or local_path is None or weights is None:
        return None
    if not Path(local_path).is_dir():
        return None
    per_token = {}
    for key, lay in layouts.items():
        if lay.supported and key.split("/")[0] in ("mlx", "macserve"):
            t = host_layout(lay, device).per_token
            per_token[key] = int(t) if t.denominator == 1 else round(float(t), 3)
    return {
        "device": CPU,
        "dtype": "float32",
        "label": LABEL,
        "weights_bytes": host_weights(weights, local_path, device),
        "kv_bytes_per_token": per_token,
    }
