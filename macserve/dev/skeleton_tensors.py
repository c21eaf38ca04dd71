"""The skeleton file: a GGUF of a Skeleton's hyperparameters and the tensors llama.cpp asks for.

The tensors are not listed by hand: `write_skeleton` asks llama.cpp. Each run of llama-server
on an incomplete skeleton stops at the first tensor it misses ("tensor 'X' not found") or
whose shape it disputes ("expected [a, b], got ..."); the skeleton grows by that tensor (a
placeholder first, then the shape llama.cpp expects, guessed for the next layer from the
previous one) until the model loads. Tensor data is a sparse-file hole (zeros, never
written); nothing is computed (`--no-warmup`).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from ..errors import MacserveError
from .gguf_skeleton import skeleton_metadata
from .llama_server import run_llama_server
from .skeleton_base import Skeleton

VOCAB = 64  # dummy tokens (tokenizer model "none")
MAX_RUNS = 2000  # tensor-discovery runs before giving up (one per new tensor, about)

_NOT_FOUND = re.compile(r"tensor '([^']+)' not found|missing tensor '([^']+)'")
_WRONG = re.compile(r"tensor '([^']+)' has wrong shape; expected ([\d,\s]+), got")
_COUNT = re.compile(r"wrong number of tensors; expected (\d+), got (\d+)")
_LOADING = re.compile(r"create_tensor: loading tensor (\S+)")
_POISON = (1,)  # a placeholder shape: llama.cpp answers with the one it wants


def _write(path: Path, sk: Skeleton, tensors: dict[str, tuple]) -> None:
    w = gguf.GGUFWriter(str(path), sk.arch)
    w.add_string("tokenizer.ggml.model", "none")
    w.add_uint32(f"{sk.arch}.vocab_size", VOCAB)
    for k, v in sk.kv.items():
        key = f"{sk.arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        else:
            w.add_string(key, str(v))
    for name, shape in tensors.items():
        # gguf-py takes numpy order (outermost first); llama.cpp reports ne order.
        np_shape, n = tuple(reversed(shape)), int(np.prod(shape))
        if len(shape) > 1 and shape[0] % 32 == 0:
            # Matrices as q4_0 (18 B per 32 values): the file, all of it mapped at load, is a
            # quarter of f16's size. Their values are never used.
            w.add_tensor_info(
                name, np_shape, np.dtype(np.float32), n // 32 * 18, gguf.GGMLQuantizationType.Q4_0
            )
        else:
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), 4 * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    start = gguf.GGUFWriter.ggml_pad(f.tell(), w.data_alignment)
    size = sum(
        gguf.GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values()
    )
    f.flush()
    f.truncate(start + size)  # the data: a hole of zeros, never written
    w.close()


def write_header(config: dict, path: Path) -> Skeleton:
    """The skeleton's header alone, with no tensors: all that `macserve inspect` reads of a
    GGUF, written without llama-server (llama-server would refuse it)."""
    sk = skeleton_metadata(config)
    _write(path, sk, {})
    return sk


def write_skeleton(config: dict, path: Path, server: str, log=lambda m: None) -> Skeleton:
    """Write a skeleton GGUF of `config` that `server` loads, learning its tensors from
    llama.cpp's own errors. Returns the Skeleton (arch and hyperparameters).

    A tensor learned on one layer is guessed, with its shape, for every later layer (most
    layers are alike: about one run per kind of tensor instead of one per tensor). When
    llama.cpp then finds tensors in the file it never asked for, those are dropped: its debug
    log names every tensor it loads (`create_tensor: loading tensor ...`)."""
    sk = skeleton_metadata(config)
    shapes: dict[str, tuple] = {}
    n_layers = int(sk.kv["block_count"])
    killed = 0
    for runs in range(1, MAX_RUNS + 1):
        _write(path, sk, shapes)
        # -lv 5 (debug): the loader names each tensor it loads.
        code, out = run_llama_server(server, path, 256, verbosity=5)
        # Loaded: it made all its caches and went on to reserve its graphs (_run stops it
        # there: what follows, a graph over zero weights, does not matter here).
        if code is None:
            log(f"skeleton: {len(shapes)} tensors, {runs} llama-server runs")
            return sk
        if m := _WRONG.search(out):
            name = m.group(1)
            shapes[name] = tuple(int(x) for x in m.group(2).split(",") if x.strip())
            for later in _later(name, n_layers):
                shapes.setdefault(later, shapes[name])
            continue
        if m := _NOT_FOUND.search(out):
            name = m.group(1) or m.group(2)
            if name in shapes:
                raise MacserveError(f"llama-truth: llama.cpp still misses {name!r}")
            shapes[name] = _POISON  # a placeholder: llama.cpp says the shape it wants
            continue
        if _COUNT.search(out):
            asked = set(_LOADING.findall(out))
            unused = [n for n in shapes if n not in asked]
            if not asked or not unused:
                raise MacserveError("llama-truth: cannot tell which tensors llama.cpp left unused")
            for n in unused:
                del shapes[n]
            continue
        if code is not None and code < 0 and killed < 2:
            # Killed by a signal mid-load with nothing said (the OOM killer, on a shared
            # machine): the same run again, twice at most.
            killed += 1
            continue
        errors = [l for l in out.splitlines() if " E " in l or "error" in l.lower()]
        tail = "\n".join((errors or out.splitlines())[-12:])
        raise MacserveError(
            f"llama-truth: llama-server (exit {code}) refused the skeleton:\n{tail}"
        )
    raise MacserveError(f"llama-truth: no loadable skeleton after {MAX_RUNS} runs")


def _later(name: str, n_layers: int) -> list[str]:
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if not m:
        return []
    return [f"blk.{j}.{m.group(2)}" for j in range(int(m.group(1)) + 1, n_layers)]
