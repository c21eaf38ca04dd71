"""What llama.cpp itself allocates for a model config: a shrunken GGUF skeleton, loaded by the
real llama-server, and the cache sizes it logs.

gguf_skeleton.py turns the config into the GGUF hyperparameters llama.cpp reads (what the KV
cache depends on kept, the rest shrunk to a few MB), skeleton_tensors.py writes the file with
the tensors llama.cpp asks for, and llama_server.py runs llama-server on it.

`measure(config, server, ctx)` then runs `llama-server --fit off --no-warmup -lv 4 -c ctx
-np 1` and parses every cache line llama.cpp prints (`llama_kv_cache: size = ...`,
`llama_memory_recurrent: size = ...`, DeepSeek-V4's `llama_dsv4_comp_state: ... size = ...`),
in MiB with two decimals as logged.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MacserveError
from .llama_server import run_llama_server
from .skeleton_tensors import write_skeleton

_KV_LINE = re.compile(
    r"(llama_kv_cache|llama_memory_recurrent)\w*: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers"
)
# llama_dsv4_comp_state (src/llama-kv-cache-dsv4.cpp): DeepSeek-V4's f32 compressor states.
_STATE_LINE = re.compile(
    r"(llama_dsv4_comp_state)\w*: +(\w+) ratio = (\d+), state = (\d+) x (\d+), "
    r"streams = \d+, rs_seq = \d+, layers = +(\d+), size = +([\d.]+) MiB"
)
_PARTS = re.compile(r"([KVRSP]) \((\w+)\): +([\d.]+) MiB")


@dataclass(frozen=True)
class CacheLine:
    """One `size = ...` line: a KV cache (K, V) or a recurrent memory (R, S, P)."""

    module: str
    mib: float
    cells: int
    layers: int
    parts: tuple  # ((letter, type, MiB), ...)


@dataclass(frozen=True)
class LlamaCaches:
    arch: str
    ctx: int
    lines: tuple

    @property
    def mib(self) -> float:
        return sum(line.mib for line in self.lines)

    @property
    def tolerance_mib(self) -> float:
        """Each logged figure is rounded to 0.01 MiB."""
        return 0.005 * len(self.lines) + 1e-9


def parse_caches(log: str) -> tuple:
    out = []
    for line in log.splitlines():
        if m := _STATE_LINE.search(line):
            # kv and score planes, f32: rows = the state's rows (fixed, whatever the context)
            mib = float(m.group(7))
            out.append(
                CacheLine(
                    f"{m.group(1)} ({m.group(2)})",
                    mib,
                    int(m.group(4)),
                    int(m.group(6)),
                    (("S", "f32", mib),),
                )
            )
            continue
        m = _KV_LINE.search(line)
        if not m:
            continue
        parts = tuple((p, t, float(v)) for p, t, v in _PARTS.findall(line))
        out.append(
            CacheLine(m.group(1), float(m.group(2)), int(m.group(3)), int(m.group(4)), parts)
        )
    return tuple(out)


def measure(
    config: dict, server: str, ctx: int, workdir: Path, cache_type: str = "f16", log=lambda m: None
) -> LlamaCaches:
    """Load a skeleton of `config` in llama-server at `-c ctx` and read its cache lines."""
    path = workdir / "skeleton.gguf"
    sk = write_skeleton(config, path, server, log)
    got = caches_of(path, sk.arch, server, ctx, cache_type)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return got


def caches_of(path: Path, arch: str, server: str, ctx: int, cache_type: str = "f16") -> LlamaCaches:
    """The caches llama-server makes for the GGUF at `path` (a skeleton write_skeleton made)
    at `-c ctx -np 1`."""
    extra = ("-ctk", cache_type, "-ctv", cache_type) if cache_type != "f16" else ()
    for _ in range(3):
        code, out = run_llama_server(server, path, ctx, extra)
        # code None: it got past making every cache. Anything else (killed mid-way on a
        # loaded machine, say) may have logged only some of them: run again.
        if code is None:
            break
    lines = parse_caches(out)
    if code is not None or not lines:
        tail = "\n".join(out.splitlines()[-15:])
        raise MacserveError(
            f"llama-truth: llama-server (exit {code}) did not make all its caches:\n{tail}"
        )
    return LlamaCaches(arch, ctx, lines)
