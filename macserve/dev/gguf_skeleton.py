"""config.json -> the GGUF hyperparameters llama.cpp reads: `skeleton_metadata(config)`.

It writes them as llama.cpp's converter, convert_hf_to_gguf.py, would, and keeps everything
the KV cache depends on: layer count and kinds, KV heads, key/value lengths, MLA ranks, sliding
windows and their pattern, SSM and indexer dimensions. What the cache does not depend on is
shrunk, so a skeleton of a 1T-parameter model is a few MB: the vocabulary (64 dummy tokens),
FFN and expert widths, expert counts, the LoRA ranks of queries, and the hidden size where no
cache depends on it (llama.cpp needs explicit key/value lengths then; they are written).

`ARCHS` maps a config's model_type to its llama.cpp architecture: skeleton_gqa.py (K and V
per head) and skeleton_hybrid.py (latent and recurrent layers); what they share is
skeleton_base.py. skeleton_tensors.py then writes the file.
"""

from __future__ import annotations

from ..errors import MacserveError
from ..hf_config import text_config
from .skeleton_base import UNMAPPED, Skeleton
from .skeleton_gqa import GQA_ARCHS
from .skeleton_hybrid import HYBRID_ARCHS

ARCHS = {**GQA_ARCHS, **HYBRID_ARCHS}


def skeleton_metadata(config: dict) -> Skeleton:
    """The llama.cpp architecture and hyperparameters for `config` (raises for the model types
    this tool does not map; the list is `ARCHS`)."""
    mt = config.get("model_type")
    c = text_config(config)
    fn = ARCHS.get(mt) or ARCHS.get(c.get("model_type"))
    if fn is None and (mt in UNMAPPED or c.get("model_type") in UNMAPPED):
        raise MacserveError(UNMAPPED.get(mt) or UNMAPPED[c["model_type"]])
    if fn is None:
        raise MacserveError(
            f"llama-truth: no GGUF mapping for model_type {mt!r} (have: {', '.join(sorted(ARCHS))})"
        )
    return fn(c)
