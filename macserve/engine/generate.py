"""The decode loop: load a model once, then stream tokens for one prompt at a time.

Sampling, the KV cache and prefill chunking are mlx-lm's (`generate_step`, `make_sampler`);
this module adds what a server needs around them: a stop callback checked before every token
(and between prefill chunks), EOS handling, streaming detokenization and per-request stats.

Not thread-safe: one generation at a time per Bundle, from one thread (the server's worker).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import MacserveError


# A model folder may ship its calibration under this name; --kv int2 then needs no --rotation.
SHIPPED_ROTATION = "latent-rotation.safetensors"


@dataclass
class Bundle:
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    path: Path
    _mtp: Any = None
    _calibrations: dict = field(default_factory=dict)

    def mtp(self):
        """The MTP layer, loaded on first use (mlx-lm's loader drops it)."""
        if self._mtp is None:
            import mlx.core as mx

            from .mtp_layer import load_mtp_layers

            layers = load_mtp_layers(self.path, trunk=self.model)
            if not layers:
                raise MacserveError(f"{self.path}: the model has no MTP layer (--mtp-k needs one)")
            self._mtp = layers[0]
            self._mtp.set_dtype(self.model.model.embed_tokens.weight.dtype)
            from . import mla_attention

            mla_attention.install(self.model, extra=[self._mtp.self_attn])
            mx.eval(self._mtp.parameters())
        return self._mtp

    def caches(self, kv: str, rotation: str | Path | None):
        """A fresh prompt cache: mlx-lm's own for kv=bf16, the rotated latent cache for int2."""
        from mlx_lm.models.cache import make_prompt_cache

        if kv == "bf16":
            return make_prompt_cache(self.model)
        from .calibrate import DEFAULT_METHOD, Calibration
        from .kv import make_caches
        from .latent_cache import LatentQuant

        if kv != "int2":
            raise ValueError(f"kv must be bf16 or int2, not {kv!r}")
        if rotation is None and (self.path / SHIPPED_ROTATION).exists():
            rotation = self.path / SHIPPED_ROTATION
        if rotation is None:
            raise MacserveError("--kv int2 needs --rotation FILE (macserve calibrate)")
        key = str(rotation)
        if key not in self._calibrations:
            try:
                self._calibrations[key] = Calibration.load(rotation)
            except ValueError as e:
                raise MacserveError(str(e)) from None
        cal = self._calibrations[key]
        try:
            return make_caches(self.model, LatentQuant(bits=2), cal, cal.meta.get("default", DEFAULT_METHOD))
        except ValueError as e:
            raise MacserveError(str(e)) from None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)


@dataclass
class Step:
    """One streamed token. The last Step of a finished generation has finish_reason "stop"
    (the model emitted EOS: `token` is that EOS id, not counted in stats, `text` only the
    detokenizer's flush) or "length" (max_tokens reached: `token` is the last real token).
    A generation cancelled by `stop` simply ends without a finishing Step."""

    token: int
    text: str
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)


@dataclass
class Counters:
    """Speculative-decoding counts a token source updates as it goes (plain decoding: 0)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


def read_config(model_dir: str | Path) -> dict:
    p = Path(model_dir).expanduser()
    cfg = p / "config.json"
    if not p.is_dir():
        raise MacserveError(f"{model_dir}: not a model folder (download it first, e.g. "
                            "huggingface-cli download ORG/NAME --local-dir DIR)")
    try:
        return json.loads(cfg.read_text())
    except FileNotFoundError:
        raise MacserveError(f"{model_dir}: no config.json") from None
    except (OSError, ValueError) as e:
        raise MacserveError(f"{cfg}: {e}") from None


def load(model_dir: str | Path, split: list[int] | None = None) -> Bundle:
    """The model, on this rank's share of the layers under mlx.launch (`split`: layers per
    rank, default mlx-lm's even split)."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    path = Path(model_dir).expanduser().resolve()
    config = read_config(path)
    group = mx.distributed.init()
    if group.size() > 1:
        # Under mlx.launch: this rank's share of the layers (mlx-lm's pipeline; rank 0 runs
        # the last ones). Every rank keeps the embeddings and head, so each computes logits.
        from mlx_lm.utils import sharded_load

        from ..providers.mlx_split import use_split

        use_split(split)
        model, tokenizer = sharded_load(str(path), pipeline_group=group)
    else:
        model, tokenizer = mlx_load(str(path))
    if mx.default_device().type == mx.DeviceType.cpu:
        # MLX's CPU gather_mm (the MoE experts) only runs in float32.
        model.set_dtype(mx.float32)
    from . import mla_attention

    mla_attention.install(model)  # MLA layers can then read the INT2 latent cache
    return Bundle(model, tokenizer, config, path)


class _Cancelled(Exception):
    pass


def _plain_tokens(bundle: Bundle, prompt, max_tokens: int, sampler, counters: Counters,
                  progress, cache=None) -> Iterator[int]:
    """The token source: mlx-lm's own loop. An MTP source yields tokens the same way and
    bumps `counters` for each drafted / accepted token."""
    from mlx_lm.generate import generate_step

    for token, _ in generate_step(prompt, bundle.model, max_tokens=max_tokens, sampler=sampler,
                                  prompt_progress_callback=progress, prompt_cache=cache):
        yield int(token)


def _mtp_tokens(bundle: Bundle, prompt_ids, max_tokens, temperature, counters, k, cache,
                seed) -> Iterator[int]:
    from .mtp_decode import MTPDecoder

    dec = MTPDecoder(bundle.model, bundle.mtp(), k=k)
    for token in dec.generate(list(prompt_ids), max_tokens, caches=cache, temperature=temperature,
                              eos=bundle.eos_ids, seed=seed):
        counters.draft_tokens = dec.stats.draft_tokens
        counters.accepted_tokens = dec.stats.accepted_tokens
        yield token


def stream(bundle: Bundle, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
           top_p: float = 1.0, stop: Callable[[], bool] | None = None, kv: str = "bf16",
           rotation: str | Path | None = None, mtp_k: int = 0, seed: int = 0) -> Iterator[Step]:
    """Stream one generation. kv="int2" reads the rotated INT2 latent cache (needs `rotation`,
    a `macserve calibrate` file); mtp_k > 0 drafts with the model's MTP layer (top_p < 1 is
    not supported with drafting, so it decodes plainly then)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream, wired_limit
    from mlx_lm.sample_utils import make_sampler

    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if not prompt_ids:
        raise ValueError("empty prompt")
    # make_sampler applies top-p only for 0 < top_p < 1, so 1.0 means "off", as in OpenAI's API.
    sampler = make_sampler(temp=temperature, top_p=top_p)
    detok = bundle.tokenizer.detokenizer
    eos = bundle.eos_ids
    counters = Counters()
    stop = stop or (lambda: False)

    def progress(done, total):
        # Raising is the only way out of mlx-lm's prefill; it lets a long prompt be cancelled.
        if stop():
            raise _Cancelled

    t0 = time.perf_counter()
    t_first = None
    n = 0

    def stats() -> dict:
        now = time.perf_counter()
        prompt_s = (t_first or now) - t0
        gen_s = now - t_first if t_first else 0.0
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
            "prompt_tps": len(prompt_ids) / prompt_s if prompt_s > 0 else 0.0,
            "generation_tps": n / gen_s if gen_s > 0 else 0.0,
            "prompt_seconds": prompt_s,
            "generation_seconds": gen_s,
            "draft_tokens": counters.draft_tokens,
            "accepted_tokens": counters.accepted_tokens,
        }

    cache = bundle.caches(kv, rotation)
    if mtp_k > 0 and (top_p >= 1.0 or top_p <= 0):
        tokens = _mtp_tokens(bundle, prompt_ids, max_tokens, temperature, counters, mtp_k, cache,
                             seed)
    else:
        tokens = _plain_tokens(bundle, mx.array(prompt_ids), max_tokens, sampler, counters,
                               progress, cache)
    with wired_limit(bundle.model, [generation_stream]):
        try:
            for token in tokens:
                if t_first is None:
                    t_first = time.perf_counter()
                if stop():
                    return
                if token in eos:
                    detok.finalize()
                    yield Step(token, detok.last_segment, "stop", stats())
                    return
                n += 1
                detok.add_token(token)
                if n >= max_tokens:
                    detok.finalize()
                    yield Step(token, detok.last_segment, "length", stats())
                    return
                yield Step(token, detok.last_segment, None, stats())
        except _Cancelled:
            return
        finally:
            tokens.close()
