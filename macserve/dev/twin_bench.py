"""llama-server on a GGUF against its MLX twin (dev/gguf_twin.py) on the same prompts, greedy:
`macserve bench twin`.

Per prompt (a chat turn rendered by the twin's own template, the same token ids sent to both):
- tokenization: llama-server's /tokenize of the rendered text against the twin's tokenizer;
- teacher-forced next-token agreement: over the prompt and llama-server's greedy answer, at
  every position, llama-server's greedy next token (/completion of the prefix, one token, its
  top two log-probabilities for the margin; the prompt cache makes each one token of work)
  against the argmax of the twin's logits from one MLX forward of the whole sequence. A
  disagreement where llama-server's own top two are within NEAR_TIE nats is counted apart:
  quantization noise (llama.cpp's CPU dot products quantize the activations to 8 bits; the
  twin computes in float32 from the same 4-bit weights) moves a log-probability by up to
  ~0.3 nats, so it can flip a near tie without any conversion fault. The gap itself (llama's
  log-probability of its top token against the twin's of the same token) is reported too;
- the first divergence of the two free greedy generations (None: the same tokens, the same
  stop);
- tokens/s of each: llama-server's own timings, mlx-lm's stream_generate's.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx

from ..errors import MacserveError
from .llama_server import stop_group

# nats between llama-server's top two: a flip there is noise, not a fault (the two engines'
# log-probabilities of one token differ by up to ~0.3 nats on SmolLM2: `bench twin`'s gap column)
NEAR_TIE = 0.5

PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Give me a tip for learning Python.",
)


@dataclass(frozen=True)
class Row:
    prompt: str
    prompt_tokens: int
    tokenize_agree: bool  # llama-server's /tokenize == the twin's tokenizer on the rendered text
    positions: int  # teacher-forced positions compared
    agree: int
    near_ties: int  # disagreements inside NEAR_TIE of llama-server's top two
    max_gap: float  # nats: the largest |llama - twin| log-probability of llama's top token
    generated: tuple[int, int]  # tokens llama-server, MLX generated (the end of turn counted)
    first_divergence: int | None  # index into the generations; None: identical
    llama_text: str
    mlx_text: str
    llama_tps: tuple[float, float]  # prompt, decode
    mlx_tps: tuple[float, float]


@contextlib.contextmanager
def llama_server(
    binary: str, gguf: Path, ctx: int = 4096, threads: int = 2, log: Path | None = None
):
    """A llama-server on `gguf` (one slot, `threads` threads) for the block; its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", str(ctx), "-np", "1", "-t", str(threads), "--no-warmup"]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if p.poll() is not None:
                raise MacserveError(f"llama-server exited with {p.returncode} on {gguf}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise MacserveError("llama-server did not become healthy in 120 s")
            time.sleep(0.2)
        yield url
    finally:
        stop_group(p)
        if log:
            out.close()


def _complete(client: httpx.Client, url: str, body: dict) -> dict:
    r = client.post(url + "/completion", json={"temperature": 0, **body}, timeout=300)
    if r.status_code != 200:
        raise MacserveError(f"llama-server /completion: {r.status_code} {r.text[:200]}")
    return r.json()


def llama_next(client: httpx.Client, url: str, seq: list[int], start: int = 1):
    """llama-server's greedy next token after each prefix seq[:p], p = start .. len(seq): (its
    id, the margin between its top two log-probabilities, its log-probability)."""
    out = []
    for p in range(start, len(seq) + 1):
        d = _complete(
            client, url, {"prompt": seq[:p], "n_predict": 1, "n_probs": 2, "cache_prompt": True}
        )
        top = d["completion_probabilities"][0]["top_logprobs"]
        margin = top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else float("inf")
        out.append((top[0]["id"], margin, top[0]["logprob"]))
    return out


def mlx_next(model, seq: list[int], ref: list[int], start: int = 1):
    """The twin after each prefix seq[:p], p = start .. len(seq), from one forward: its argmax
    and its log-probability of the token `ref` names there."""
    logits = model(mx.array([seq]))[0][start - 1 :].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, mx.array(ref)[:, None], axis=-1)[:, 0]
    return mx.argmax(logits, axis=-1).tolist(), picked.tolist()


def judge(ref, mine, mine_lp) -> tuple[int, int, float]:
    """(agreeing positions, disagreements that are near ties, the largest log-prob gap)."""
    agree = sum(a == m for (a, _, _), m in zip(ref, mine))
    near = sum(a != m and margin < NEAR_TIE for (a, margin, _), m in zip(ref, mine))
    gap = max((abs(lp - x) for (_, _, lp), x in zip(ref, mine_lp)), default=0.0)
    return agree, near, gap


def llama_generate(client: httpx.Client, url: str, ids: list[int], max_tokens: int, eos=()):
    """llama-server's greedy answer: its tokens (its end of turn as -1 when it stopped there:
    llama-server lists the end-of-turn token, mlx-lm does not), text and (prompt, decode)
    tokens/s from its own timings."""
    d = _complete(
        client,
        url,
        {"prompt": ids, "n_predict": max_tokens, "cache_prompt": False, "return_tokens": True},
    )
    toks = list(d["tokens"])
    if d.get("stop_type") == "eos":
        while toks and toks[-1] in eos:
            toks.pop()
        toks.append(-1)
    t = d["timings"]
    return toks, d["content"], (t["prompt_per_second"], t["predicted_per_second"])


def mlx_generate(model, tokenizer, ids: list[int], max_tokens: int):
    """mlx-lm's greedy answer, as `llama_generate` gives llama-server's."""
    from mlx_lm.generate import stream_generate  # noqa: I001  (imports transformers: 1-2 s)

    toks, last = [], None
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
        last = r
        if r.finish_reason != "stop" or r.token not in tokenizer.eos_token_ids:
            toks.append(int(r.token))
    if last is not None and last.finish_reason == "stop":
        toks.append(-1)
    text = tokenizer.decode([t for t in toks if t >= 0])
    tps = (last.prompt_tps, last.generation_tps) if last else (0.0, 0.0)
    return toks, text, tps


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(url: str, model, tokenizer, prompt: str, max_tokens: int) -> Row:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    with httpx.Client() as client:
        r = client.post(url + "/tokenize", json={"content": text, "parse_special": True})
        theirs = r.json()["tokens"]
        l_toks, l_text, l_tps = llama_generate(
            client, url, ids, max_tokens, set(tokenizer.eos_token_ids)
        )
        seq = ids + [t for t in l_toks if t >= 0]
        ref = llama_next(client, url, seq)
    m_toks, m_text, m_tps = mlx_generate(model, tokenizer, ids, max_tokens)
    mine, mine_lp = mlx_next(model, seq, [a for a, _, _ in ref])
    agree, near, gap = judge(ref, mine, mine_lp)
    return Row(
        prompt=prompt,
        prompt_tokens=len(ids),
        tokenize_agree=theirs == ids,
        positions=len(ref),
        agree=agree,
        near_ties=near,
        max_gap=gap,
        generated=(len(l_toks), len(m_toks)),
        first_divergence=first_divergence(l_toks, m_toks),
        llama_text=l_text,
        mlx_text=m_text,
        llama_tps=l_tps,
        mlx_tps=m_tps,
    )


def run(binary: str, gguf: Path, twin: Path, prompts=PROMPTS, max_tokens: int = 64, log=None):
    """Every prompt compared; yields a Row each (llama-server started once, the twin loaded
    once)."""
    from mlx_lm.utils import load  # noqa: I001  (imports transformers: 1-2 s)

    model, tokenizer = load(str(twin))
    with llama_server(binary, gguf, log=log) as url:
        for p in prompts:
            yield compare(url, model, tokenizer, p, max_tokens)
