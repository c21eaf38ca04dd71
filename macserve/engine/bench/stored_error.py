"""`bench kv`'s check of the gate on held-out text: per MLA layer, the functional error
(engine/gate.py's definition: score term through the absorbed queries plus output term
through W_O W_UV) that what a cache actually stored causes, read from the real cache objects.

The gate predicts each layer's error from half of the calibration sample; this measures it on
text calibration never saw, through the caches serve builds (the plan's format and rotation
per layer, clipped, quantized, read back by `dequantized`). Only the code rows count, as in
the gate: the bf16 sink and recent window hold what was appended.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .. import mla_attention
from ..caches import latent_caches
from ..calibration import value_weight


class StoredError:
    """Accumulates, over windows, each layer's appended latents against what its cache holds."""

    def __init__(self, model):
        self.attns = mla_attention.mla_attentions(model)
        self.m_v = [value_weight(a) for a in self.attns]
        r = self.attns[0].kv_lora_rank
        # Σ_h q~ q~ᵀ summed, not averaged: each term is a ratio, its scale cancels.
        self.sigma_q = [np.zeros((r, r)) for _ in self.attns]
        self.c: list[list[np.ndarray]] = [[] for _ in self.attns]  # appended latents
        self.e: list[list[np.ndarray]] = [[] for _ in self.attns]  # stored - appended
        self._seen: list[list[np.ndarray]] = []

    @contextmanager
    def watching(self):
        """Record each layer's latents (and its absorbed queries' second moment) while the
        caches of one window are filled."""
        self._seen = [[] for _ in self.attns]

        def observer_for(i):
            def observe(q_lat, latent):
                c = np.array(latent.reshape(-1, latent.shape[-1]).astype(mx.float32))
                q = np.array(q_lat.astype(mx.float32))  # (B, H, L, r)
                q = q.transpose(0, 2, 1, 3).reshape(-1, q.shape[-1])
                self.sigma_q[i] += q.T.astype(np.float64) @ q
                self._seen[i].append(c)

            return observe

        for i, a in enumerate(self.attns):
            a._observer = observer_for(i)
        try:
            yield
        finally:
            for a in self.attns:
                a._observer = None

    def add(self, caches) -> None:
        """After a window went through `caches` under `watching`: keep its code rows."""
        for i, cache in enumerate(latent_caches(caches)):
            c = np.concatenate(self._seen[i]).astype(np.float64)
            if not cache.quantized or cache.codes_lat.length == 0:
                continue
            stored = np.array(cache.dequantized()[0][0, 0], dtype=np.float64)
            rows = slice(cache.quant.sink, cache.codes_end)
            self.c[i].append(c[rows])
            self.e[i].append(stored[rows] - c[rows])

    def errors(self) -> list[float]:
        """Per layer, score term + output term (0 for a layer that held no codes)."""
        out = []
        for i in range(len(self.attns)):
            if not self.c[i]:
                out.append(0.0)
                continue
            c, e = np.concatenate(self.c[i]), np.concatenate(self.e[i])
            total = 0.0
            for w in (self.sigma_q[i], self.m_v[i]):
                signal = np.einsum("nr,rs,ns->", c, w, c)
                total += float(np.einsum("nr,rs,ns->", e, w, e) / max(signal, 1e-30))
            out.append(total)
        return out
