"""`bench serve`'s bytes on disk: what the prompt cache's disk tier holds per token of a long
prefix, measured on the model served (the restart scenario's first turn, serve_restart.py:
the files in the server's `--prompt-cache-dir` once it stopped, over the tokens its stored
entry holds), INT2 against the bf16 cache, and projected at DeepSeek-V3's width from the
per-row formula (`stored_bytes`), which is checked against the measurement at the served
model's width (`formula_bytes` beside `bytes`).

The formula: per MLA layer, an INT2 prefix of P tokens stores its sink in bf16, codes for
every later token (`LatentQuant.row_bytes`) and one window of `recent` + `slack` bf16 rows
(engine/stored_codes.py); the token ids, int32, in its blocks and again in its tail. A
snapshot taken after decode steps may hold up to 32 window rows more (the window is cut back
in steps of 32). The bf16
cache stores every row in bf16: (kv_lora_rank + rope) x 2 bytes a layer, which is mlx-lm's
own cache for DeepSeek-V3 (`inspect` measures its 70,272 bytes a token, 61 x 1,152). File
headers (a few KB a file) are left out of the formula, in the measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ...int2_format import BF16, INT2, LatentQuant, read_plan
from .synthetic import DEEPSEEK_V3_ATTENTION

DEEPSEEK_V3_LAYERS = 61  # its config.json's num_hidden_layers
PROJECT_TOKENS = 128 * 1024
PREFILL_CHUNK = 2048  # the server's prefill chunk (format 3 kept a window at each one's end)
BLOCK = 256  # the disk tier's block (server/disk_cache.py's BLOCK_TOKENS)
TOKEN_ID = 4  # int32


def stored_bytes(quants: list[LatentQuant | None], latent: int, rope: int, tokens: int) -> int:
    """Array bytes a stored prefix of `tokens` tokens holds: one quant per layer (None: the
    bf16 cache, every row in bf16)."""
    row16 = BF16 * (latent + rope)
    total = TOKEN_ID * (tokens + tokens // BLOCK * BLOCK)  # the tail's ids, the blocks'
    for q in quants:
        if q is None or q.bits is None:
            total += tokens * row16
            continue
        sink = min(tokens, q.sink)
        window = min(tokens - sink, q.recent + q.slack)
        total += (sink + window) * row16 + (tokens - sink) * q.row_bytes(latent, rope)
    return total


def format3_bytes(q: LatentQuant, latent: int, rope: int, layers: int, tokens: int) -> int:
    """What format 3 stored for the same prefix prefilled alone: codes up to the window and a
    window in the tail of every whole prefill chunk's end as well as the prefix's own."""
    row16 = BF16 * (latent + rope)
    ends = [e for e in range(PREFILL_CHUNK, tokens, PREFILL_CHUNK)] + [tokens]
    per_layer = min(tokens, q.sink) * row16
    per_layer += max(0, tokens - q.sink - q.recent) * q.row_bytes(latent, rope)
    per_layer += sum(min(max(0, e - q.sink), q.recent + q.slack) * row16 for e in ends)
    return layers * per_layer + TOKEN_ID * (tokens + sum(ends))


def projection(tokens: int = PROJECT_TOKENS) -> dict:
    """At DeepSeek-V3's width (kv_lora_rank 512, rope 64, 61 layers), the shipped format."""
    r, d = DEEPSEEK_V3_ATTENTION["kv_lora_rank"], DEEPSEEK_V3_ATTENTION["qk_rope_head_dim"]
    n = DEEPSEEK_V3_LAYERS
    int2 = stored_bytes([INT2] * n, r, d, tokens)
    bf16 = stored_bytes([None] * n, r, d, tokens)
    old = format3_bytes(INT2, r, d, n, tokens)
    return {
        "what": "projection from the per-row formula (serve_disk.stored_bytes), not measured",
        "model": "DeepSeek-V3 width: kv_lora_rank 512, rope 64, 61 layers",
        "tokens": tokens,
        "int2_bytes": int2,
        "bf16_bytes": bf16,
        "int2_bytes_per_token": round(int2 / tokens, 1),
        "bf16_bytes_per_token": round(bf16 / tokens, 1),
        "int2_format3_bytes": old,  # before: a window per 2,048-token chunk
        "bf16_over_int2": round(bf16 / int2, 2),
    }


def _widths(model: Path) -> tuple[int, int, int]:
    cfg = json.loads((model / "config.json").read_text())
    return cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["num_hidden_layers"]


def measure(folder: Path, model: Path, int2: bool) -> dict:
    """The disk tier's files in `folder` (one server's `--prompt-cache-dir`, after it
    stopped), and of them its longest stored entry's: its tail and the blocks of its chain
    (a block i whose token ids are the tail's [iN, (i+1)N): its chain's, as two prefixes that
    differ earlier do not share tokens at one place here); bytes per token of that entry and,
    with `int2`, the formula's bytes at the model's width for as many tokens."""
    files = sorted(Path(folder).rglob("*.safetensors"))
    tails = {t: mx.load(str(t))["tokens"] for t in files if t.name.startswith("t-")}
    out = {
        "folder_bytes": sum(f.stat().st_size for f in files),
        "folder_files": len(files),
        "folder_entries": len(tails),
    }
    if not tails:
        return out
    tail, ids = max(tails.items(), key=lambda kv: kv[1].size)
    ids = ids.tolist()
    mine = [tail]
    for f in files:
        if f.name.startswith("b-"):
            arrays, meta = mx.load(str(f), return_metadata=True)
            i, n = int(meta["block"]), int(meta["n"])
            if arrays["tokens"].tolist() == ids[i * n : (i + 1) * n]:
                mine.append(f)
    nbytes = sum(f.stat().st_size for f in mine)
    out.update(tokens=len(ids), bytes=nbytes, files=len(mine))
    out["bytes_per_token"] = round(nbytes / len(ids), 1)
    if int2:
        r, d, layers = _widths(model)
        plan = read_plan(model / "latent-rotation.safetensors")
        out["formula_bytes"] = stored_bytes(plan.quants(INT2)[:layers], r, d, len(ids))
    return out
