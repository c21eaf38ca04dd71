"""What mlx-lm itself allocates for a config: its own model code, built and run lazily.

`measure(config)` builds the model mlx-lm would load for `config` (`Model(ModelArgs)` of the
module `mlx_lm.utils._get_classes` picks) with weights that are never evaluated: MLX is lazy,
so constructing a 671B model and running tokens through it computes nothing and allocates
nothing, yet every array's shape and dtype is known. The weights are cast to bf16 (what a
checkpoint loads as), the model's own `make_prompt_cache` makes its caches, and two short
forwards (a prefill, then one decode step, as generation does) run through them. The bytes of
every array each cache object holds then say, per cache:

- what grows per token: the difference between two context lengths 256 tokens apart (mlx-lm
  allocates growth in steps of 256 tokens), both past every window;
- what stays fixed per sequence: recurrent states, conv tails, ring buffers (a cache with a
  `max_size`/`window_size`/`chunk_size` is reported as a window of that many rows);
- whatever the model code does beside that: `deepseek_v32`'s indexer sets
  `cache.values = mx.zeros_like(cache.keys)`, and that array is counted like any other.

Nothing here is a table of mlx-lm's classes: a model type mlx-lm adds next month is measured
the same way. Where mlx-lm has no module for the model type (or cannot build the config), the
answer is None with the reason, and inspect falls back to its modelled layout (kv_layout.py).

Cost: mlx (0.3 s to import) and one model module; not mlx_lm's package (its __init__ pulls
transformers: 1.8 s here). The result is kept under $MACSERVE_HOME/cache/mlx-layout, keyed
by the config and the mlx / mlx-lm versions, so a repeat `inspect` imports no mlx at all.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path

from .. import env
from ..fileio import atomic_write

FORMAT = 3  # bump when what is stored or how it is measured changes
STEP = 256  # mlx-lm's KVCache / RotatingKVCache allocation step
_WINDOW_ATTRS = ("max_size", "window_size", "chunk_size", "sliding_window")


@dataclass(frozen=True)
class CacheBytes:
    """One cache object mlx-lm makes (one per layer that caches anything).

    per_token: bytes added per token of context, as num/den (compressed caches add a row
    every few tokens); fixed: bytes held whatever the context, past every window; window:
    the rows of a ring buffer (0: none), whose bytes are in `fixed`. model_*: the part of
    per_token and fixed held in the model's dtype (bf16 here: the engine on a CPU host holds
    it in float32, sizing/host.py), the rest being fp32 states and the like."""

    index: int
    cls: str
    per_token_num: int
    per_token_den: int
    fixed: int
    window: int = 0
    model_per_token_num: int = 0
    model_per_token_den: int = 1
    model_fixed: int = 0

    @property
    def per_token(self) -> Fraction:
        return Fraction(self.per_token_num, self.per_token_den)

    @property
    def model_per_token(self) -> Fraction:
        return Fraction(self.model_per_token_num, self.model_per_token_den)


@dataclass(frozen=True)
class Measured:
    """mlx-lm's caches for one config, or why there is no measurement (`caches` None)."""

    engine: str  # "mlx-lm 0.32.2"
    module: str | None
    caches: tuple | None  # of CacheBytes
    reason: str = ""
    at: tuple = ()  # the two context lengths measured

    @property
    def ok(self) -> bool:
        return self.caches is not None

    @property
    def per_token(self) -> Fraction:
        return sum((c.per_token for c in self.caches or ()), Fraction(0))

    @property
    def fixed(self) -> int:
        return sum(c.fixed for c in self.caches or ())


# ---------------------------------------------------------------------------------------
# which module, which versions (read from files: importing mlx_lm costs seconds)


@cache
def mlx_lm_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")
    if not spec or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def utils_constant(name: str) -> dict:
    """A dict literal of mlx_lm/utils.py (MODEL_REMAPPING...), read without importing it."""
    d = mlx_lm_dir()
    try:
        tree = ast.parse((d / "utils.py").read_text())
    except (OSError, SyntaxError, TypeError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == name for t in node.targets
        ):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return {}
    return {}


def module_name(config: dict) -> str | None:
    """The mlx_lm.models module `mlx_lm.utils._get_classes` would import for `config`
    (None: mlx-lm has none), following its MODEL_ARCHITECTURE_REMAPPING and MODEL_REMAPPING."""
    d = mlx_lm_dir()
    mt = config.get("model_type")
    if d is None or not isinstance(mt, str):
        return None
    archs = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    by_arch = utils_constant("MODEL_ARCHITECTURE_REMAPPING")
    name = next((by_arch[(mt, a)] for a in archs if (mt, a) in by_arch), None)
    name = name or utils_constant("MODEL_REMAPPING").get(mt, mt)
    return name if (d / "models" / f"{name}.py").exists() else None


def engine_name() -> str:
    return f"mlx-lm {_version('mlx-lm') or '?'}"


# ---------------------------------------------------------------------------------------
# the on-disk cache of measurements


def _key(config: dict) -> str:
    text = json.dumps(
        [FORMAT, _version("mlx-lm"), _version("mlx"), config], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _cache_path(config: dict) -> Path:
    return env.home() / "cache" / "mlx-layout" / f"{_key(config)}.json"


def _load(path: Path) -> Measured | None:
    try:
        d = json.loads(path.read_text())
        caches = d.pop("caches")
        return Measured(
            **{**d, "at": tuple(d.get("at", ()))},
            caches=None if caches is None else tuple(CacheBytes(**c) for c in caches),
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None  # absent or from another format: measure again


def _store(path: Path, m: Measured) -> None:
    d = asdict(m)
    d["caches"] = None if m.caches is None else [asdict(c) for c in m.caches]
    # A read-only home only costs the next run its speed.
    with contextlib.suppress(OSError):
        atomic_write(path, json.dumps(d))


def measure(config: dict, use_cache: bool = True) -> Measured:
    """mlx-lm's allocation for `config` (a model's config.json as a dict)."""
    engine = engine_name()
    name = module_name(config)
    if name is None:
        why = (
            "mlx-lm is not installed"
            if mlx_lm_dir() is None
            else f"{engine} has no module for {config.get('model_type')!r}"
        )
        return Measured(engine, None, None, why)
    path = _cache_path(config)
    if use_cache and (hit := _load(path)) is not None:
        return hit
    m = _run(config, name, engine)
    _store(path, m)
    return m


# ---------------------------------------------------------------------------------------
# the measurement itself


def _import_model_module(name: str):
    # mlx and mlx-lm are imported here, not at the top: only a measurement needs them (a
    # warm cache, `--modelled` and GGUF sources never do). mlx_lm/__init__.py imports
    # mlx_lm.convert and with it transformers (1.8 s here); the model modules need neither.
    # When mlx_lm is not loaded yet, a bare package object stands in for it while the model
    # module loads (mlx-lm's own files, unmodified); it and the modules loaded under it are
    # dropped afterwards, so a later `import mlx_lm` runs the real __init__ and gets a whole
    # package (the modules stay alive through the objects that use them).

    stand_in = "mlx_lm" not in sys.modules
    before = set(sys.modules)
    if stand_in:
        d = mlx_lm_dir()
        spec = importlib.util.spec_from_file_location(
            "mlx_lm", d / "__init__.py", submodule_search_locations=[str(d)]
        )
        sys.modules["mlx_lm"] = importlib.util.module_from_spec(spec)
    try:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        cache_mod = importlib.import_module("mlx_lm.models.cache")
    finally:
        if stand_in:
            for name in set(sys.modules) - before:
                if name == "mlx_lm" or name.startswith("mlx_lm."):
                    del sys.modules[name]
    return mod, cache_mod


def _leaves(c) -> list:
    """A cache object and the caches inside it (CacheList and kin), leaves first-class."""
    inner = getattr(c, "caches", None)
    if isinstance(inner, (list, tuple)) and inner and all(hasattr(x, "__dict__") for x in inner):
        return [leaf for x in inner for leaf in _leaves(x)]
    return [c]


def _window(c) -> int:
    for a in _WINDOW_ATTRS:
        v = getattr(c, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _run(config: dict, name: str, engine: str) -> Measured:
    # See _import_model_module: mlx is needed only for a measurement.
    import mlx.core as mx

    try:
        mod, cache_mod = _import_model_module(name)
        model = mod.Model(mod.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)  # a checkpoint's weights, hence the activations
        caches = cache_mod.make_prompt_cache(model)
        # Measure past every window (ring buffers, chunks), 256 tokens apart: growth is
        # allocated in steps of 256, so the difference is exact. Without windows the first
        # point is one token (its allocation is one whole step): the recurrent layers of a
        # hybrid then run 257 tokens, not 512 (their ops loop per token on the CPU).
        widest = max((_window(leaf) for c in caches for leaf in _leaves(c)), default=0)
        t1 = -(-(widest + 1) // STEP) * STEP if widest else 1
        at = (t1, t1 + STEP)
        first = _bytes_after(model, caches, at[0], mx)
        second = _bytes_after(model, caches, at[1], mx, start=at[0])
    except Exception as e:  # any failure of mlx-lm's code means "not measured"
        return Measured(engine, name, None, f"{engine} could not build it: {type(e).__name__}: {e}")
    out = []
    leaves = [leaf for c in caches for leaf in _leaves(c)]
    steps = -(-at[0] // STEP) * STEP  # growth is held in whole steps
    for i, (leaf, (a, ma), (b, mb)) in enumerate(zip(leaves, first, second)):
        per, mper = Fraction(b - a, at[1] - at[0]), Fraction(mb - ma, at[1] - at[0])
        fixed, mfixed = a - per * steps, ma - mper * steps
        w = _window(leaf) if per == 0 and fixed else 0
        out.append(
            CacheBytes(
                i,
                type(leaf).__name__,
                per.numerator,
                per.denominator,
                int(fixed),
                w,
                mper.numerator,
                mper.denominator,
                int(mfixed),
            )  # fmt: skip
        )
    return Measured(engine, name, tuple(out), "", at)


def _bytes_after(model, caches, upto: int, mx, start: int = 0) -> list[tuple[int, int]]:
    """Run tokens start..upto through the caches (a prefill, then one decode step) and
    return the bytes each leaf cache holds: (all, those in the model's dtype)."""
    if upto - start > 1:
        model(mx.zeros((1, upto - start - 1), dtype=mx.int32), cache=caches)
    model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    return [
        (_nbytes(leaf, mx), _nbytes(leaf, mx, mx.bfloat16)) for c in caches for leaf in _leaves(c)
    ]


def _nbytes(obj, mx, dtype=None) -> int:
    """Bytes of every distinct mx.array an object holds (attributes, lists, dicts); `dtype`:
    only those of that dtype."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, mx.array):
            if id(o) not in seen:
                seen.add(id(o))
                total += o.nbytes if dtype is None or o.dtype == dtype else 0
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(vars(o).values())
    return total
