"""The latent-cache gate: per MLA layer, the cheapest storage format whose functional error
meets a target, with the rotation that does best in that format (docs/int2-latent-cache.md).

Functional error, of a format F and rotation R on one layer (latents c, error e = ĉ - c
where ĉ is c rotated, clipped, stored in F and rotated back):

    score term   E[eᵀ Σq e] / E[cᵀ Σq c]     Σq = Σ_h E[q~_h q~_hᵀ], the absorbed queries
    output term  E[eᵀ M_v e] / E[cᵀ M_v c]   M_v = Σ_h (W_O,h W_UV,h)ᵀ(W_O,h W_UV,h)
    error        score term + output term

Each term is the error's power over the signal's power after the up-projection it passes
through (the scores q~·c, the output W_O W_UV c), so it has no units and layers and models
compare. It is per cached token, before the softmax averages errors over tokens, so it is an
upper bound on what one layer's output sees. Clips are fitted on half of the calibration
sample and the error is measured on the other half, so a clip cannot fit its own test rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from .. import int2_format
from ..int2_format import INT2, LatentQuant
from .calibration import Calibration, LayerStats, fit_clip, rotation

# Rotations tried per format; "eigen" (contiguous ascending groups) is left out: measured
# worst on the demo (docs/int2-latent-cache.md) and it cannot win where the others lose.
# "eigen-hadamard" is fitted per format like the others: its Hadamard blocks are the format's
# groups, so it differs between g64 and g128.
ROTATIONS = ("plain", "hadamard", "eigen-interleave", "upproj", "eigen-hadamard")


@dataclass(frozen=True)
class Format:
    name: str
    bits: int | None  # None: bf16, stored as is
    group_size: int = 64

    def quant(self) -> LatentQuant:
        return replace(INT2, bits=self.bits, group_size=self.group_size)

    def bytes_per_token(self, latent_dims: int, rope_dims: int) -> int:
        return self.quant().row_bytes(latent_dims, rope_dims)


FORMATS = tuple(Format(n, b, g) for n, (b, g) in int2_format.FORMATS.items())
BY_NAME = {f.name: f for f in FORMATS}
# Chosen from the two measured models (docs/int2-latent-cache.md, "The gate"): the demo's
# worst layer under uniform INT2 g64 upproj measures 0.015 (bench kv at the default window:
# KL 0.0005, ΔPPL +0.11 %), so 0.02 keeps every demo layer at INT2 with a 1.3x margin; the
# hard case's best INT2 is 0.08 on its rank-8 layers and 0.22 on its full-rank ones, 4x and
# 11x over it. Tests hold the plan to this target itself on held-out text (tests/test_gate.py).
DEFAULT_TARGET = 0.02


def spectrum_shares(sigma_c: np.ndarray, tops=(1, 10, 64)) -> dict[str, float]:
    """Share of the latent's variance in its top-k eigen-directions."""
    ev = np.sort(np.maximum(np.linalg.eigvalsh(sigma_c), 0))[::-1]
    total = ev.sum() or 1.0
    return {f"top{k}": float(ev[:k].sum() / total) for k in tops}


def _store(u: np.ndarray, fmt: Format) -> np.ndarray:
    """u as the cache stores and reads it: bf16, then (if quantized) affine codes."""
    x = mx.array(u.astype(np.float32)).astype(mx.bfloat16)
    if fmt.bits is not None:
        g = fmt.group_size
        x = mx.dequantize(*mx.quantize(x, group_size=g, bits=fmt.bits), group_size=g, bits=fmt.bits)
    return np.array(x.astype(mx.float32), dtype=np.float64)


def functional_error(
    st: LayerStats, rot: np.ndarray, clip: np.ndarray | None, fmt: Format, held: np.ndarray
) -> tuple[float, float]:
    """(score term, output term) of storing `held` latents rotated by `rot` in `fmt`."""
    u = held @ rot
    e = (_store(u if clip is None else np.clip(u, -clip, clip), fmt) - u) @ rot.T
    terms = []
    for w in (st.sigma_q, st.m_v):
        signal = np.einsum("nr,rs,ns->", held, w, held)
        terms.append(float(np.einsum("nr,rs,ns->", e, w, e) / max(signal, 1e-30)))
    return terms[0], terms[1]


@dataclass
class LayerGate:
    spectrum: dict[str, float]
    errors: dict[str, dict[str, float]]  # format -> rotation -> functional error
    terms: dict[str, dict[str, tuple[float, float]]]  # the same, (score, output)
    choice: str
    rotation: str
    bytes_per_token: int
    fitted: dict[str, tuple[np.ndarray, np.ndarray | None]]  # (format, rotation) key -> R, clip


def gate_layer(
    st: LayerStats,
    target: float,
    rope_dims: int,
    seed: int,
    formats=FORMATS,
    rotations=ROTATIONS,
) -> LayerGate:
    r = st.sigma_c.shape[0]
    fit_half = replace(st, sample=st.sample[0::2])
    held = st.sample[1::2].astype(np.float64)
    errors, terms, fitted = {}, {}, {}
    for fmt in formats:
        if fmt.bits is not None and r % fmt.group_size:
            continue  # mx.quantize needs whole groups
        errors[fmt.name], terms[fmt.name] = {}, {}
        # bf16 has no codes to rotate for: only its rounding, the same for any rotation.
        for m in rotations if fmt.bits is not None else ("plain",):
            rot = rotation(st, m, fmt.group_size, seed=seed)
            clip = None
            if m != "plain" and fmt.bits is not None:
                clip = fit_clip(fit_half, rot, fmt.quant(), weighted=(m == "upproj"))
            t = functional_error(st, rot, clip, fmt, held)
            terms[fmt.name][m] = t
            errors[fmt.name][m] = t[0] + t[1]
            fitted[f"{fmt.name}/{m}"] = (rot, clip)
    # Cheapest first; bf16 is the widest and the fallback when nothing meets the target.
    ranked = sorted(errors, key=lambda n: BY_NAME[n].bytes_per_token(r, rope_dims))
    choice = next(
        (n for n in ranked if min(errors[n].values()) <= target),
        "bf16" if "bf16" in errors else ranked[-1],
    )
    best = min(errors[choice], key=errors[choice].get)
    return LayerGate(
        spectrum_shares(st.sigma_c),
        errors,
        terms,
        choice,
        best,
        BY_NAME[choice].bytes_per_token(r, rope_dims),
        fitted,
    )


def gate(
    stats: list[LayerStats], rope_dims: int, target: float = DEFAULT_TARGET
) -> list[LayerGate]:
    return [gate_layer(st, target, rope_dims, seed=i) for i, st in enumerate(stats)]


def attach(cal: Calibration, layers: list[LayerGate], target: float) -> None:
    """Write the plan into the calibration: per layer the chosen rotation and clip as method
    "gate", and in its metadata the target, the choice and every measured error."""
    cal.rotations["gate"], cal.clips["gate"] = [], []
    for lg in layers:
        rot, clip = lg.fitted[f"{lg.choice}/{lg.rotation}"]
        cal.rotations["gate"].append(rot)
        cal.clips["gate"].append(clip)
    cal.meta["methods"] = list(cal.rotations)
    cal.meta["gate"] = report(layers, target)


def report(layers: list[LayerGate], target: float) -> dict:
    """What `calibrate --json` prints and the file keeps."""
    rows = [
        {
            "layer": i,
            "spectrum": lg.spectrum,
            "errors": lg.errors,
            "score_output_terms": {
                f: {m: list(t) for m, t in v.items()} for f, v in lg.terms.items()
            },
            "choice": lg.choice,
            "rotation": lg.rotation,
            "bytes_per_token": lg.bytes_per_token,
        }
        for i, lg in enumerate(layers)
    ]
    counts: dict[str, int] = {}
    for lg in layers:
        counts[lg.choice] = counts.get(lg.choice, 0) + 1
    return {
        "target": target,
        "definition": "score + output relative error power per cached token (engine/gate.py)",
        "layers": rows,
        "plan": counts,
        "bytes_per_token": sum(lg.bytes_per_token for lg in layers),
    }
