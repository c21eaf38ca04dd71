"""The engine's one model loader: mlx-lm's model and tokenizer, ready for the INT2 cache.

    bundle = load("path/to/model")            # or load(path, split=[31, 30]) under mlx.launch
    caches = bundle.caches(CacheSpec.for_model(path, "int2"))

`load` applies the dtype rule once for every caller (serve, generate, calibrate, the benches):
on MLX's CPU backend the model runs in float32, because the CPU's `gather_mm` (MoE experts)
runs only in float32; on a GPU it keeps the checkpoint's dtype (`computes_float32`; a
profile's share counts it through sizing/host.py's mirror of it). Every MLA attention layer is
then patched to read `RotatedLatentCache` (mla_attention.install).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import sharded_load

from ..errors import MacserveError
from ..int2_format import CachePlan, LayerPlan
from . import mla_attention
from .caches import CacheSpec, formats, latent_caches
from .calibration import Calibration, caches_for
from .latent_cache import RotatedLatentCache
from .mtp_layer import MissingMTPWeights, load_mtp_layers, mtp_layer_count
from .pipeline import use_split


@dataclass
class Bundle:
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    path: Path
    _mtp: Any = None
    _mtp_checked: dict = field(default_factory=dict)  # mtp_problem's answer, found once
    _calibrations: dict = field(default_factory=dict)

    def mtp(self):
        """The MTP layer, loaded on first use (mlx-lm's loader drops it)."""
        if self._mtp is None:
            try:
                layers = load_mtp_layers(self.path, trunk=self.model)
            except MissingMTPWeights as e:
                raise MacserveError(str(e)) from None
            if not layers:
                raise MacserveError(f"{self.path}: the model has no MTP layer (--mtp-k needs one)")
            self._mtp = layers[0]
            self._mtp.set_dtype(self.model.model.embed_tokens.weight.dtype)
            mla_attention.install(self.model, extra=[self._mtp.self_attn])
            mx.eval(self._mtp.parameters())
        return self._mtp

    def mtp_problem(self) -> str | None:
        """Why this model cannot draft (no MTP layer, or its weights missing), or None once
        its MTP layer is loaded. Called at load, so a missing layer is said once, there."""
        if self._mtp is not None:
            return None
        if "problem" not in self._mtp_checked:
            problem = None
            if not mtp_layer_count(self.config):
                problem = f"{self.path.name}: the model has no MTP layer"
            else:
                try:
                    self.mtp()
                except MacserveError as e:
                    problem = str(e)
            self._mtp_checked["problem"] = problem
        return self._mtp_checked["problem"]

    def calibration(self, path: Path) -> Calibration:
        """A calibration file, read once per Bundle."""
        key = str(path)
        if key not in self._calibrations:
            try:
                self._calibrations[key] = Calibration.load(path)
            except ValueError as e:
                raise MacserveError(str(e)) from None
        return self._calibrations[key]

    def caches(self, spec: CacheSpec = CacheSpec()):
        """A fresh prompt cache: mlx-lm's own for bf16, the rotated latent cache for int2."""
        if not spec.kind.latent:
            return make_prompt_cache(self.model)
        cal = self.calibration(spec.rotation)
        try:
            return caches_for(self.model, spec.quant, cal, spec.method or cal.default_method)
        except ValueError as e:
            raise MacserveError(str(e)) from None

    def kv_plan(self, spec: CacheSpec = CacheSpec()) -> dict:
        """What `spec`'s caches store per layer, read from freshly built cache objects (so a
        setting that resolves to something else than meant shows): `summary` ("4 MLA layers:
        2 INT3 g64, 2 INT4 g64 (gated at 0.02)") and per layer its format and rotation."""
        caches = self.caches(spec)
        fmts = formats(caches)
        start = getattr(getattr(self.model, "model", None), "start_idx", 0) or 0
        if not spec.kind.latent:
            rows = [dict(layer=start + i, format=f, rotation="plain") for i, f in enumerate(fmts)]
            return dict(
                kind=str(spec.kind),
                calibration=None,
                summary=f"{len(fmts)} layers: {spec.kind.facts.summary} (--kv {spec.kind}), "
                + held_in(self.model),
                layers=rows,
            )
        cal = self.calibration(spec.rotation)
        method = spec.method or cal.default_method
        names = [lp.rotation for lp in cal.plan().layers] if method == "gate" else None
        rows = []
        for i, (f, c) in enumerate(zip(fmts, latent_caches(caches))):
            # "plain": stored unrotated (the method whose rotation is the identity)
            rot = "plain" if c.rotation is None else (names[start + i] if names else method)
            rows.append(dict(layer=start + i, format=f, rotation=rot))
        plan = CachePlan(
            tuple(LayerPlan(r["format"], r["rotation"]) for r in rows),
            gated=method == "gate",
            target=cal.meta.get("gate", {}).get("target"),
        )
        return dict(
            kind=str(spec.kind),
            calibration=str(spec.rotation),
            summary=plan.summary(),
            layers=rows,
        )

    def mtp_cache_factory(self, spec: CacheSpec = CacheSpec()):
        """What makes the MTP layer's cache: mlx-lm's KVCache, or with int2 the same INT2
        format as the trunk (unrotated: the calibration covers the trunk's layers)."""
        if not spec.kind.latent:
            return KVCache
        return lambda: RotatedLatentCache(spec.quant)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def require_mla(self) -> Bundle:
        if not mla_attention.mla_attentions(self.model):
            raise MacserveError(
                f"{self.path}: no MLA attention layers; the latent cache needs an MLA model"
            )
        return self


def read_config(model_dir: str | Path) -> dict:
    p = Path(model_dir).expanduser()
    cfg = p / "config.json"
    if not p.is_dir():
        raise MacserveError(
            f"{model_dir}: not a model folder (download it first, e.g. "
            "huggingface-cli download ORG/NAME --local-dir DIR)"
        )
    try:
        return json.loads(cfg.read_text())
    except FileNotFoundError:
        raise MacserveError(f"{model_dir}: no config.json") from None
    except (OSError, ValueError) as e:
        raise MacserveError(f"{cfg}: {e}") from None


def load(model_dir: str | Path, split: list[int] | None = None) -> Bundle:
    """The model, on this rank's share of the layers under mlx.launch (`split`: layers per
    rank, default mlx-lm's even split)."""
    path = Path(model_dir).expanduser().resolve()
    config = read_config(path)
    group = mx.distributed.init()
    if group.size() > 1:
        # Under mlx.launch: this rank's share of the layers (mlx-lm's pipeline; rank 0 runs
        # the last ones). Every rank keeps the embeddings and head, so each computes logits.
        use_split(split)
        model, tokenizer = sharded_load(str(path), pipeline_group=group)
    else:
        model, tokenizer = mlx_load(str(path))
    if computes_float32():
        model.set_dtype(mx.float32)
    skip_latent_norm(model, config)
    mla_attention.install(model)  # MLA layers can then read the INT2 latent cache
    for token in turn_end_tokens(tokenizer):
        tokenizer.add_eos_token(str(token))
    return Bundle(model, tokenizer, config, path)


def computes_float32() -> bool:
    """The dtype rule: float32 when MLX's default device is the CPU (its gather_mm, the MoE
    experts, runs only in float32), else the checkpoint's own. sizing/host.py's
    `engine_float32` says the same without importing mlx, for the share and inspect (the
    engine imports no sizing); tests/test_share_host.py checks that the two agree here."""
    return mx.default_device().type == mx.DeviceType.cpu


def compute_dtype(model) -> mx.Dtype:
    """The dtype the model's activations, and so mlx-lm's caches, take: that of most of its
    floating parameters' bytes (after `load`'s float32 cast on the CPU; a quantized model's
    scales). sizing/host.py's `checkpoint_bytes` reads the same from the safetensors headers."""
    by: dict = {}
    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            by[a.dtype] = by.get(a.dtype, 0) + a.nbytes
    return max(by, key=lambda d: by[d]) if by else mx.float32


def held_in(model) -> str:
    """Where a log line says what mlx-lm's caches hold: "held in float32 on this CPU host"
    (the loader's cast) or "held in bfloat16, the checkpoint's dtype" (a GPU keeps it)."""
    name = str(compute_dtype(model)).rsplit(".", 1)[-1]
    return f"held in {name} " + (
        "on this CPU host" if computes_float32() else "(the checkpoint's dtype)"
    )


def skip_latent_norm(model, config: dict) -> int:
    """`qk_latent_layernorm: false` in config.json (TransMLA's converted models carry it):
    the MLA latent is used as projected, without DeepSeek's kv_a_layernorm, which a latent
    converted from a GQA model never had (`macserve dev transmla`). mlx-lm's own code always
    applies the norm. Returns how many layers skip it."""
    if config.get("qk_latent_layernorm", True) is not False:
        return 0
    attns = [a for a in mla_attention.mla_attentions(model) if hasattr(a, "kv_a_layernorm")]
    for a in attns:
        a.kv_a_layernorm = LatentAsProjected(a.kv_a_layernorm.weight)
    return len(attns)


class LatentAsProjected(nn.Module):
    """kv_a_layernorm's stand-in under `qk_latent_layernorm: false`: the latent passes through.
    It keeps the norm's weight (unused) because the engine reads the model's compute dtype
    from it (caches.model_dtype, scratch)."""

    def __init__(self, weight: mx.array):
        super().__init__()
        self.weight = weight

    def __call__(self, x: mx.array) -> mx.array:
        return x


TURN_MARKER = "macserve-turn-end-probe"


def turn_end_tokens(tokenizer) -> list[int]:
    """The token the chat template closes an assistant turn with (`<|end|>`, `<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`, DeepSeek's end of sentence), when the tokenizer's
    `eos_token` is another one: generation must stop there, or an answer runs on through the
    template's markers into a made-up next turn (the demo model did, for 1,009 tokens).
    mlx-lm stops only at the eos ids of the tokenizer and generation_config.json.

    Found by rendering a one-exchange conversation and reading the first token after the
    assistant's text: an added (special) token there is the turn's end."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": TURN_MARKER},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template may refuse this conversation in its own way (jinja raise)
        return []
    if TURN_MARKER not in text:
        return []
    after = tokenizer.encode(text.split(TURN_MARKER, 1)[1], add_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if after and after[0] in added and after[0] not in tokenizer.eos_token_ids:
        return [after[0]]
    return []
