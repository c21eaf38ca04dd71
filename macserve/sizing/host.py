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
checkpoint's dtype (mlx-lm's `load` casts nothing), llama-server stores its f16 (or
quantized) cache. Only the engine's figures move (the share's `host_layout`, inspect's line).

`mlx_device()` says where MLX computes by default here without importing mlx (0.3 s: inspect
and `ls` never load it): Apple silicon runs Metal (a GPU); elsewhere only a CUDA build of MLX
(`mlx[cuda]`: an `mlx-cuda-*` package) has a GPU, and `mlx[cpu]` (this Linux box) is the CPU.
Every function takes `device` ("cpu" | "gpu") so a test can ask for either host; None: this
one. tests/test_share_host.py checks `mlx_device()` against MLX's own default device.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import struct
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

from .kv_buffers import Layout

CPU, GPU = "cpu", "gpu"
# MLX's CUDA backends: what mlx's extras cuda, cuda12 and cuda13 install (its metadata)
CUDA_DISTS = ("mlx-cuda-12", "mlx-cuda-13")
HALF = ("BF16", "F16")  # safetensors dtypes the CPU rule widens to float32 (twice the bytes)
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


def host_layout(lay: Layout, device: str | None = None) -> Layout:
    """The engine's buffers on `device`: on a CPU those held in the model's compute dtype
    (counted at bf16) at float32's bytes, twice; on a GPU `lay` as it is."""
    if not engine_float32(device) or not lay.supported:
        return lay
    bufs = [replace(b, row=2 * b.row) if b.model_dtype else b for b in lay.buffers]
    return replace(lay, buffers=bufs)


def half_weight_bytes(folder: str | Path | None) -> int:
    """Bytes of a local model folder's bf16/f16 tensors (from its safetensors headers: the
    weights are never read); 0 when there is no such folder or file."""
    if folder is None:
        return 0
    path = Path(folder)
    if not path.is_dir():
        path = path.parent
    total = 0
    for f in path.glob("*.safetensors"):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue  # not a readable safetensors file: counted as it is on disk
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict) and t.get("dtype") in HALF:
                begin, end = t.get("data_offsets", (0, 0))
                total += end - begin
    return total


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
