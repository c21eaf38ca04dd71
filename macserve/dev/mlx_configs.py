"""The model configs mlx-lm's own test suite builds its models from, one per model type.

mlx-lm's `tests/test_models.py` (not shipped in its wheel: take it from a checkout) holds a
small config for nearly every model type it supports, as dict literals with a `model_type`
(`test_all_models`) or as `ModelArgs(model_type=..., ...)` calls. They are read with `ast`,
never run. `macserve dev mlx-check --from-mlx-tests FILE` measures each in mlx-lm and compares
it with inspect's modelled layout.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ..errors import MacserveError


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


_MISSING = object()


def _is_config(d) -> bool:
    return (
        isinstance(d, dict)
        and isinstance(d.get("model_type"), str)
        and any(k in d for k in ("num_hidden_layers", "num_layers", "n_layer", "text_config"))
    )


def configs_from_mlx_tests(path: Path) -> dict[str, dict]:
    """model_type -> the first literal config mlx-lm's tests give for it."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise MacserveError(f"{path}: cannot read mlx-lm's tests ({e})") from None
    found: list[dict] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            d = _literal(node)
            if _is_config(d):
                found.append((node.lineno, d))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ModelArgs":
            if any(k.arg is None for k in node.keywords):
                continue
            d = {k.arg: _literal(k.value) for k in node.keywords}
            if _MISSING not in d.values() and _is_config(d):
                found.append((node.lineno, d))
    out: dict[str, dict] = {}
    for _, d in sorted(found, key=lambda x: x[0]):
        out.setdefault(d["model_type"], d)
    return out
