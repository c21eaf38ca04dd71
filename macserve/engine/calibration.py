"""Calibration for the rotated latent cache: statistics per MLA layer, rotations, clip thresholds.

Statistics (over calibration text, teacher-forced in chunks):
  sigma_c  E[c c^T]                 the latent's covariance (what the eigen-rotation diagonalizes)
  sigma_q  sum_h E[q~_h q~_h^T]      the absorbed queries' second moment: how a latent error
                                     moves the scores (q~ = embed_q(q_nope), as mlx-lm computes)
  m_v      sum_h (W_O,h W_UV,h)^T (W_O,h W_UV,h)   how a latent error moves the layer output

Methods (each gives per layer an orthogonal R, columns = directions, and a clip per direction):
  plain             R = I, no clip: per-token INT2, the naive baseline
  hadamard          a random-sign Hadamard (QuaRot), clip fitted
  eigen             eigenvectors of sigma_c in ascending variance, contiguous groups: quiet
                    directions share a group, so loud ones cannot blow up their scale
  eigen-interleave  the same directions dealt round-robin over groups (OSCAR's order)
  upproj            eigen directions ranked by what their error costs after the
                    up-projections (variance x weight, weight = e^T W e with
                    W = sigma_q/tr + m_v/tr), dealt round-robin over groups, and clips
                    fitted on the W-weighted error
  eigen-hadamard    eigen directions in descending variance, placed by a bit-reversal
                    interleave (each group gets an even share of loud and quiet ones),
                    then a Hadamard within each group (every coordinate of a group then
                    carries the group's mean variance): OSCAR's covariance + interleave +
                    per-group Hadamard. Scored per format by the gate (engine/gate.py)
                    and stored as its choice; not in METHODS (what `fit` stores per
                    method and `bench kv` rows over) because the shipped file predates it
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..int2_format import BF16_LATENT, CachePlan, LatentQuant, plan_from_meta
from . import mla_attention
from .caches import make_caches, model_dtype

METHODS = ("plain", "hadamard", "eigen", "eigen-interleave", "upproj")
# Every rotation `rotation` knows: METHODS and the ones only the gate scores.
ROTATION_NAMES = (*METHODS, "eigen-hadamard")
# The shipped default is whichever `macserve bench kv` measured best on KL (docs/int2-latent-cache.md).
DEFAULT_METHOD = "upproj"
CLIP_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
SAMPLE = 8192  # latents kept per layer for fitting clips


@dataclass
class LayerStats:
    sigma_c: np.ndarray
    sigma_q: np.ndarray
    m_v: np.ndarray
    sample: np.ndarray  # (n, r) latents
    tokens: int


@dataclass
class Calibration:
    """Per method, per layer: rotation (r, r) and clip (r,). Loaded from / saved to safetensors."""

    rotations: dict[str, list[np.ndarray]]
    clips: dict[str, list[np.ndarray | None]]
    meta: dict = field(default_factory=dict)
    _arrays: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def default_method(self) -> str:
        """ "gate" (a format and rotation per layer) when calibrate's gate wrote a plan, else
        the file's one method."""
        if "gate" in self.rotations and self.meta.get("gate"):
            return "gate"
        return self.meta.get("default", DEFAULT_METHOD)

    def plan(self) -> CachePlan:
        """What the file says each layer stores (int2_format.plan_from_meta)."""
        return plan_from_meta(self.meta)

    def quants(self, method: str, base: LatentQuant) -> LatentQuant | list[LatentQuant]:
        """The format(s) `method`'s caches use: the gate's per layer, else `base` for all."""
        return self.plan().quants(base) if method == "gate" else base

    def for_method(
        self, method: str, dtype=mx.float32
    ) -> tuple[list[mx.array | None], list[mx.array | None]]:
        """Per layer (rotation, clip) as arrays of `dtype` (the model's: a float32 rotation
        would turn a bf16 model's activations float32), made once and shared by every cache
        built from this calibration."""
        if method not in self.rotations:
            raise KeyError(
                f"method {method!r} not in this calibration ({', '.join(self.rotations)})"
            )
        key = (method, dtype)
        if key not in self._arrays:
            # No rotation where the method's is the identity: plain, and the gate's layers
            # whose chosen rotation is plain (bf16 among them).
            plain = [method == "plain"] * len(self.rotations[method])
            if method == "gate":
                plain = [lp.rotation == "plain" for lp in self.plan().layers]
            rots = [
                None if p else mx.array(r).astype(dtype)
                for r, p in zip(self.rotations[method], plain)
            ]
            clips = [None if c is None else mx.array(c).astype(dtype) for c in self.clips[method]]
            mx.eval([a for a in rots + clips if a is not None])
            self._arrays[key] = (rots, clips)
        return self._arrays[key]

    def save(self, path: str | Path) -> None:
        tensors = {}
        for m in self.rotations:
            for i, r in enumerate(self.rotations[m]):
                tensors[f"{m}.layers.{i}.rotation"] = mx.array(r.astype(np.float32))
                if self.clips[m][i] is not None:
                    tensors[f"{m}.layers.{i}.clip"] = mx.array(self.clips[m][i].astype(np.float32))
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.safetensors")
        mx.save_safetensors(str(tmp), tensors, metadata={"macserve": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            tensors, meta = mx.load(str(path), return_metadata=True)
            info = json.loads(meta["macserve"])
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to a user
            raise ValueError(f"{path}: not a macserve calibration file ({e})") from None
        n = info["layers"]
        rotations, clips = {}, {}
        for m in info["methods"]:
            rotations[m] = [np.array(tensors[f"{m}.layers.{i}.rotation"]) for i in range(n)]
            clips[m] = [
                np.array(tensors[k]) if (k := f"{m}.layers.{i}.clip") in tensors else None
                for i in range(n)
            ]
        return cls(rotations, clips, info)


def caches_for(
    model, quant: LatentQuant, calibration: Calibration | None = None, method: str | None = None
) -> list:
    """Caches in `quant`'s format with `calibration`'s rotations for `method` (None or plain:
    unrotated; a bf16 quant ignores the calibration). Method "gate": per layer the format
    and rotation the file's gate chose (`quant` gives the windows and the rotary key's bits)."""
    if not quant.quantized or method in (None, "plain"):
        return make_caches(model, quant)
    if calibration is None:
        raise ValueError(
            f"--kv with rotation {method!r} needs a calibration file (macserve calibrate)"
        )
    rots, clips = calibration.for_method(method, model_dtype(model))
    return make_caches(model, calibration.quants(method, quant), rots, clips)


def collect(model, windows: list[np.ndarray], chunk: int = 256, progress=None) -> list[LayerStats]:
    """Run the model over token windows through a bf16 latent cache, observing every layer."""
    attns = mla_attention.mla_attentions(model)
    mla_attention.install(model)
    r = attns[0].kv_lora_rank
    acc = [dict(c=np.zeros((r, r)), q=np.zeros((r, r)), n=0, nq=0, sample=[]) for _ in attns]
    rng = np.random.default_rng(0)
    per_window = max(1, SAMPLE // max(1, len(windows)))

    def observer_for(i):
        def observe(q_lat, latent):
            c = np.array(latent.reshape(-1, latent.shape[-1]).astype(mx.float32))
            q = np.array(q_lat.astype(mx.float32))  # (B, H, L, r)
            q = q.transpose(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[-1])  # (tokens, H, r)
            a = acc[i]
            a["c"] += c.T @ c
            a["q"] += np.einsum("thr,ths->rs", q, q)
            a["n"] += len(c)
            a["nq"] += len(q)
            a["window"].append(c)

        return observe

    for i, a in enumerate(attns):
        a._observer = observer_for(i)
    try:
        for w_i, w in enumerate(windows):
            caches = make_caches(model, BF16_LATENT)
            for a in acc:
                a["window"] = []
            for s in range(0, len(w), chunk):
                mx.eval(model(mx.array(w[None, s : s + chunk]), cache=caches))
            for a in acc:
                c = np.concatenate(a.pop("window"))
                take = rng.choice(len(c), size=min(per_window, len(c)), replace=False)
                a["sample"].append(c[np.sort(take)])
            if progress:
                progress(w_i + 1, len(windows))
    finally:
        for a in attns:
            a._observer = None
    out = []
    for a, attn in zip(acc, attns):
        out.append(
            LayerStats(
                a["c"] / a["n"],
                a["q"] / a["nq"],
                value_weight(attn),
                np.concatenate(a["sample"]),
                a["n"],
            )
        )
    return out


def value_weight(attn) -> np.ndarray:
    """sum_h (W_O,h W_UV,h)^T (W_O,h W_UV,h): the output's sensitivity to a latent error."""
    w_uv = np.array(attn.unembed_out.weight.astype(mx.float32))  # (H, v, r)
    w_o = np.array(attn.o_proj.weight.astype(mx.float32))  # (hidden, H * v)
    H, v, r = w_uv.shape
    m = np.zeros((r, r))
    for h in range(H):
        a = w_o[:, h * v : (h + 1) * v] @ w_uv[h]  # (hidden, r)
        m += a.T @ a
    return m


def hadamard(r: int, seed: int) -> np.ndarray:
    if r & (r - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two rank, not {r}")
    h = np.array([[1.0]])
    while h.shape[0] < r:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=r)
    return (h * signs[None, :]) / np.sqrt(r)


def bit_reversal(n: int) -> list[int]:
    """0..n-1 in the order of their bit-reversed indices (over ceil(log2 n) bits, so any n):
    for n = 2^k, position p holds bitrev(p), and for m = 2^j groups the block of n/m
    consecutive positions k holds the indices of one residue mod m: an even share of ranks."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def eigen_hadamard(sigma_c: np.ndarray, group: int, seed: int) -> np.ndarray:
    """Σc's eigenvectors, loudest first, bit-reversal interleaved over the groups, then a
    random-sign Hadamard within each group: R = V[:, bitrev] · blockdiag(H_g, ...), a
    product of orthogonal matrices. Within a group the Hadamard gives every coordinate the
    mean variance of the group's directions (its entries are ±1/√g and eigen-directions are
    uncorrelated), so no quiet coordinate shares a scale with a loud one."""
    r = sigma_c.shape[0]
    if r % group:
        raise ValueError(f"eigen-hadamard needs whole groups: rank {r}, group {group}")
    vec = np.linalg.eigh(sigma_c)[1][:, ::-1]  # descending variance
    placed = vec[:, bit_reversal(r)]
    blocks = [hadamard(group, seed * 7919 + k) for k in range(r // group)]
    out = np.zeros_like(placed)
    for k, h in enumerate(blocks):
        sl = slice(k * group, (k + 1) * group)
        out[:, sl] = placed[:, sl] @ h
    return out


def _importance(st: LayerStats) -> np.ndarray:
    return st.sigma_q / np.trace(st.sigma_q) + st.m_v / np.trace(st.m_v)


def rotation(st: LayerStats, method: str, group: int, seed: int = 0) -> np.ndarray:
    r = st.sigma_c.shape[0]
    if method == "plain":
        return np.eye(r)
    if method == "hadamard":
        return hadamard(r, seed)
    if method == "eigen-hadamard":
        return eigen_hadamard(st.sigma_c, group, seed)
    lam, vec = np.linalg.eigh(st.sigma_c)  # ascending
    if method == "eigen":
        return vec
    if method == "eigen-interleave":
        g = r // group
        order = [j * g + k for k in range(g) for j in range(group)]
        return vec[:, order]
    if method == "upproj":
        # Rank directions by the error they cost downstream, then deal them over groups.
        w = np.einsum("rd,rs,sd->d", vec, _importance(st), vec)
        ranked = vec[:, np.argsort(np.maximum(lam, 0) * w, kind="stable")]
        g = r // group
        return ranked[:, [j * g + k for k in range(g) for j in range(group)]]
    raise ValueError(f"unknown method {method!r} (known: {', '.join(ROTATION_NAMES)})")


def fit_clip(st: LayerStats, rot: np.ndarray, quant: LatentQuant, weighted: bool) -> np.ndarray:
    """Per group of directions, the fraction of its max |u| that minimizes the (weighted)
    quantize-dequantize error on the calibration sample."""
    u = st.sample @ rot
    peak = np.abs(u).max(axis=0) + 1e-12
    w = np.einsum("rd,rs,sd->d", rot, _importance(st), rot) if weighted else np.ones(len(peak))
    g = quant.group_size
    best = np.ones(len(peak))
    err_by_alpha = []
    for alpha in CLIP_GRID:
        t = peak * alpha
        uc = np.clip(u, -t, t)
        x = mx.array(uc.astype(np.float32)).astype(mx.bfloat16)
        d = mx.dequantize(
            *mx.quantize(x, group_size=g, bits=quant.bits), group_size=g, bits=quant.bits
        )
        e = ((np.array(d.astype(mx.float32)) - u) ** 2).mean(axis=0) * w
        err_by_alpha.append(e.reshape(-1, g).sum(axis=1))
    choice = np.argmin(np.stack(err_by_alpha), axis=0)
    for k, a_i in enumerate(choice):
        best[k * g : (k + 1) * g] = CLIP_GRID[a_i]
    return peak * best


def fit(stats: list[LayerStats], quant: LatentQuant, methods=METHODS, meta=None) -> Calibration:
    rotations, clips = {}, {}
    for m in methods:
        rotations[m], clips[m] = [], []
        for i, st in enumerate(stats):
            rot = rotation(st, m, quant.group_size, seed=i)
            rotations[m].append(rot)
            clips[m].append(None if m == "plain" else fit_clip(st, rot, quant, m == "upproj"))
    info = dict(meta or {})
    info.update(
        {
            "layers": len(stats),
            "methods": list(methods),
            "bits": quant.bits,
            "group_size": quant.group_size,
            "calibration_tokens": stats[0].tokens,
            "default": DEFAULT_METHOD,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    return Calibration(rotations, clips, info)


def calibration_windows(tokenizer, text: str, windows: int, seq_len: int) -> list[np.ndarray]:
    """Up to `windows` token windows of `seq_len` spread over `text`."""
    ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    if len(ids) < seq_len:
        raise ValueError(
            f"calibration text has {len(ids)} tokens, fewer than one window ({seq_len})"
        )
    step = max(seq_len, (len(ids) - seq_len) // max(1, windows))
    return [ids[s : s + seq_len] for s in range(0, len(ids) - seq_len + 1, step)][:windows]
