"""The memory share inside mlx_lm.server's own process (run by mlx_drain.py, which calls
`apply` before mlx-lm's server starts): the limits its flags cannot set.

- MLX's own limits from the share (env MACSERVE_MEMORY_SHARE, _RESERVE, _BASELINE, bytes):
  `mx.set_memory_limit` to the share less the process's baseline (what MLX's allocator may
  hold: weights, caches, scratch; past it MLX frees its buffer cache and waits for buffers in
  use before it allocates more), `mx.set_cache_limit` to the reserve (MLX's buffer cache:
  mlx-lm's server never clears it). The wired limit stays mlx-lm's own;
- a prompt longer than CTX (env MACSERVE_CTX) is refused with a 400, as llama-server and the
  engine refuse one past their context: mlx_lm.server has no context flag and would prefill
  it, growing its cache past what the share counts. The count is mlx-lm's own tokenization of
  the request (`ResponseGenerator._tokenize`, run in its generation thread); the refusal
  reaches the client through mlx-lm's own error path, whose status (404 for every error
  there) this handler turns into 400 for this one. One host only: under mlx.launch the ranks
  step every request together, and a refusal on one of them alone would stall the others.
"""

from __future__ import annotations

import os
import threading
from typing import Any

MEMORY_SHARE_ENV = "MACSERVE_MEMORY_SHARE"
MEMORY_RESERVE_ENV = "MACSERVE_MEMORY_RESERVE"
MEMORY_BASELINE_ENV = "MACSERVE_MEMORY_BASELINE"
CTX_ENV = "MACSERVE_CTX"

_refused = threading.local()  # the handler thread whose request was too long


class PromptTooLong(ValueError):
    pass


def _int_env(name: str) -> int | None:
    try:
        v = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return v if v > 0 else None


def apply(server: Any, log) -> Any:
    """Set MLX's limits and the CTX check on mlx-lm's `server` module; returns a function that
    wraps its handler class (for the 400), or None when there is no CTX to check."""
    share, reserve = _int_env(MEMORY_SHARE_ENV), _int_env(MEMORY_RESERVE_ENV)
    if share:
        import mlx.core as mx  # here only: the shim runs in the server, after mlx-lm loads it

        base = _int_env(MEMORY_BASELINE_ENV) or 0
        limit = share - base if base < share else share
        mx.set_memory_limit(limit)
        if reserve:
            mx.set_cache_limit(reserve)
        log(
            f"MLX memory limit {limit:,} B (the share {share:,} B less the process), "
            f"buffer cache limit {reserve or 0:,} B"
        )
    ctx = _int_env(CTX_ENV)
    if ctx and "MLX_RANK" in os.environ:
        # under mlx.launch every rank steps each request together: one rank refusing what the
        # others tokenize and run would leave them waiting on it. Not checked there (yet)
        log(f"several hosts: a prompt past CTX={ctx} is not refused (one host only)")
        return None
    if not ctx:
        return None
    gen = server.ResponseGenerator
    own_tokenize, own_generate = gen._tokenize, gen.generate

    def tokenize(self, tokenizer, request, args):
        out = own_tokenize(self, tokenizer, request, args)
        n = len(out[0])
        if n > ctx:
            raise PromptTooLong(
                f"the prompt is {n:,} tokens; this server's context is {ctx:,} tokens (CTX)"
            )
        return out

    def generate(self, *args, **kwargs):
        _refused.flag = False
        try:
            return own_generate(self, *args, **kwargs)
        except PromptTooLong:
            _refused.flag = True  # this handler's thread: its error status is 400
            raise

    gen._tokenize, gen.generate = tokenize, generate

    def wrap(base: Any) -> Any:
        class Bounded(base):
            def _set_completion_headers(self, status_code: int = 200):
                if status_code == 404 and getattr(_refused, "flag", False):
                    _refused.flag = False
                    status_code = 400
                return super()._set_completion_headers(status_code)

        return Bounded

    return wrap
